"""Trajectory balance (VarGrad form), the objective of TBA (arXiv 2503.18929)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gac_jax.objectives._common import (
    as_float,
    check_positive,
    check_tokens,
    masked_log_ratio,
    masked_mean,
    sequence_valid,
)
from gac_jax.objectives._groups import dense_group_ids, group_sum
from gac_jax.objectives._loss_terms import _sg


def trajectory_balance_loss(
    logp: jax.Array,
    behaviour_logp: jax.Array,
    rewards: jax.Array,
    mask: jax.Array,
    *,
    reference_logp: jax.Array,
    group_ids: jax.Array,
    beta: float = 0.012,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    r"""Trajectory balance in its VarGrad form, as used by TBA (Bartoldson et al.,
    "Trajectory Balance with Asynchrony", arXiv 2503.18929, Eq. 3; official code
    bbartoldson/TBA ``tba_trainer_gsm8k.py``).

    .. math::

        d_i = \log\pi_\theta(y_i|x) - \log\pi_{\mathrm{ref}}(y_i|x) - R_i/\beta,
        \qquad
        \log\hat Z(x) = -\operatorname{sg}\Big[\frac{1}{K}\sum_{j \in g(x)} d_j\Big]

        \mathcal{L} = \frac{1}{B}\sum_i \big(\log\hat Z(x_i) + d_i\big)^2

    The batch-estimated partition function makes the loss the within-group variance of
    :math:`d` (VarGrad, Richter et al., 2020). It needs no importance ratio, which is what
    makes it usable on arbitrarily stale samples: ``behaviour_logp`` only validates shapes.
    :math:`\beta > 0` is the KL coefficient; the default 0.012 is the official GSM8K config's
    starting value (annealed there to 0.004). Sequences without valid tokens are left out.

    Args:
      rewards: [B] raw rewards :math:`R_i`, in the advantages position of the common
        signature (`gac_jax.objectives.losses`).
      reference_logp: [B, T] reference-policy log-probabilities.
      group_ids: [B] integers, sequences of the same prompt share one.

    Returns:
      ``(loss, aux)`` with ``log_z_mean`` (mean :math:`\log\hat Z` over valid sequences)
      and ``residual_rms`` (the loss's square root).
    """
    check_positive("beta", beta)
    logp_bt, _, mask_bt = check_tokens(logp, behaviour_logp, mask)
    _, ref_bt, _ = check_tokens(logp, reference_logp, mask_bt)
    rewards_b = _sg(as_float(rewards))
    if rewards_b.shape != (mask_bt.shape[0],):
        raise ValueError(f"`rewards` has shape {rewards_b.shape}, expected {(mask_bt.shape[0],)}.")
    segments_b = dense_group_ids(group_ids)
    if segments_b.shape != rewards_b.shape:
        raise ValueError(f"`group_ids` has shape {segments_b.shape}, expected {rewards_b.shape}.")
    valid_b = sequence_valid(mask_bt)
    d_b = jnp.sum(masked_log_ratio(logp_bt, ref_bt, mask_bt), axis=-1) - rewards_b / beta
    d_valid_b = jnp.where(valid_b, d_b, 0.0)
    count_b = group_sum(valid_b.astype(jnp.float32), segments_b)
    log_z_b = -_sg(group_sum(d_valid_b, segments_b) / jnp.maximum(count_b, 1.0))
    residual_b = jnp.where(valid_b, log_z_b + d_valid_b, 0.0)
    num_valid = jnp.sum(valid_b, dtype=jnp.float32)
    loss = jnp.sum(residual_b * residual_b) / jnp.maximum(num_valid, 1.0)
    aux = {
        "log_z_mean": _sg(masked_mean(log_z_b, valid_b)),
        "residual_rms": _sg(jnp.sqrt(jnp.maximum(loss, 0.0))),
    }
    return loss, aux
