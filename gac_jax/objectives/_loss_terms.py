"""Terms shared by the policy losses: validated inputs, PPO's clipped surrogate, the
ratio diagnostics. Private to `gac_jax.objectives`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gac_jax.objectives._common import (
    broadcast_per_token,
    check_nonnegative,
    check_tokens,
    clamped_exp,
    clip_fraction_stats,
    is_python_number,
    masked_log_ratio,
    masked_mean,
    ppo_clip_flags,
)
from gac_jax.objectives.aggregation import aggregate, check_aggregation

_sg = jax.lax.stop_gradient


def _prepare(logp, behaviour_logp, advantages, mask, aggregation=None):
    """Validated f32 inputs: (logp_bt, mask_bt, adv_bt, ell_bt); adv has no gradient. Checks
    `aggregation` too, unless None."""
    if aggregation is not None:
        check_aggregation(aggregation)
    logp_bt, behaviour_bt, mask_bt = check_tokens(logp, behaviour_logp, mask)
    adv_bt = _sg(broadcast_per_token(advantages, mask_bt.shape, "advantages"))
    adv_bt = jnp.where(mask_bt, adv_bt, 0.0)
    ell_bt = masked_log_ratio(logp_bt, behaviour_bt, mask_bt)
    return logp_bt, mask_bt, adv_bt, ell_bt


def _check_clip(eps_low, eps_high, dual_clip=None) -> None:
    check_nonnegative("eps_low", eps_low)
    check_nonnegative("eps_high", eps_high)
    if dual_clip is not None and is_python_number(dual_clip) and not dual_clip > 1.0:
        raise ValueError(f"`dual_clip` must be > 1 (or None), got {dual_clip!r}.")


def _ppo_terms(ratio_bt, adv_bt, mask_bt, lower, upper, dual_clip):
    r"""Per-token clipped surrogate loss, and the shares of tokens each clip silences.

    loss = max(-A r, -A clip(r, lower, upper)), then for A < 0 min(loss, -A c) (dual clip).
    """
    loss1 = -adv_bt * ratio_bt
    loss2 = -adv_bt * jnp.clip(ratio_bt, lower, upper)
    loss_bt = jnp.maximum(loss1, loss2)
    if dual_clip is not None:
        loss_bt = jnp.where(adv_bt < 0, jnp.minimum(loss_bt, -adv_bt * dual_clip), loss_bt)
    flags = ppo_clip_flags(ratio_bt, adv_bt, lower, upper, dual_clip)
    return loss_bt, clip_fraction_stats(*flags, mask_bt)


def _ratio_aux(ratio_bt, ell_bt, mask_bt) -> dict[str, jax.Array]:
    return {
        "ratio_mean": _sg(masked_mean(ratio_bt, mask_bt, fallback=1.0)),
        # k1 estimate of KL(behaviour || current) from behaviour samples (verl's ppo_kl).
        "approx_kl": _sg(masked_mean(-ell_bt, mask_bt)),
    }


def _weights_bt(is_weights, mask_bt):
    return jnp.where(
        mask_bt, _sg(broadcast_per_token(is_weights, mask_bt.shape, "is_weights")), 0.0
    )


def _weighted_pg(logp_bt, mask_bt, adv_bt, ell_bt, weight_bt, aggregation):
    """``-agg(sg[w] A log pi)`` over the valid tokens, with ``weight_mean``, ``ratio_mean``
    and ``approx_kl``."""
    w_bt = jnp.where(mask_bt, _sg(weight_bt), 0.0)
    loss_bt = -w_bt * adv_bt * jnp.where(mask_bt, logp_bt, 0.0)
    aux = {"weight_mean": _sg(masked_mean(w_bt, mask_bt, fallback=1.0))}
    aux.update(_ratio_aux(_sg(clamped_exp(ell_bt)), ell_bt, mask_bt))
    return aggregate(loss_bt, mask_bt, aggregation), aux


def _trust_region_pg(logp_bt, mask_bt, adv_bt, ell_bt, weight_bt, low_bt, high_bt, aggregation):
    """`_weighted_pg` less the tokens a trust region drops: ``low_bt`` (A < 0, pushed below
    it) and ``high_bt`` (A > 0, pushed above it) get no gradient; ``clip_fraction*`` are
    their shares of the valid tokens."""
    low_bt, high_bt = low_bt & mask_bt, high_bt & mask_bt
    weight_bt = jnp.where(low_bt | high_bt, 0.0, weight_bt)
    loss, aux = _weighted_pg(logp_bt, mask_bt, adv_bt, ell_bt, weight_bt, aggregation)
    aux.update(clip_fraction_stats(low_bt, high_bt, None, mask_bt))
    return loss, aux
