"""The field's naive asynchronous baselines, which GAC and VCPO are judged against: stale
rollouts trained as if the policy that sampled them were the current one, with no importance weight
(`naive_pg_loss`) or with PPO's clip against the learner's own log-probs at the start of the batch
(`ppo_recompute_loss`, verl's default; `ppo_clip_loss` clips against the behaviour policy instead).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gac_jax.objectives._common import clamped_exp, ppo_clip_flags
from gac_jax.objectives._loss_terms import _check_clip, _prepare, _trust_region_pg
from gac_jax.objectives.losses import ppo_clip_loss, reinforce_loss


def naive_pg_loss(
    logp: jax.Array,
    behaviour_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    aggregation: str = "token-mean",
) -> tuple[jax.Array, dict[str, jax.Array]]:
    r"""Stale rollouts trained as if they were on-policy: the policy gradient with no
    importance weight at all,

    .. math::

        \mathcal{L} = -\operatorname{agg}_{b,t}\; A_{bt}\, \log\pi_\theta(y_{bt}),
        \qquad \nabla\mathcal{L} = -\operatorname{agg}\; A\, \nabla\log\pi_\theta .

    What a learner computes that recomputes the "old" log-probs itself and makes one update
    a batch (verl's default, https://github.com/volcengine/verl ``ray_trainer.py``:
    ``compute_log_prob`` gives ``old_log_prob``, so the PPO ratio is 1 at the first update).
    The behaviour policy enters only the diagnostics. `reinforce_loss` with unit weights.
    """
    ones_b = jnp.ones(jnp.shape(logp)[:1], jnp.float32)
    return reinforce_loss(
        logp, behaviour_logp, advantages, mask, is_weights=ones_b, aggregation=aggregation
    )


def naive_pg_trust_region_loss(
    logp: jax.Array,
    behaviour_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    aggregation: str = "token-mean",
) -> tuple[jax.Array, dict[str, jax.Array]]:
    r"""`naive_pg_loss` inside PPO-clip's trust region: unit weights, no importance weight,
    and no gradient for a token PPO-clip (Schulman et al., arXiv 1707.06347, Eq. 7) would silence,

    .. math::

        \mathcal{L} = -\operatorname{agg}_{b,t}\; \mathbb{1}[\neg(A > 0 \wedge r >
        1+\epsilon_{high}) \wedge \neg(A < 0 \wedge r < 1-\epsilon_{low})]\, A\,
        \log\pi_\theta, \qquad r = \pi_\theta/\mu .

    The control that tells a trust region from importance weighting: the gradient is
    PPO-clip's without the factor :math:`r`, and `naive_pg_loss`'s on the kept tokens.

    Returns:
      ``(loss, aux)`` with ``clip_fraction``, ``clip_fraction_low``, ``clip_fraction_high``,
      ``weight_mean`` (the kept share), ``ratio_mean``, ``approx_kl``.
    """
    _check_clip(eps_low, eps_high)
    logp_bt, mask_bt, adv_bt, ell_bt = _prepare(logp, behaviour_logp, advantages, mask, aggregation)
    low_bt, high_bt, _ = ppo_clip_flags(
        clamped_exp(ell_bt), adv_bt, 1.0 - eps_low, 1.0 + eps_high, None
    )
    ones_bt = jnp.ones_like(logp_bt)
    return _trust_region_pg(logp_bt, mask_bt, adv_bt, ell_bt, ones_bt, low_bt, high_bt, aggregation)


def ppo_recompute_loss(
    logp: jax.Array,
    behaviour_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    proximal_logp: jax.Array,
    **clip: float | str | None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    r"""PPO-clip (Schulman et al., arXiv 1707.06347, Eq. 7) against the learner's own
    log-probs at the start of the batch (verl's "recompute" default), with no correction
    for the behaviour policy:

    .. math::

        \ell_{bt} = \max\!\big(-A u,\; -A\,\operatorname{clip}(u, 1-\epsilon_{low},
        1+\epsilon_{high})\big), \qquad u = \frac{\pi_\theta}{\pi_{\mathrm{prox}}}

    Decoupled PPO (`decoupled_ppo_loss`) is this loss times the behaviour weight
    :math:`\pi_{prox}/\pi_{behav}`.

    Args:
      proximal_logp: [B, T] the log-probs of the params before the batch's first update
        (with one update a batch, the current ones without gradient: the ratio is 1, the
        gradient `naive_pg_loss`'s).
      **clip: `ppo_clip_loss`'s clip ranges and aggregation; any other is a TypeError.

    Returns:
      ``(loss, aux)``: `ppo_clip_loss`'s diagnostics, measured against `proximal_logp`.
    """
    del behaviour_logp  # Trained as if on-policy: the behaviour policy is not consulted.
    if "is_weights" in clip:
        raise TypeError("ppo_recompute_loss takes no `is_weights`: it corrects nothing.")
    return ppo_clip_loss(logp, proximal_logp, advantages, mask, **clip)
