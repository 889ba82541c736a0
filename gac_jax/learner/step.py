"""The GRPO train step: teacher-forced log-probs, advantages, policy loss, optimizer chain.

`make_train_step` returns a pure function `(params, opt_state, batch, learner_version) ->
(params, opt_state, metrics)` over `nnx.State` params; the learner jits it with shardings
and donation. Everything method-specific comes from the `Objective` of a `LossConfig`,
which reads the registry entries of `gac_jax.objectives`.

Micro-batching is exact for every loss: each micro-batch's loss is weighted by its share of
the aggregation's normaliser (`objectives.aggregation_size`: tokens, sequences or rows),
statistics of the whole batch (M2PO's mask, BAPO's bounds) are computed once on the whole
batch and handed to every micro-batch, and the reported diagnostics are computed on the
whole batch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from gac_jax import objectives
from gac_jax.learner.batch import TrainBatch
from gac_jax.learner.objective import LossConfig, Objective
from gac_jax.learner.optimizer import injected_learning_rate
from gac_jax.models.scoring import DEFAULT_CHUNK_SIZE, token_logps_and_entropy
from gac_jax.numerics import masked_mean

_sg = jax.lax.stop_gradient


def _forward(graphdef, params, batch: TrainBatch, logits_chunk_size: int):
    """Teacher-forced log-probs [N, T] and the entropy of each predicted token [N, T].

    The logits are never materialised for the whole sequence: `logits_chunk_size`
    positions at a time, forward and backward (`gac_jax.models.chunked_logprobs`).
    """
    model = nnx.merge(graphdef, params)
    # Positions default to `positions_from_mask`, which lets the model look its rotary
    # tables up instead of evaluating sin and cos.
    return token_logps_and_entropy(
        model, batch.tokens, batch.attention_mask, chunk_size=logits_chunk_size
    )


def per_example_grad_sq_norms(
    graphdef,
    params,
    batch: TrainBatch,
    *,
    sequences_per_chunk: int | None = None,
    logits_chunk_size: int = DEFAULT_CHUNK_SIZE,
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
      logits_chunk_size: positions whose logits exist at once (`_forward`).
    """
    n = batch.tokens.shape[0]
    k = n if sequences_per_chunk is None else sequences_per_chunk
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"sequences_per_chunk={k!r} must be an int >= 1.")

    def sequence_logp(p, tokens, attention, loss_mask):
        one = TrainBatch(tokens[None], attention[None], loss_mask[None], *([None] * 4))
        logp, _ = _forward(graphdef, p, one, logits_chunk_size)
        return jnp.sum(jnp.where(loss_mask[None], logp, 0.0))

    def sq_norm(row):
        grads = jax.grad(sequence_logp)(params, *row)
        return sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(grads))

    rows = (batch.tokens, batch.attention_mask, batch.loss_mask)
    return jax.lax.map(sq_norm, rows, batch_size=min(k, n))


def _split(x, micro_batches: int):
    """[N, ...] -> [micro_batches, N / micro_batches, ...], micro-batch j holding rows j,
    j + micro_batches, ...; per-batch scalars are repeated.

    Strided, not contiguous: the batch is sharded over devices in contiguous blocks of
    rows, so a contiguous micro-batch would sit on one device (or a few) and GSPMD would
    replicate its computation on all of them; a strided one spreads every micro-batch over
    every device. Which rows go together does not change the update (exact micro-batching).
    """
    if jnp.ndim(x) == 0:
        return jnp.broadcast_to(x, (micro_batches,))
    n = x.shape[0]
    return x.reshape((n // micro_batches, micro_batches) + x.shape[1:]).swapaxes(0, 1)


def _merge(x):
    """Inverse of `_split`: [micro_batches, N / micro_batches, ...] -> [N, ...]."""
    return x.swapaxes(0, 1).reshape((-1,) + x.shape[2:])


def _whole_batch_logp(forward, params, chunks: TrainBatch) -> jax.Array:
    """[N, T] log-probs under `params`, one micro-batch at a time (no gradient)."""
    logp = jax.lax.map(lambda chunk: forward(params, chunk)[0], chunks)
    return jax.lax.stop_gradient(_merge(logp))


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


def _chain_statistics(opt_state) -> dict[str, jax.Array]:
    metrics = {}
    for name in ("gac_cosine", "gac_cosine_after", "gac_regime", "gac_tau_low", "ess_scale"):
        value = optax.tree.get(opt_state, name, None)
        if value is not None:  # Chains without GAC or ESS simply lack these.
            metrics[name] = value
    # The rate this update used, as the optimizer's state holds it (not recomputed).
    learning_rate = injected_learning_rate(opt_state)
    if learning_rate is not None:
        metrics["learning_rate"] = learning_rate
    return metrics


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


def guarded_update(tx, grads, opt_state, params, loss, rewards=None, **extra_args):
    """Applies `tx`'s update unless the loss, gradient norm or update norm is non-finite,
    or a reward is (GRPO would zero that group's advantages and train on silently).

    Returns `(params, opt_state, metrics)`; the metrics hold `nonfinite_step` (1.0 if the
    step was skipped), the norms and the chain's statistics of this update. A select inside
    the step, not a Python branch: params and optimizer state are donated, so the old values
    exist only here. It returns the new values bit for bit when the step is finite, and the
    old ones bit for bit (Adam moments, GAC's reference and counters, ESS state) when it is
    not, so one poisoned batch costs one skipped step, not the run.
    """
    updates, new_opt_state = tx.update(grads, opt_state, params, **extra_args)
    grad_norm, update_norm = optax.tree.norm(grads), optax.tree.norm(updates)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & jnp.isfinite(update_norm)
    if rewards is not None:
        finite &= jnp.all(jnp.isfinite(rewards))
    new = (optax.apply_updates(params, updates), new_opt_state)
    params, opt_state = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, (params, opt_state))
    metrics = {
        "nonfinite_step": jnp.where(finite, 0.0, 1.0).astype(jnp.float32),
        "grad_norm": grad_norm,
        "update_norm": update_norm,
        # The statistics of this step's update, even when it was skipped (they say why).
        **_chain_statistics(new_opt_state),
    }
    return params, opt_state, metrics


def make_train_step(
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformationExtraArgs,
    loss: LossConfig | None = None,
    *,
    micro_batches: int = 1,
    logits_chunk_size: int = DEFAULT_CHUNK_SIZE,
):
    """The step function (not jitted: the learner adds shardings and donation).

    Args:
      graphdef: the model's graph definition.
      tx: the optimizer chain (`gac_jax.learner.make_optimizer`); it receives the extra
        arg `log_importance_weights` (per-sequence log ratio of current to behaviour).
      loss: the objective (`LossConfig()`, PPO with GRPO advantages, by default).
      micro_batches: the batch is split into this many chunks whose gradients are
        accumulated, each weighted by its share of the loss's normaliser, so the update
        does not depend on it. Advantages and whole-batch statistics are computed on the
        whole batch first, so groups are never split. VCPO's exact gradient norms are
        computed one micro-batch of sequences at a time (`per_example_grad_sq_norms`).
      logits_chunk_size: the logits [B, T, V] are never materialised: log-probs and
        entropies are computed this many positions at a time, forward and backward
        (`gac_jax.models.chunked_logprobs`); any value gives the same result.

    A step whose loss, gradient norm or update norm is not finite is skipped: it returns
    params and optimizer state unchanged and the metric `nonfinite_step` is 1.0 (else 0.0);
    the other metrics describe the bad batch and may be NaN.
    """
    objective = Objective(LossConfig() if loss is None else loss)
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches={micro_batches!r} must be an int >= 1.")
    c = logits_chunk_size
    if isinstance(c, bool) or not isinstance(c, int) or c < 1:
        raise ValueError(f"logits_chunk_size={c!r} must be an int >= 1.")
    m = micro_batches
    forward = functools.partial(_forward, graphdef, logits_chunk_size=c)

    def chunk_loss(params, chunk: TrainBatch, adv_n, statistics):
        logp, entropy = forward(params, chunk)
        loss, _, size = objective.loss(
            logp, chunk.behaviour_logp, adv_n, chunk.loss_mask, statistics
        )
        # With several micro-batches each loss is weighted by its normaliser's size; the
        # sum is divided by the total size once all are seen.
        scaled = loss * jax.lax.stop_gradient(size) if m > 1 else loss
        return scaled, (size, _sg(logp), _sg(entropy))

    grad_fn = jax.value_and_grad(chunk_loss, has_aux=True)

    def exact_sq_norms(params, batch: TrainBatch):
        # One micro-batch of sequences' gradients at a time, as the update's.
        rows = batch.tokens.shape[0] // m
        return per_example_grad_sq_norms(
            graphdef, params, batch, sequences_per_chunk=rows, logits_chunk_size=c
        )

    def step(params, opt_state, batch: TrainBatch, learner_version):
        n = batch.tokens.shape[0]
        if n % m:
            raise ValueError(f"micro_batches={m} must divide the batch of {n}.")
        chunks = jax.tree.map(lambda x: _split(x, m), batch)
        whole_logp = None
        if objective.needs_log_weights or (m > 1 and objective.spec.batch_statistics):
            whole_logp = _whole_batch_logp(forward, params, chunks)
        adv_n, adv_aux = _advantages(objective, params, batch, whole_logp, exact_sq_norms)
        statistics = None
        if m > 1:
            statistics = objective.batch_statistics(
                whole_logp, batch.behaviour_logp, adv_n, batch.loss_mask
            )

        def accumulate(grads, xs):
            chunk, adv, stats = xs
            (scaled, (size, logp, entropy)), g = grad_fn(params, chunk, adv, stats)
            return jax.tree.map(jnp.add, grads, g), (scaled, size, logp, entropy)

        zeros = jax.tree.map(jnp.zeros_like, params)
        stat_chunks = (
            None if statistics is None else jax.tree.map(lambda x: _split(x, m), statistics)
        )
        grads, (scaled, sizes, logps, entropies) = jax.lax.scan(
            accumulate, zeros, (chunks, _split(adv_n, m), stat_chunks)
        )
        total = jnp.sum(scaled)
        if m > 1:
            norm = jnp.sum(sizes)
            inverse = jnp.where(norm > 0, 1.0 / jnp.where(norm > 0, norm, 1.0), 0.0)
            grads = jax.tree.map(lambda g: (g * inverse).astype(g.dtype), grads)
            total = total * inverse
        logp, entropy = _merge(logps), _merge(entropies)
        # Diagnostics of the whole batch, from the log-probs the update saw.
        _, aux, _ = objective.loss(logp, batch.behaviour_logp, adv_n, batch.loss_mask, statistics)

        log_w = objectives.sequence_log_ratio(logp, batch.behaviour_logp, batch.loss_mask)
        has_tokens = jnp.any(batch.loss_mask, axis=1)
        params, opt_state, update_metrics = guarded_update(
            tx,
            grads,
            opt_state,
            params,
            total,
            batch.rewards,
            log_importance_weights=log_w,
            sequence_mask=has_tokens,
        )
        metrics = {
            "loss": total,
            **_batch_metrics(batch, learner_version, adv_n),
            **{f"loss/{k}": v for k, v in aux.items()},
            "loss/entropy": masked_mean(entropy, batch.loss_mask),
            **{f"advantage/{k}": v for k, v in adv_aux.items() if jnp.ndim(v) == 0},
            **objectives.off_policy_diagnostics(logp, batch.behaviour_logp, batch.loss_mask),
            **update_metrics,
        }
        return params, opt_state, metrics

    return step
