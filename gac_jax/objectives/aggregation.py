"""Reduction of a per-token loss [B, T] to the scalar that is differentiated.

The four modes are the ones verl's `agg_loss` offers and the RL literature compares
(DAPO, arXiv 2503.14476, argues for token-mean; Dr. GRPO, arXiv 2503.20783, for a
constant normaliser). `AGGREGATIONS` is the only list of valid names.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gac_jax.numerics import safe_divide
from gac_jax.objectives._common import (
    as_float,
    as_mask,
    check_choice,
    check_positive,
    sequence_valid,
)

AGGREGATIONS = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)


def check_aggregation(aggregation: str) -> None:
    """Raises ValueError listing the valid modes if `aggregation` is not one of them."""
    check_choice("aggregation", aggregation, AGGREGATIONS)


def aggregate(
    loss_bt: jax.Array,
    mask_bt: jax.Array,
    aggregation: str = "token-mean",
    *,
    max_tokens: int | None = None,
) -> jax.Array:
    r"""Reduces a per-token loss to a scalar, counting only valid tokens.

    With :math:`m_{bt}` the mask, :math:`L_b = \sum_t m_{bt} \ell_{bt}`,
    :math:`n_b = \sum_t m_{bt}` and :math:`\mathcal{V} = \{b : n_b > 0\}`:

    - ``token-mean``: :math:`\sum_b L_b / \sum_b n_b` (every valid token weighs the same;
      DAPO, arXiv 2503.14476, Eq. 8).
    - ``seq-mean-token-mean``: :math:`\frac{1}{|\mathcal{V}|}\sum_{b\in\mathcal{V}} L_b / n_b`
      (the original GRPO normalisation, arXiv 2402.03300, Eq. 3).
    - ``seq-mean-token-sum``: :math:`\frac{1}{|\mathcal{V}|}\sum_{b\in\mathcal{V}} L_b`.
    - ``seq-mean-token-sum-norm``: :math:`\frac{1}{B\,T_{\max}}\sum_b L_b`, a constant
      normaliser independent of lengths and of how many tokens are valid (Dr. GRPO,
      arXiv 2503.20783, Sec. 3.1). verl divides by :math:`T` only; the extra :math:`1/B`
      here makes the mode a mean over sequences, as its name says.

    Sequences without a valid token are left out of the sequence means, so padding rows do
    not dilute the loss. When nothing is valid every mode returns 0 (a float32 scalar).

    Args:
      mask_bt: [B, T] bool (or float: nonzero is valid).
      max_tokens: the constant :math:`T_{\max}` of ``seq-mean-token-sum-norm``; defaults
        to T. Keep it fixed across steps (e.g. the generation budget) to replicate Dr. GRPO.
    """
    check_aggregation(aggregation)
    loss_bt = as_float(loss_bt)
    if loss_bt.ndim != 2:
        raise ValueError(f"`loss_bt` must be [B, T], got shape {loss_bt.shape}.")
    mask_bt = as_mask(mask_bt, loss_bt.shape)
    if max_tokens is not None:
        check_positive("max_tokens", max_tokens)
    # `where`, not multiplication: an inf or NaN loss on a padded token stays out.
    masked_bt = jnp.where(mask_bt, loss_bt, 0.0)
    if aggregation == "token-mean":
        return safe_divide(jnp.sum(masked_bt), jnp.sum(mask_bt, dtype=jnp.float32))
    sum_b = jnp.sum(masked_bt, axis=-1)
    if aggregation == "seq-mean-token-sum-norm":
        batch, length = loss_bt.shape
        norm = batch * (length if max_tokens is None else max_tokens)
        return jnp.sum(sum_b) / max(norm, 1)
    valid_b = sequence_valid(mask_bt)
    if aggregation == "seq-mean-token-mean":
        per_seq_b = safe_divide(sum_b, jnp.sum(mask_bt, axis=-1, dtype=jnp.float32))
    else:  # seq-mean-token-sum
        per_seq_b = sum_b
    return safe_divide(
        jnp.sum(jnp.where(valid_b, per_seq_b, 0.0)), jnp.sum(valid_b, dtype=jnp.float32)
    )


def aggregation_size(mask_bt: jax.Array, aggregation: str = "token-mean") -> jax.Array:
    r"""The share a part of a batch carries in `aggregate`'s result, unnormalised.

    For rows split into parts :math:`P_k`, ``aggregate(batch) = sum_k aggregate(P_k) * size(P_k) /
    size(batch)`` exactly, with ``size`` the valid tokens for ``token-mean``, the sequences with a
    valid token for ``seq-mean-token-mean`` and ``seq-mean-token-sum``, and the rows for
    ``seq-mean-token-sum-norm`` (its normaliser counts every row; modes of DAPO, arXiv 2503.14476).
    A learner weighs its micro-batches' losses and gradients by it.
    """
    check_aggregation(aggregation)
    mask_bt = jnp.asarray(mask_bt) != 0
    if aggregation == "token-mean":
        return jnp.sum(mask_bt, dtype=jnp.float32)
    if aggregation == "seq-mean-token-sum-norm":
        return jnp.asarray(mask_bt.shape[0], jnp.float32)
    return jnp.sum(sequence_valid(mask_bt), dtype=jnp.float32)
