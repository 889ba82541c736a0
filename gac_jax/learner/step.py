"""The GRPO train step on one rollout batch: what the batch needs once, then one or more
optimizer steps (`gac_jax.learner.update`).

`make_train_step` returns a pure function `(params, opt_state, batch, learner_version,
reference=None, *, frozen=None) -> (params, opt_state, metrics)` over `nnx.State` params;
the learner jits it with shardings and donation. Everything method-specific comes from the
`Objective` of a `LossConfig`, which reads the registry entries of `gac_jax.objectives`.

Design of the PPO-style updates (verl's ``ppo_epochs`` and mini-batches, AReaL's decoupled
PPO): before the first update, under the batch's starting params, the step computes the
log-probs of every row (the proximal policy of decoupled PPO, and the current policy of
VCPO's weights), the reference policy's log-probs (a KL penalty, `tb`), the rewards less an
in-reward KL penalty, and the advantages. Then, for each of `epochs` passes, the rows are
shuffled (a key folded from `seed`, the learner version and the epoch), split into
`mini_batches` strided mini-batches, and each mini-batch is one optimizer step, its
gradient accumulated over `micro_batches`. Per-update metrics come back stacked [U] (U =
epochs x mini_batches); with U = 1 every metric is a scalar, as before.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from gac_jax import objectives
from gac_jax.learner.batch import TrainBatch
from gac_jax.learner.objective import LossConfig, Objective
from gac_jax.learner.update import (  # noqa: F401 - guarded_update is part of the API
    forward,
    guarded_update,
    make_update,
    split_rows,
    whole_batch_logp,
)
from gac_jax.models.scoring import DEFAULT_CHUNK_SIZE
from gac_jax.numerics import masked_mean


def per_example_grad_sq_norms(
    graphdef,
    params,
    batch: TrainBatch,
    *,
    sequences_per_chunk: int | None = None,
    logits_chunk_size: int = DEFAULT_CHUNK_SIZE,
    frozen=None,
) -> jax.Array:
    """Exact `|grad_theta sum_t log pi(y_it)|^2` for every sequence i, [N].

    One backward pass per sequence. The gradients of `sequences_per_chunk` sequences (all
    N by default) are computed at once with `jax.vmap` and reduced to their squared norms
    before the next chunk's (`jax.lax.map`), so memory holds that many gradient-sized
    buffers, not N: for small models, or chunks of a few sequences.

    Args:
      graphdef, params: the model.
      batch: the sequences (tokens, attention and loss masks are read).
      sequences_per_chunk: sequences whose gradients exist at once; N by default.
      logits_chunk_size: positions whose logits exist at once (`forward`).
      frozen: the untrained rest of the model (LoRA's base), or None.
    """
    n = batch.tokens.shape[0]
    k = n if sequences_per_chunk is None else sequences_per_chunk
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"sequences_per_chunk={k!r} must be an int >= 1.")

    def sequence_logp(p, tokens, attention, loss_mask):
        one = TrainBatch(tokens[None], attention[None], loss_mask[None], *([None] * 4))
        logp, _ = forward(graphdef, p, one, logits_chunk_size, frozen)
        return jnp.sum(jnp.where(loss_mask[None], logp, 0.0))

    def sq_norm(row):
        grads = jax.grad(sequence_logp)(params, *row)
        return sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(grads))

    rows = (batch.tokens, batch.attention_mask, batch.loss_mask)
    return jax.lax.map(sq_norm, rows, batch_size=min(k, n))


def _advantages(objective: Objective, params, batch: TrainBatch, logp, exact_sq_norms):
    """Advantages of the whole batch; `exact_sq_norms(params, batch)` gives VCPO's exact
    gradient norms [N]."""
    if not objective.needs_log_weights:
        return objective.advantages(batch.rewards, batch.group_ids)
    log_w = objectives.sequence_log_ratio(logp, batch.behaviour_logp, batch.loss_mask)
    if objective.grad_norm == "exact":
        sq_norms = exact_sq_norms(params, batch)
    else:
        sq_norms = objectives.grad_sq_norm_proxy(batch.loss_mask, proxy=objective.grad_norm)
    return objective.advantages(
        batch.rewards, batch.group_ids, log_weights=log_w, grad_sq_norms=sq_norms
    )


def _batch_metrics(batch: TrainBatch, learner_version, adv_n) -> dict[str, jax.Array]:
    gap = (learner_version - batch.versions).astype(jnp.float32)
    lengths = jnp.sum(batch.loss_mask, axis=1, dtype=jnp.float32)
    return {
        "reward": jnp.mean(batch.rewards),
        "accuracy": jnp.mean((batch.rewards >= 1.0).astype(jnp.float32)),
        "response_length": jnp.mean(lengths),
        "version_gap_min": jnp.min(gap),
        "version_gap_mean": jnp.mean(gap),
        "version_gap_max": jnp.max(gap),
        "advantage_abs_mean": jnp.mean(jnp.abs(adv_n)),
    }


def _policy_change(forward_fn, params, batch: TrainBatch, before, parts: int, frozen):
    """How far the updates moved the policy on the batch's tokens (`make_train_step`)."""
    chunks = jax.tree.map(lambda x: split_rows(x, parts), batch)
    after = whole_batch_logp(functools.partial(forward_fn, frozen=frozen), params, chunks)
    delta = jnp.where(batch.loss_mask, after - before, 0.0)
    return {
        "policy_change/kl": masked_mean(
            objectives.kl_estimate(jnp.zeros_like(delta), delta, estimator="k3"),
            batch.loss_mask,
        ),
        "policy_change/log_ratio_sq": masked_mean(0.5 * delta * delta, batch.loss_mask),
    }


def _check_count(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be an int >= 1.")


def make_train_step(
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformationExtraArgs,
    loss: LossConfig | None = None,
    *,
    micro_batches: int = 1,
    mini_batches: int = 1,
    epochs: int = 1,
    shuffle: bool = True,
    seed: int = 0,
    logits_chunk_size: int = DEFAULT_CHUNK_SIZE,
    place_reference=None,
    shard_rows=None,
    noise_scale: bool = False,
    policy_change: bool = False,
):
    """The step function (not jitted: the learner adds shardings and donation).

    Args:
      graphdef: the model's graph definition.
      tx: the optimizer chain (`gac_jax.learner.make_optimizer`); it receives the extra
        args `log_importance_weights` (per-sequence log ratio of current to behaviour) and
        `sequence_mask`.
      loss: the objective (`LossConfig()`, PPO with GRPO advantages, by default).
      micro_batches: each mini-batch is split into this many chunks whose gradients are
        accumulated, each weighted by its share of the loss's normaliser, so the update
        does not depend on it. VCPO's exact gradient norms are computed one micro-batch of
        sequences at a time (`per_example_grad_sq_norms`).
      mini_batches: optimizer steps per pass over the batch (PPO's mini-batches).
      epochs: passes over the batch (PPO's epochs).
      shuffle: shuffle the rows before each pass (only matters with several mini-batches
        or epochs).
      seed: the shuffling key's seed.
      logits_chunk_size: the logits [B, T, V] are never materialised: log-probs and
        entropies are computed this many positions at a time, forward and backward
        (`gac_jax.models.chunked_logprobs`); any value gives the same result.
      place_reference: applied to the `reference` params inside the step (moves them from
        host memory to the devices when the learner offloads them); None: as given.
      shard_rows: applied to every per-row array after shuffling (the learner's sharding
        constraint, so a shuffled batch stays split over devices); None: none.
      noise_scale: log each update's gradient noise scale estimate (`noise/*`,
        `noise_scale_metrics`) from its micro-batches' and its whole gradient (needs
        micro_batches >= 2).
      policy_change: log how far the batch's updates moved the policy, on the batch's
        tokens (a forward pass after the updates, and one before them unless the objective
        takes it anyway): ``policy_change/kl``, the mean k3 estimate of
        KL(pi_before || pi_after), and ``policy_change/log_ratio_sq``, the mean of
        ``(log pi_after - log pi_before)^2 / 2``. The tokens are the behaviour policy's
        samples, so these are the change where the data lies (exact sampling estimates
        only for on-policy data).

    The step takes `reference` (the frozen reference policy's params, needed when the
    objective `needs_reference`) and `frozen` (the untrained rest of the model, merged
    with `params` and `reference`: LoRA's base). An optimizer step whose loss, gradient
    norm or update norm is not finite is skipped: params and optimizer state stay as they
    were and its metric `nonfinite_step` is 1.0 (else 0.0); its other metrics describe the
    bad batch and may be NaN.
    """
    objective = Objective(LossConfig() if loss is None else loss)
    for name, value in (
        ("micro_batches", micro_batches),
        ("mini_batches", mini_batches),
        ("epochs", epochs),
        ("logits_chunk_size", logits_chunk_size),
    ):
        _check_count(name, value)
    m, k = micro_batches, mini_batches
    updates = epochs * k
    if objective.spec.needs_reference and m * updates > 1:
        raise ValueError(
            f"policy_loss={objective.config.policy_loss!r} estimates each group's partition "
            "function from the rows it is given: use micro_batches=1, mini_batches=1, epochs=1."
        )
    if noise_scale and m < 2:
        raise ValueError(
            "noise_scale compares micro-batch gradients with the whole one: it needs "
            f"micro_batches >= 2, got {m}."
        )
    c = logits_chunk_size
    forward_fn = functools.partial(forward, graphdef, logits_chunk_size=c)
    update = make_update(graphdef, tx, objective, m, c, noise_scale)
    place_reference = place_reference or (lambda r: r)
    shard_rows = shard_rows or (lambda x: x)

    def exact_sq_norms(params, batch: TrainBatch, frozen):
        rows = batch.tokens.shape[0] // (m * k)  # One micro-batch of sequences at a time.
        return per_example_grad_sq_norms(
            graphdef, params, batch, sequences_per_chunk=rows, logits_chunk_size=c, frozen=frozen
        )

    def prepare(params, batch, reference, frozen):
        """What the batch needs before any update: (batch, per-row inputs, current logp,
        batch metrics)."""
        chunks = jax.tree.map(lambda x: split_rows(x, m * k), batch)
        current = None
        if updates > 1:
            needs_current = objective.spec.needs_proximal
        else:  # One update: whole-batch statistics over micro-batches read it.
            needs_current = m > 1 and objective.spec.batch_statistics is not None
        needs_current = needs_current or objective.needs_log_weights or policy_change
        if needs_current:
            current = whole_batch_logp(functools.partial(forward_fn, frozen=frozen), params, chunks)
        inputs, extra_metrics = {}, {}
        if objective.needs_reference:
            ref = functools.partial(forward_fn, frozen=frozen)
            inputs["reference_logp"] = whole_batch_logp(ref, place_reference(reference), chunks)
            rewards, penalty = objective.penalised_rewards(
                batch.rewards, batch.behaviour_logp, inputs["reference_logp"], batch.loss_mask
            )
            if objective.config.kl_penalty == "reward":
                extra_metrics["kl_reward_penalty"] = jnp.mean(penalty)
            batch = dataclasses.replace(batch, rewards=rewards)
        norms = functools.partial(exact_sq_norms, frozen=frozen)
        adv_n, adv_aux = _advantages(objective, params, batch, current, norms)
        inputs["advantages"] = batch.rewards if objective.spec.takes_rewards else adv_n
        if updates > 1 and objective.spec.needs_proximal:
            inputs["proximal_logp"] = current
        metrics = {
            **extra_metrics,
            **{f"advantage/{k}": v for k, v in adv_aux.items() if jnp.ndim(v) == 0},
        }
        return batch, inputs, current, adv_n, metrics

    def passes(params, opt_state, batch, inputs, learner_version, frozen):
        n = batch.tokens.shape[0]
        """`epochs` shuffled passes of `mini_batches` updates; metrics stacked [U]."""
        key = jax.random.fold_in(jax.random.key(seed), learner_version)

        def one_pass(carry, epoch):
            rows = (batch, inputs)
            if shuffle:
                order = jax.random.permutation(jax.random.fold_in(key, epoch), n)
                rows = jax.tree.map(lambda x: shard_rows(x[order]) if jnp.ndim(x) else x, rows)

            def one_update(carry, mini):
                params, opt_state = carry
                params, opt_state, metrics = update(params, opt_state, *mini, frozen)
                return (params, opt_state), metrics

            minis = jax.tree.map(lambda x: split_rows(x, k), rows)
            return jax.lax.scan(one_update, carry, minis)

        (params, opt_state), metrics = jax.lax.scan(
            one_pass, (params, opt_state), jnp.arange(epochs)
        )
        return params, opt_state, jax.tree.map(lambda x: x.reshape((updates,)), metrics)

    def step(params, opt_state, batch: TrainBatch, learner_version, reference=None, *, frozen=None):
        n = batch.tokens.shape[0]
        if n % (m * k):
            raise ValueError(
                f"mini_batches x micro_batches = {k} x {m} must divide the batch of {n}."
            )
        batch, inputs, current, adv_n, metrics = prepare(params, batch, reference, frozen)
        if updates == 1:
            params, opt_state, update_metrics = update(
                params, opt_state, batch, inputs, frozen, current
            )
        else:
            params, opt_state, update_metrics = passes(
                params, opt_state, batch, inputs, learner_version, frozen
            )
        if policy_change:
            metrics.update(_policy_change(forward_fn, params, batch, current, m * k, frozen))
        metrics = {**_batch_metrics(batch, learner_version, adv_n), **metrics, **update_metrics}
        return params, opt_state, metrics

    return step
