"""One optimizer step of the GRPO learner: a mini-batch's gradient, accumulated exactly over
micro-batches, then the optimizer chain behind a finiteness guard.

`make_train_step` (`gac_jax.learner.step`) computes what a whole rollout batch needs once
(advantages, proximal and reference log-probs) and calls `make_update`'s function once per
optimizer step, on each mini-batch of each epoch.

Micro-batching is exact for every loss: each micro-batch's loss is weighted by its share of
the aggregation's normaliser (`objectives.aggregation_size`: tokens, sequences or rows),
statistics of the whole mini-batch (M2PO's mask, BAPO's bounds) are computed once on it and
handed to every micro-batch, and the reported diagnostics are those of the whole mini-batch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from gac_jax import objectives
from gac_jax.learner.batch import TrainBatch
from gac_jax.learner.objective import Objective
from gac_jax.learner.optimizer import injected_learning_rate
from gac_jax.models.scoring import token_logps_and_entropy
from gac_jax.numerics import computed_once, masked_mean
from gac_jax.transforms import alignment_statistics

_sg = jax.lax.stop_gradient


def forward(graphdef, params, batch: TrainBatch, logits_chunk_size: int, frozen=None):
    """Teacher-forced log-probs [N, T] and the entropy of each predicted token [N, T].

    `frozen`: the state the optimizer does not train (LoRA's base weights), merged with
    `params` into the model; None when `params` is the whole model. The logits are never
    materialised for the whole sequence: `logits_chunk_size` positions at a time, forward
    and backward (`gac_jax.models.chunked_logprobs`).
    """
    states = (params,) if frozen is None else (params, frozen)
    model = nnx.merge(graphdef, *states)
    # Positions default to `positions_from_mask`, which lets the model look its rotary
    # tables up instead of evaluating sin and cos.
    return token_logps_and_entropy(
        model, batch.tokens, batch.attention_mask, chunk_size=logits_chunk_size
    )


def split_rows(x, parts: int):
    """[N, ...] -> [parts, N / parts, ...], part j holding rows j, j + parts, ...; scalars
    are repeated.

    Strided, not contiguous: the batch is sharded over devices in contiguous blocks of
    rows, so a contiguous part would sit on one device (or a few) and GSPMD would
    replicate its computation on all of them; a strided one spreads every part over every
    device. Which rows go together does not change an exactly accumulated gradient.
    """
    if jnp.ndim(x) == 0:
        return jnp.broadcast_to(x, (parts,))
    n = x.shape[0]
    return x.reshape((n // parts, parts) + x.shape[1:]).swapaxes(0, 1)


def merge_rows(x):
    """Inverse of `split_rows`: [parts, N / parts, ...] -> [N, ...]."""
    return x.swapaxes(0, 1).reshape((-1,) + x.shape[2:])


def whole_batch_logp(forward_fn, params, chunks: TrainBatch) -> jax.Array:
    """[N, T] log-probs under `params`, one chunk of rows at a time (no gradient);
    `chunks` is a batch split by `split_rows`."""
    logp = jax.lax.map(lambda chunk: forward_fn(params, chunk)[0], chunks)
    return _sg(merge_rows(logp))


def _chain_statistics(opt_state) -> dict[str, jax.Array]:
    metrics = alignment_statistics(opt_state)  # Both cosines, GAC's regimes, its skip.
    ess_scale = optax.tree.get(opt_state, "ess_scale", None)
    if ess_scale is not None:  # Chains without ESS scaling simply lack it.
        metrics["ess_scale"] = ess_scale
    # The rate this update used, as the optimizer's state holds it (not recomputed).
    learning_rate = injected_learning_rate(opt_state)
    if learning_rate is not None:
        metrics["learning_rate"] = learning_rate
    return metrics


def select_finite_update(params, opt_state, grads, updates, new_opt_state, loss, rewards=None):
    """`(params, opt_state, metrics)`: `updates` applied and `new_opt_state` taken (from
    ``tx.update(grads, opt_state, params)``) unless the loss, gradient norm, update norm
    or a reward is non-finite (GRPO would zero that group's advantages and train on
    silently); then the old values, bit for bit (Adam moments, GAC's reference and
    counters, ESS state), so one poisoned batch costs one skipped step, not the run. A
    select, not a Python branch: the donated old values exist only here. The metrics hold
    `nonfinite_step` (1.0 if skipped), the norms and the chain's statistics of this update.
    """
    grad_norm, update_norm = optax.tree.norm(grads), optax.tree.norm(updates)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & jnp.isfinite(update_norm)
    if rewards is not None:
        finite &= jnp.all(jnp.isfinite(rewards))
    finite = computed_once(finite)  # Read by every leaf's select.
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


def noise_scale_metrics(small_sq, small_size, big_sq, big_size) -> dict[str, jax.Array]:
    r"""McCandlish et al.'s two-batch-size estimate of the gradient noise scale
    (arXiv 1812.06162, App. A.1) from the squared norms of mean gradients over batches of
    two sizes:

    .. math::

        |G|^2 \approx \frac{B_{big}|G_{big}|^2 - B_{small}|G_{small}|^2}{B_{big} - B_{small}},
        \qquad
        \operatorname{tr}\Sigma \approx \frac{|G_{small}|^2 - |G_{big}|^2}
                                            {1/B_{small} - 1/B_{big}},
        \qquad
        B_{simple} = \operatorname{tr}\Sigma / |G|^2

    Each estimate is unbiased but noisy from one step; average `noise/grad_sq` and
    `noise/trace` over steps before taking their ratio, as the paper does. Sizes are in the
    loss normaliser's unit (tokens for token-mean, sequences for sequence means).
    """
    span = big_size - small_size
    grad_sq = (big_size * big_sq - small_size * small_sq) / jnp.where(span > 0, span, 1.0)
    inverse_span = 1.0 / jnp.maximum(small_size, 1e-12) - 1.0 / jnp.maximum(big_size, 1e-12)
    trace = (small_sq - big_sq) / jnp.where(inverse_span > 0, inverse_span, 1.0)
    return {
        "noise/grad_sq": grad_sq,
        "noise/trace": trace,
        "noise/b_simple": trace / jnp.where(grad_sq != 0, grad_sq, 1.0),
        "noise/batch_size": big_size,
    }


def make_update(
    graphdef,
    tx,
    objective: Objective,
    micro_batches: int,
    logits_chunk_size: int,
    noise_scale: bool = False,
):
    """``update(params, opt_state, rows, inputs, frozen, current_logp) -> (params, opt_state,
    metrics)``: one optimizer step on the mini-batch `rows`.

    `inputs` holds per-row arrays: ``advantages`` [N] (raw rewards for a loss that takes
    them) and, when the objective reads them, ``proximal_logp`` and ``reference_logp``
    [N, T]. `current_logp`: the rows' log-probs under `params`, when the caller has them
    (saves a forward pass for whole-batch statistics), else None. With `noise_scale`
    (micro_batches >= 2), the metrics also hold `noise_scale_metrics` of the micro-batches'
    and the mini-batch's mean gradients.
    """
    m = micro_batches
    forward_fn = functools.partial(forward, graphdef, logits_chunk_size=logits_chunk_size)

    def rows_loss(rows: TrainBatch, logp, entropy, inputs, statistics):
        """The objective of `rows` whose log-probs and entropies are given."""
        extra = {k: v for k, v in inputs.items() if k != "advantages"}
        return objective.loss(
            logp,
            rows.behaviour_logp,
            inputs["advantages"],
            rows.loss_mask,
            statistics,
            group_ids=rows.group_ids,
            entropy=entropy,
            **extra,
        )

    def chunk_loss(params, chunk: TrainBatch, inputs, statistics, frozen):
        logp, entropy = forward_fn(params, chunk, frozen=frozen)
        loss, _, size = rows_loss(chunk, logp, entropy, inputs, statistics)
        # With several micro-batches each loss is weighted by its normaliser's size; the
        # sum is divided by the total size once all are seen.
        scaled = loss * _sg(size) if m > 1 else loss
        return scaled, (size, _sg(logp), _sg(entropy))

    grad_fn = jax.value_and_grad(chunk_loss, has_aux=True)

    def accumulated_grads(params, chunks, chunk_inputs, stat_chunks, frozen):
        def accumulate(grads, xs):
            chunk, inputs, stats = xs
            (scaled, aux), g = grad_fn(params, chunk, inputs, stats, frozen)
            g_sq = optax.tree.norm(g, squared=True) if noise_scale else jnp.zeros(())
            return jax.tree.map(jnp.add, grads, g), (scaled, *aux, g_sq)

        zeros = jax.tree.map(jnp.zeros_like, params)
        grads, (scaled, sizes, logps, entropies, g_sqs) = jax.lax.scan(
            accumulate, zeros, (chunks, chunk_inputs, stat_chunks)
        )
        total = jnp.sum(scaled)
        if m > 1:
            norm = jnp.sum(sizes)
            inverse = jnp.where(norm > 0, 1.0 / jnp.where(norm > 0, norm, 1.0), 0.0)
            grads = jax.tree.map(lambda g: (g * inverse).astype(g.dtype), grads)
            total = total * inverse
        return grads, total, merge_rows(logps), merge_rows(entropies), (g_sqs, sizes)

    def update(params, opt_state, rows: TrainBatch, inputs, frozen=None, current_logp=None):
        chunks = jax.tree.map(lambda x: split_rows(x, m), rows)
        statistics = None
        if m > 1:
            if current_logp is None and objective.spec.batch_statistics is not None:
                current_logp = whole_batch_logp(
                    functools.partial(forward_fn, frozen=frozen), params, chunks
                )
            statistics = objective.batch_statistics(
                current_logp, rows.behaviour_logp, inputs["advantages"], rows.loss_mask
            )
        stat_chunks = jax.tree.map(lambda x: split_rows(x, m), statistics)  # None stays None.
        chunk_inputs = jax.tree.map(lambda x: split_rows(x, m), inputs)
        grads, total, logp, entropy, (g_sqs, sizes) = accumulated_grads(
            params, chunks, chunk_inputs, stat_chunks, frozen
        )
        # Diagnostics of the whole mini-batch, from the log-probs the update saw.
        _, aux, _ = rows_loss(rows, logp, entropy, inputs, statistics)
        log_w = objectives.sequence_log_ratio(logp, rows.behaviour_logp, rows.loss_mask)
        mask = jnp.any(rows.loss_mask, axis=1)
        updates, new_opt_state = tx.update(
            grads, opt_state, params, log_importance_weights=log_w, sequence_mask=mask
        )
        params, opt_state, update_metrics = select_finite_update(
            params, opt_state, grads, updates, new_opt_state, total, rows.rewards
        )
        metrics = {
            "loss": total,
            **{f"loss/{k}": v for k, v in aux.items()},
            "loss/entropy": masked_mean(entropy, rows.loss_mask),
            **objectives.off_policy_diagnostics(logp, rows.behaviour_logp, rows.loss_mask),
            **update_metrics,
        }
        if noise_scale:  # Micro-batch j's mean gradient is its scaled gradient / its size.
            sizes = sizes.astype(jnp.float32)
            small_sq = jnp.mean(g_sqs / jnp.maximum(sizes, 1e-12) ** 2)
            big_sq = jnp.square(update_metrics["grad_norm"])  # The mini-batch's mean gradient.
            metrics.update(noise_scale_metrics(small_sq, jnp.mean(sizes), big_sq, jnp.sum(sizes)))
        return params, opt_state, metrics

    return update
