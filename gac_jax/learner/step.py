"""The GRPO train step on one rollout batch: what the batch needs once, then one or more
optimizer steps (`gac_jax.learner.update`).

`make_train_step` returns a pure function `(params, opt_state, batch, learner_version,
reference=None, *, frozen=None, micro_batches) -> (params, opt_state, metrics)` over
`nnx.State` params, set by a `LearnerConfig` (which holds the rules on splitting a batch,
checked once, in its `validate`); the learner jits it with shardings and donation, a
program per micro-batch count (`gac_jax.learner.token_budget.MicroBatching`). Everything
method-specific comes from the `Objective` of a `LossConfig`, which reads the registry
entries of `gac_jax.objectives`.

Design of the PPO-style updates (verl's ``ppo_epochs`` and mini-batches, AReaL's decoupled
PPO): before the first update, under the batch's starting params, the step computes the
log-probs of every row (the proximal policy of decoupled PPO, and the current policy of
VCPO's weights), the reference policy's log-probs (a KL penalty, `tb`), the rewards less an
in-reward KL penalty, and the advantages. Then, for each of `epochs` passes, the rows are
shuffled (a key folded from `shuffle_seed`, the learner version and the epoch), split into
`mini_batches` strided mini-batches, and each mini-batch is one optimizer step, its
gradient accumulated over `micro_batches`. Per-update metrics come back stacked [U] (U =
epochs x mini_batches); with U = 1 every metric is a scalar, as before.

The path of one batch, six calls from the run to the optimizer: `Run.step` ->
`GRPOLearner.step` (token budget, placement) -> `ShardedLearner.run_step` (the jitted
`split_step`: donation) -> `_train_step` (this module: the batch's log-probs, advantages,
epochs and mini-batches) -> `update` (`make_update`: one optimizer step's gradient) ->
``tx.update``, its result kept or dropped by `select_finite_update`. Metrics: an optimizer step's
in `update` (and the guard's norms and chain statistics in `select_finite_update`), the batch's
in `_batch_metrics` and `_prepare`, the host's timings and queues in `Run.step`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding

from gac_jax import objectives
from gac_jax._validation import check_bool, check_int
from gac_jax.learner.batch import TrainBatch
from gac_jax.learner.objective import LossConfig, Objective
from gac_jax.learner.token_budget import MicroBatching
from gac_jax.learner.update import forward, make_update, split_rows, whole_batch_logp
from gac_jax.models.scoring import DEFAULT_CHUNK_SIZE
from gac_jax.numerics import masked_mean


@dataclasses.dataclass(frozen=True)
class LearnerConfig:
    """How the learner runs the step (the objective itself is a `LossConfig`).

    Attributes:
      micro_batches: gradient accumulation: each mini-batch is split into this many chunks,
        whose gradients are summed exactly, each weighted by its share of the loss's
        normaliser; it must divide the batch. VCPO's exact gradient norms are computed one
        micro-batch of sequences at a time (`per_example_grad_sq_norms`). None (default):
        1 on accelerators; on XLA:CPU, which faults a step's temporaries in on every call,
        the fewest of at least 512 tokens whose temporaries fit 64 MiB (`token_budget`; 1
        where a split costs a pass: batch statistics, a group-wise partition function).
      max_consecutive_nonfinite: a step with a non-finite loss, gradient or update is
        skipped (`make_train_step`); this many skipped in a row raise `NonFiniteStepError`.
      logits_chunk_size: the step never materialises the logits [B, T, V]: log-probs and
        entropies are computed this many positions at a time, in the forward and the
        backward pass (`gac_jax.models.chunked_logprobs`), so the logits take
        B x logits_chunk_size x V float32s at a time. Any value gives the same result;
        smaller saves memory, larger means fewer, bigger matmuls.
      max_tokens_per_micro_batch: None, or a token budget per device: each batch is first
        trimmed to the columns its rows use (rounded up to a multiple of 64), then split
        into the fewest micro-batches (at least `micro_batches`) whose rows on one device
        hold at most this many padded tokens (`gac_jax.learner.token_budget`). A batch of
        short completions then runs in few micro-batches and one long completion does not
        set the memory of every batch; the step compiles once per width and count met.
      mini_batches: optimizer steps per pass over a rollout batch (PPO's mini-batches,
        verl's ``ppo_mini_batch_size`` as a count); each is split into `micro_batches`.
      epochs: passes over each rollout batch (PPO's ``ppo_epochs``). With
        ``mini_batches x epochs`` > 1, decoupled PPO's proximal policy is the params before
        the batch's first update, and the metrics hold one record per optimizer step.
      shuffle: shuffle the rows before each pass (a key from `shuffle_seed`, the learner
        version and the epoch), as verl and AReaL do; False keeps the batch's order.
      shuffle_seed: the shuffling key's seed.
      reference_offload: keep the frozen reference policy (a KL penalty, `tb`) in host
        memory between uses; the step copies it to the devices for the batch's one
        reference pass. Saves a params-sized buffer per device, costs one transfer a batch.
      noise_scale: log each update's gradient noise scale estimate (`noise/grad_sq`,
        `noise/trace`, `noise/b_simple`, `noise/batch_size`: McCandlish et al.'s two
        batch sizes, from the micro-batches and the whole mini-batch); needs
        micro_batches >= 2.
      policy_change: log how far each batch's updates moved the policy on its tokens (a
        forward pass after the updates, and one before them unless the objective takes it
        anyway): ``policy_change/kl``, the mean k3 estimate of KL(pi_before || pi_after),
        and ``policy_change/log_ratio_sq``, the mean of ``(log pi_after - log
        pi_before)^2 / 2``. The tokens are the behaviour policy's samples, so these are the
        change where the data lies (exact sampling estimates only for on-policy data).
    """

    micro_batches: int | None = None
    max_consecutive_nonfinite: int = 3
    logits_chunk_size: int = 512
    max_tokens_per_micro_batch: int | None = None
    mini_batches: int = 1
    epochs: int = 1
    shuffle: bool = True
    shuffle_seed: int = 0
    reference_offload: bool = False
    noise_scale: bool = False
    policy_change: bool = False

    @property
    def updates_per_batch(self) -> int:
        """Optimizer steps per rollout batch."""
        return self.mini_batches * self.epochs

    def validate(self, loss: LossConfig | None = None, rows: int | None = None) -> None:
        """Raises ValueError naming a bad field; with `loss` (validated), also a loss that
        cannot be split; with `rows`, a batch of that many sequences that cannot."""
        for name in ("mini_batches", "epochs", "max_consecutive_nonfinite"):
            check_int(name, getattr(self, name), 1)
        check_int("micro_batches", self.micro_batches, 1, allow_none=True)
        check_int("logits_chunk_size", self.logits_chunk_size, 1)
        check_int("max_tokens_per_micro_batch", self.max_tokens_per_micro_batch, 1, allow_none=True)
        check_int("shuffle_seed", self.shuffle_seed, 0)
        for name in ("shuffle", "reference_offload", "noise_scale", "policy_change"):
            check_bool(name, getattr(self, name))
        m, k, e = MicroBatching.of(self).least, self.mini_batches, self.epochs
        if self.noise_scale and m < 2:
            raise ValueError(
                "noise_scale=true compares micro-batch gradients with the whole one: it needs "
                f"micro_batches >= 2, got {self.micro_batches}."
            )
        _check_split(loss, m, k, e, rows)


def _check_split(loss: LossConfig | None, m: int, k: int, e: int, rows: int | None) -> None:
    """The rules of `m` micro-batches x `k` mini-batches x `e` epochs (configured, or a step's)."""
    spec = None if loss is None else objectives.get_policy_loss_spec(loss.policy_loss)
    if spec is not None and spec.needs_reference and m * k * e > 1:
        raise ValueError(
            f"micro_batches={m}, mini_batches={k}, epochs={e}: policy_loss="
            f"{loss.policy_loss!r} estimates each group's partition function from the "
            "rows it is given; set all three to 1."
        )
    if rows is not None and rows % (m * k):
        raise ValueError(
            f"micro_batches={m} x mini_batches={k} must divide the batch of {rows} sequences."
        )


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
    check_int("sequences_per_chunk", k, 1)

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


def _batch_logp(graphdef, config: LearnerConfig, micro_batches, params, batch, frozen):
    """[N, T] log-probs of the batch under `params`, a micro-batch of rows at a time."""
    parts = micro_batches * config.mini_batches
    forward_fn = functools.partial(
        forward, graphdef, logits_chunk_size=config.logits_chunk_size, frozen=frozen
    )
    return whole_batch_logp(forward_fn, params, jax.tree.map(lambda x: split_rows(x, parts), batch))


def _policy_change(after, batch: TrainBatch, before):
    """How far the updates moved the policy on the batch's tokens (`make_train_step`)."""
    delta = jnp.where(batch.loss_mask, after - before, 0.0)
    return {
        "policy_change/kl": masked_mean(
            objectives.kl_estimate(jnp.zeros_like(delta), delta, estimator="k3"),
            batch.loss_mask,
        ),
        "policy_change/log_ratio_sq": masked_mean(0.5 * delta * delta, batch.loss_mask),
    }


def _needs_current(objective: Objective, config: LearnerConfig, micro_batches: int) -> bool:
    """Whether the step computes the batch's log-probs under its starting params."""
    if config.updates_per_batch > 1:
        needed = objective.spec.needs_proximal
    else:  # One update: whole-batch statistics over micro-batches read it.
        needed = micro_batches > 1 and objective.spec.batch_statistics is not None
    return needed or objective.needs_log_weights or config.policy_change


def _prepare(settings: _StepSettings, micro_batches: int, params, batch, reference, frozen):
    """What the batch needs before any update: (batch, per-row inputs, current logp or None,
    advantages [N], batch metrics)."""
    graphdef, objective, config = settings.graphdef, settings.objective, settings.config
    logp = functools.partial(
        _batch_logp, graphdef, config, micro_batches, batch=batch, frozen=frozen
    )
    current = logp(params) if _needs_current(objective, config, micro_batches) else None
    inputs, metrics = {}, {}
    if objective.needs_reference:
        if config.reference_offload:  # From host memory, for this one pass.
            reference = jax.device_put(reference, jax.memory.Space.Device)
        inputs["reference_logp"] = logp(reference)
        rewards, penalty = objective.penalised_rewards(
            batch.rewards, batch.behaviour_logp, inputs["reference_logp"], batch.loss_mask
        )
        if objective.config.kl_penalty == "reward":
            metrics["kl_reward_penalty"] = jnp.mean(penalty)
        batch = dataclasses.replace(batch, rewards=rewards)
    norms = functools.partial(  # One micro-batch of sequences at a time.
        per_example_grad_sq_norms,
        graphdef,
        sequences_per_chunk=batch.tokens.shape[0] // (micro_batches * config.mini_batches),
        logits_chunk_size=config.logits_chunk_size,
        frozen=frozen,
    )
    adv_n, adv_aux = _advantages(objective, params, batch, current, norms)
    inputs["advantages"] = batch.rewards if objective.spec.takes_rewards else adv_n
    if config.updates_per_batch > 1 and objective.spec.needs_proximal:
        inputs["proximal_logp"] = current
    metrics.update({f"advantage/{k}": v for k, v in adv_aux.items() if jnp.ndim(v) == 0})
    return batch, inputs, current, adv_n, metrics


def _passes(update, settings: _StepSettings, state, batch, inputs, version, frozen):
    """`epochs` shuffled passes of `mini_batches` updates from `state` (params, optimizer
    state); returns the new state and the metrics stacked [U]."""
    config, row_sharding, n = settings.config, settings.row_sharding, batch.tokens.shape[0]
    key = jax.random.fold_in(jax.random.key(config.shuffle_seed), version)

    def shuffled(x, order):
        if not jnp.ndim(x):
            return x
        x = x[order]  # Kept split over the batch's devices.
        return x if row_sharding is None else jax.lax.with_sharding_constraint(x, row_sharding)

    def one_update(state, mini):
        params, opt_state, metrics = update(*state, *mini, frozen)
        return (params, opt_state), metrics

    def one_pass(state, epoch):
        rows = (batch, inputs)
        if config.shuffle:
            order = jax.random.permutation(jax.random.fold_in(key, epoch), n)
            rows = jax.tree.map(lambda x: shuffled(x, order), rows)
        minis = jax.tree.map(lambda x: split_rows(x, config.mini_batches), rows)
        return jax.lax.scan(one_update, state, minis)

    state, metrics = jax.lax.scan(one_pass, state, jnp.arange(config.epochs))
    return *state, jax.tree.map(lambda x: x.reshape((config.updates_per_batch,)), metrics)


@dataclasses.dataclass(frozen=True, eq=False)
class _StepSettings:
    """What `make_train_step` binds into its step: the same for every batch."""

    graphdef: nnx.GraphDef
    tx: optax.GradientTransformationExtraArgs
    objective: Objective
    config: LearnerConfig
    row_sharding: NamedSharding | None


def _train_step(
    settings: _StepSettings,
    params,
    opt_state,
    batch: TrainBatch,
    learner_version,
    reference=None,
    *,
    frozen=None,
    micro_batches: int,
):
    """`make_train_step`'s step, its settings bound first."""
    graphdef, objective, config = settings.graphdef, settings.objective, settings.config
    m, c = micro_batches, config.logits_chunk_size
    _check_split(objective.config, m, config.mini_batches, config.epochs, batch.tokens.shape[0])
    update = make_update(graphdef, settings.tx, objective, m, c, config.noise_scale)
    batch, inputs, current, adv_n, metrics = _prepare(settings, m, params, batch, reference, frozen)
    if config.updates_per_batch == 1:
        params, opt_state, update_metrics = update(
            params, opt_state, batch, inputs, frozen, current
        )
    else:
        params, opt_state, update_metrics = _passes(
            update, settings, (params, opt_state), batch, inputs, learner_version, frozen
        )
    if config.policy_change:
        after = _batch_logp(graphdef, config, m, params, batch, frozen)
        metrics.update(_policy_change(after, batch, current))
    metrics = {**_batch_metrics(batch, learner_version, adv_n), **metrics, **update_metrics}
    return params, opt_state, metrics


def make_train_step(
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformationExtraArgs,
    loss: LossConfig | None = None,
    config: LearnerConfig | None = None,
    *,
    row_sharding: NamedSharding | None = None,
    **settings,
):
    """The step function (not jitted: the learner adds shardings and donation):
    ``step(params, opt_state, batch, learner_version, reference=None, *, frozen=None,
    micro_batches=...) -> (params, opt_state, metrics)``; `micro_batches`, the count this
    step splits a batch into, is bound to the config's least (`MicroBatching`), and a
    learner binds the count it chooses for each batch.

    Args:
      graphdef: the model's graph definition.
      tx: the optimizer chain (`gac_jax.learner.make_optimizer`); it receives the extra
        args `log_importance_weights` (per-sequence log ratio of current to behaviour) and
        `sequence_mask`.
      loss: the objective (`LossConfig()`, PPO with GRPO advantages, by default).
      config: the step's settings (`LearnerConfig()` by default), validated with `loss`.
      row_sharding: None, or the batch's sharding: per-row arrays keep it after a shuffle.
      **settings: `LearnerConfig` fields replacing those of `config`.

    The step takes `reference` (the frozen reference policy's params, needed when the
    objective `needs_reference`) and `frozen` (the untrained rest of the model, merged
    with `params` and `reference`: LoRA's base). An optimizer step whose loss, gradient
    norm or update norm is not finite is skipped: params and optimizer state stay as they
    were and its metric `nonfinite_step` is 1.0 (else 0.0); its other metrics describe the
    bad batch and may be NaN.
    """
    objective = Objective(LossConfig() if loss is None else loss)
    config = dataclasses.replace(LearnerConfig() if config is None else config, **settings)
    config.validate(objective.config)
    settings = _StepSettings(graphdef, tx, objective, config, row_sharding)
    return functools.partial(_train_step, settings, micro_batches=MicroBatching.of(config).least)
