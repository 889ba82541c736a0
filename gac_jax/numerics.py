"""Small numerical helpers shared by `gac_jax.transforms`, `gac_jax.objectives` and the
learner; only JAX is imported, so both packages can depend on it and not on each other.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp


def safe_divide(numerator: jax.Array, denominator: jax.Array, fallback=0.0) -> jax.Array:
    """`numerator / denominator`, or `fallback` where the denominator is zero, with a finite
    gradient (both branches of the `where` are finite: the double-`where` trick)."""
    is_zero = denominator == 0
    safe_denominator = jnp.where(is_zero, jnp.ones_like(denominator), denominator)
    return jnp.where(is_zero, fallback, numerator / safe_denominator)


def masked_mean(values, mask, fallback=0.0) -> jax.Array:
    """Mean of `values` over `mask`, `fallback` when nothing is valid (the one masked mean
    of the package: objectives, the learner's metrics and the supervised loss use it)."""
    total = jnp.sum(jnp.where(mask, values, 0.0))
    return safe_divide(total, jnp.sum(mask, dtype=jnp.float32), fallback)


class EffectiveSampleSize(NamedTuple):
    """Kish's effective sample size of a set of importance weights."""

    ess: jax.Array  # f32 []: (sum w)^2 / sum w^2, in [1, n] when n >= 1, 0 when n = 0.
    ess_ratio: jax.Array  # f32 []: ess / n, in [1/n, 1]; 1 when n = 0 (nothing to judge).
    num_valid: jax.Array  # f32 []: n, the number of weights that entered.


def effective_sample_size(
    log_weights: jax.Array, where: jax.Array | None = None
) -> EffectiveSampleSize:
    r"""Kish's effective sample size, computed stably from log importance weights.

    .. math::

        \mathrm{ESS} = \frac{(\sum_i w_i)^2}{\sum_i w_i^2}, \qquad
        \rho = \mathrm{ESS} / n, \qquad w_i = \exp(\ell_i)

    Shifting every log weight by their maximum leaves ESS unchanged and keeps every
    exponent <= 0, so log weights of any magnitude give a finite answer. Infinite log
    weights are taken at their limit: the `k` entries at `+inf` dominate (ESS = k), `-inf`
    entries are zero weights; a NaN entry gives a NaN ESS. VCPO
    (arXiv 2602.17616) uses the ratio `rho` of the sequence-level weights
    `ell_i = sum_t (logp_theta - logp_behaviour)` as its stability signal.

    Args:
      log_weights: log importance weights, any shape (all entries are one sample set).
      where: optional boolean mask of the same shape; False entries are excluded.
    """
    log_weights = jnp.asarray(log_weights, jnp.float32)
    if where is None:
        where = jnp.ones(log_weights.shape, bool)
    else:
        where = jnp.asarray(where, bool)
        if where.shape != log_weights.shape:
            raise ValueError(
                f"`where` has shape {where.shape}, expected the shape of the log weights "
                f"{log_weights.shape}."
            )
    dominant = where & (log_weights == jnp.inf)
    limit = jnp.where(dominant, 0.0, jnp.where(jnp.isnan(log_weights), jnp.nan, -jnp.inf))
    log_weights = jnp.where(jnp.any(dominant), limit, log_weights)
    masked = jnp.where(where, log_weights, -jnp.inf)
    shift = jnp.max(masked, initial=-jnp.inf)
    shift = jnp.where(jnp.isfinite(shift), shift, 0.0)
    scaled = jnp.where(where, jnp.exp(jnp.where(where, log_weights, shift) - shift), 0.0)
    total = jnp.sum(scaled)
    total_sq = jnp.sum(scaled * scaled)
    ess = safe_divide(total * total, total_sq)
    num_valid = jnp.sum(where, dtype=jnp.float32)
    ess_ratio = safe_divide(ess, num_valid, fallback=1.0)
    return EffectiveSampleSize(ess=ess, ess_ratio=ess_ratio, num_valid=num_valid)


def computed_once(scalars):
    """`scalars` (small arrays) unchanged, computed once. XLA:CPU copies cheap scalar
    arithmetic, such as a sum over a parameter tree's leaves, into every fusion that reads
    it: each leaf's update, a program quadratic in the leaves (`optimizer_compile.py`). A
    conditional stops it (an `optimization_barrier` is removed first): on CPU the values
    pass through a `lax.cond` whose branches return them as they are (one times 1, so XLA
    cannot merge them), bit for bit."""
    if not jax.tree.leaves(scalars):
        return scalars
    times_one = functools.partial(jax.tree.map, lambda x: x * jnp.ones((), x.dtype))

    def on_cpu(tree):  # Either branch would do: the predicate only has to be opaque.
        return jax.lax.cond(jnp.any(jax.tree.leaves(tree)[0] != 0), lambda t: t, times_one, tree)

    return jax.lax.platform_dependent(scalars, cpu=on_cpu, default=lambda t: t)
