"""Terms shared by the policy losses: validated inputs, PPO's clipped surrogate, the
ratio diagnostics. Private to `gac_jax.objectives`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gac_jax.objectives._common import (
    broadcast_per_token,
    check_nonnegative,
    check_tokens,
    clip_fraction_stats,  # noqa: F401 - re-exported to the loss modules
    is_python_number,
    masked_log_ratio,
    masked_mean,
    ppo_clip_flags,
)

_sg = jax.lax.stop_gradient


def _prepare(logp, behaviour_logp, advantages, mask):
    """Validated f32 inputs: (logp_bt, mask_bt, adv_bt, ell_bt); adv has no gradient."""
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


def _ppo_terms(ratio_bt, adv_bt, lower, upper, dual_clip):
    r"""Per-token clipped surrogate loss and the masks of tokens each clip silences.

    loss = max(-A r, -A clip(r, lower, upper)), then for A < 0 min(loss, -A c) (dual clip).
    """
    loss1 = -adv_bt * ratio_bt
    loss2 = -adv_bt * jnp.clip(ratio_bt, lower, upper)
    loss_bt = jnp.maximum(loss1, loss2)
    if dual_clip is not None:
        loss_bt = jnp.where(adv_bt < 0, jnp.minimum(loss_bt, -adv_bt * dual_clip), loss_bt)
    return (loss_bt, *ppo_clip_flags(ratio_bt, adv_bt, lower, upper, dual_clip))


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
