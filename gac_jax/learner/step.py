"""The GRPO train step: teacher-forced log-probs, advantages, policy loss, optimizer chain.

`make_train_step` returns a pure function `(params, opt_state, batch, learner_version) ->
(params, opt_state, metrics)` over `nnx.State` params; the learner jits it with shardings
and donation. Everything method-specific comes from the registries of
`gac_jax.objectives` by name.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from gac_jax import objectives
from gac_jax.learner.batch import TrainBatch
from gac_jax.models import token_logps_from_logits

# Losses whose extra inputs the learner cannot supply yet.
UNSUPPORTED_LOSSES = {"tb": "trajectory balance needs a reference model's log-probs"}


def _forward(graphdef, params, batch: TrainBatch):
    """Teacher-forced log-probs [N, T] and the entropy of each predicted token [N, T]."""
    model = nnx.merge(graphdef, params)
    # Positions default to `positions_from_mask`, which lets the model look its rotary
    # tables up instead of evaluating sin and cos.
    logits_btv, _ = model(batch.tokens, None, batch.attention_mask)
    logp_bt = token_logps_from_logits(logits_btv, batch.tokens, batch.attention_mask)
    log_probs = jax.nn.log_softmax(logits_btv[:, :-1].astype(jnp.float32), axis=-1)
    entropy = -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)
    entropy_bt = jnp.concatenate([jnp.zeros_like(entropy[:, :1]), entropy], axis=1)
    return logp_bt, entropy_bt


def _masked_mean(x, mask):
    mask = mask.astype(jnp.float32)
    return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def per_example_grad_sq_norms(graphdef, params, batch: TrainBatch) -> jax.Array:
    """Exact `|grad_theta sum_t log pi(y_it)|^2` for every sequence i, [N] (vmapped grads).

    Costs one backward pass per sequence and N gradient-sized buffers: for small models.
    """

    def sequence_logp(p, tokens, attention, loss_mask):
        one = TrainBatch(tokens[None], attention[None], loss_mask[None], *([None] * 4))
        logp, _ = _forward(graphdef, p, one)
        return jnp.sum(jnp.where(loss_mask[None], logp, 0.0))

    grads = jax.vmap(jax.grad(sequence_logp), in_axes=(None, 0, 0, 0))(
        params, batch.tokens, batch.attention_mask, batch.loss_mask
    )
    return sum(
        jnp.sum(jnp.square(g.astype(jnp.float32)), axis=tuple(range(1, g.ndim)))
        for g in jax.tree.leaves(grads)
    )


def make_train_step(
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformationExtraArgs,
    *,
    policy_loss: str = "ppo",
    loss_kwargs: Mapping[str, Any] | None = None,
    advantage: str = "grpo",
    grad_norm: str = "exact",
    micro_batches: int = 1,
    correction: str | None = None,
    correction_kwargs: Mapping[str, Any] | None = None,
):
    """The step function (not jitted: the learner adds shardings and donation).

    Args:
      graphdef: the model's graph definition.
      tx: the optimizer chain (`gac_jax.learner.make_optimizer`); it receives the extra
        arg `log_importance_weights` (per-sequence log ratio of current to behaviour).
      policy_loss: a name of `objectives.POLICY_LOSSES`.
      loss_kwargs: its keyword arguments.
      advantage: a name of `objectives.ADVANTAGE_ESTIMATORS`.
      grad_norm: for the "vcpo" estimator: "exact" per-example gradient norms, or a proxy
        of `objectives.GRAD_NORM_PROXIES`.
      micro_batches: the batch is split into this many chunks whose gradients are
        accumulated (weighted by their share of tokens for "token-mean" aggregation, of
        sequences otherwise), so the global batch does not depend on memory. Advantages
        are computed on the whole batch first, so groups are never split.
      correction: None, or a name of `objectives.IMPORTANCE_CORRECTIONS` ("tis", "mis",
        "icepop"): its weights of the current policy against the behaviour policy (no
        gradient) go to the loss as `is_weights` and its mask replaces the loss mask. The
        loss must take `is_weights` ("reinforce" or "ppo"); sequence-level TIS is
        ``correction="tis", correction_kwargs={"level": "sequence"}`` with "reinforce".
      correction_kwargs: the correction's keyword arguments (cap, level, ...).
    """
    if policy_loss in UNSUPPORTED_LOSSES:
        raise ValueError(
            f"policy_loss={policy_loss!r} is not supported by the learner yet: "
            f"{UNSUPPORTED_LOSSES[policy_loss]}."
        )
    loss_impl = objectives.get_policy_loss(policy_loss)
    estimator = objectives.get_advantage_estimator(advantage)
    loss_kwargs = dict(loss_kwargs or {})
    per_token = loss_kwargs.get("aggregation", "token-mean") == "token-mean"
    if grad_norm != "exact" and grad_norm not in objectives.GRAD_NORM_PROXIES:
        raise ValueError(
            f"grad_norm={grad_norm!r} is unknown; expected 'exact' or one of "
            f"{sorted(objectives.GRAD_NORM_PROXIES)}."
        )
    if micro_batches < 1:
        raise ValueError(f"micro_batches={micro_batches} must be >= 1.")
    correct = None
    if correction is not None:
        correct = functools.partial(
            objectives.get_importance_correction(correction), **(correction_kwargs or {})
        )
        if "is_weights" not in inspect.signature(loss_impl).parameters:
            raise ValueError(
                f"correction={correction!r} needs a policy loss that takes is_weights; "
                f"policy_loss={policy_loss!r} does not (use 'reinforce' or 'ppo')."
            )

    def advantages_of(params, batch: TrainBatch):
        if advantage != "vcpo":
            return estimator(batch.rewards, batch.group_ids)
        logp, _ = _forward(graphdef, params, batch)
        log_w = objectives.sequence_log_ratio(
            jax.lax.stop_gradient(logp), batch.behaviour_logp, batch.loss_mask
        )
        if grad_norm == "exact":
            sq_norms = per_example_grad_sq_norms(graphdef, params, batch)
        else:
            sq_norms = objectives.grad_sq_norm_proxy(batch.loss_mask, proxy=grad_norm)
        return estimator(
            batch.rewards,
            batch.group_ids,
            log_weights=log_w,
            grad_sq_norms=jax.lax.stop_gradient(sq_norms),
        )

    def chunk_loss(params, chunk: TrainBatch, adv_n, weight):
        logp, entropy = _forward(graphdef, params, chunk)
        extra, mask, correction_aux = {}, chunk.loss_mask, {}
        if policy_loss == "decoupled_ppo":
            # One update per batch: the proximal policy is the current one, held fixed.
            extra["proximal_logp"] = jax.lax.stop_gradient(logp)
        if correct is not None:
            weights = correct(jax.lax.stop_gradient(logp), chunk.behaviour_logp, mask)
            extra["is_weights"], mask = weights.weights, weights.mask
            correction_aux["correction_fraction"] = weights.fraction
        loss, aux = loss_impl(logp, chunk.behaviour_logp, adv_n, mask, **loss_kwargs, **extra)
        aux = dict(aux, **correction_aux, entropy=_masked_mean(entropy, chunk.loss_mask))
        return weight * loss, (aux, jax.lax.stop_gradient(logp))

    grad_fn = jax.value_and_grad(chunk_loss, has_aux=True)

    def step(params, opt_state, batch: TrainBatch, learner_version):
        adv_n, adv_aux = advantages_of(params, batch)
        adv_n = jax.lax.stop_gradient(adv_n)
        n = batch.tokens.shape[0]
        if n % micro_batches:
            raise ValueError(f"micro_batches={micro_batches} must divide the batch of {n}.")

        def split(x):
            return x.reshape((micro_batches, n // micro_batches) + x.shape[1:])

        chunks = jax.tree.map(split, batch)
        adv_chunks = split(adv_n)
        if per_token:
            sizes = jnp.sum(chunks.loss_mask, axis=(1, 2), dtype=jnp.float32)
        else:
            sizes = jnp.sum(jnp.any(chunks.loss_mask, axis=2), axis=1, dtype=jnp.float32)
        weights = sizes / jnp.maximum(jnp.sum(sizes), 1.0)
        if micro_batches == 1:
            weights = jnp.ones_like(weights)

        def accumulate(grads, xs):
            chunk, adv, weight = xs
            (loss, (aux, logp)), g = grad_fn(params, chunk, adv, weight)
            return jax.tree.map(jnp.add, grads, g), (loss, aux, logp)

        zeros = jax.tree.map(jnp.zeros_like, params)
        grads, (losses, auxes, logps) = jax.lax.scan(
            accumulate, zeros, (chunks, adv_chunks, weights)
        )
        logp = logps.reshape(batch.tokens.shape)
        aux = jax.tree.map(lambda a: jnp.sum(a * weights), auxes)

        log_w = objectives.sequence_log_ratio(logp, batch.behaviour_logp, batch.loss_mask)
        has_tokens = jnp.any(batch.loss_mask, axis=1)
        updates, opt_state = tx.update(
            grads, opt_state, params, log_importance_weights=log_w, sequence_mask=has_tokens
        )
        params = optax.apply_updates(params, updates)

        gap = (learner_version - batch.versions).astype(jnp.float32)
        lengths = jnp.sum(batch.loss_mask, axis=1, dtype=jnp.float32)
        metrics = {
            "loss": jnp.sum(losses),
            "reward": jnp.mean(batch.rewards),
            "accuracy": jnp.mean((batch.rewards >= 1.0).astype(jnp.float32)),
            "response_length": jnp.mean(lengths),
            "version_gap_min": jnp.min(gap),
            "version_gap_mean": jnp.mean(gap),
            "version_gap_max": jnp.max(gap),
            "grad_norm": optax.tree.norm(grads),
            "update_norm": optax.tree.norm(updates),
            "advantage_abs_mean": jnp.mean(jnp.abs(adv_n)),
            **{f"loss/{k}": v for k, v in aux.items()},
            **{f"advantage/{k}": v for k, v in adv_aux.items() if jnp.ndim(v) == 0},
            **objectives.off_policy_diagnostics(logp, batch.behaviour_logp, batch.loss_mask),
        }
        for name in ("gac_cosine", "gac_cosine_after", "gac_regime", "gac_tau_low", "ess_scale"):
            value = optax.tree.get(opt_state, name, None)
            if value is not None:  # Chains without GAC or ESS simply lack these.
                metrics[name] = value
        return params, opt_state, metrics

    return step
