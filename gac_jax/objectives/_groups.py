"""Group-wise reductions over per-sequence arrays with arbitrary integer group ids."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def dense_group_ids(group_ids: jax.Array) -> jax.Array:
    """Maps arbitrary integer ids (any values, any order) to dense ids in [0, B).

    `jnp.unique` with a static `size` keeps this jit-compatible: B groups at most, so
    every segment op below runs with `num_segments=B`, a shape known at trace time.
    """
    group_ids = jnp.asarray(group_ids)
    if group_ids.ndim != 1:
        raise ValueError(f"`group_ids` must be [B], got shape {group_ids.shape}.")
    if not jnp.issubdtype(group_ids.dtype, jnp.integer):
        raise ValueError(f"`group_ids` must be integers, got dtype {group_ids.dtype}.")
    _, inverse = jnp.unique(group_ids, size=group_ids.shape[0], return_inverse=True)
    return inverse.reshape(-1).astype(jnp.int32)


def group_sum(values_b: jax.Array, segments_b: jax.Array) -> jax.Array:
    """Per-sequence sum of `values_b` over the sequence's group, [B]."""
    totals_g = jax.ops.segment_sum(values_b, segments_b, num_segments=values_b.shape[0])
    return totals_g[segments_b]


def group_max(values_b: jax.Array, segments_b: jax.Array) -> jax.Array:
    """Per-sequence max of `values_b` over the sequence's group, [B] (-inf if all -inf)."""
    max_g = jax.ops.segment_max(values_b, segments_b, num_segments=values_b.shape[0])
    return max_g[segments_b]


def group_moments(
    values_b: jax.Array, segments_b: jax.Array, where_b: jax.Array, ddof: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-sequence (count, mean, std) of `values_b` over the valid members of its group.

    Two passes (mean, then squared deviations) keep the variance accurate. The std uses
    `count - ddof` as divisor and is 0 when that is not positive (a single member).
    """
    weights_b = where_b.astype(jnp.float32)
    count_b = group_sum(weights_b, segments_b)
    safe_count_b = jnp.maximum(count_b, 1.0)
    mean_b = group_sum(jnp.where(where_b, values_b, 0.0), segments_b) / safe_count_b
    centred_b = jnp.where(where_b, values_b - mean_b, 0.0)
    sq_b = group_sum(centred_b * centred_b, segments_b)
    dof_b = count_b - ddof
    var_b = jnp.where(dof_b > 0, sq_b / jnp.maximum(dof_b, 1.0), 0.0)
    # Double `where`: sqrt's gradient at 0 is infinite.
    std_b = jnp.where(var_b > 0, jnp.sqrt(jnp.where(var_b > 0, var_b, 1.0)), 0.0)
    return count_b, mean_b, std_b
