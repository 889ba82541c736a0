"""Policy losses for (off-policy) RL of language models, as pure array functions.

Every loss has the signature ``loss_fn(logp, behaviour_logp, advantages, mask, *, ...)``
and returns ``(loss, aux)``:

- ``logp``: [B, T] log-probabilities of the sampled tokens under the policy being trained
  (the only input a gradient flows into);
- ``behaviour_logp``: [B, T] log-probabilities under the policy that sampled them;
- ``advantages``: [B] (one per sequence, broadcast to its tokens) or [B, T]; the
  trajectory-balance loss takes raw rewards [B] in this position;
- ``mask``: [B, T] valid tokens (bool, or float with nonzero = valid). Padded tokens
  contribute exactly zero to the loss and to its gradient, whatever values they hold;
- ``aux``: a dict of float32 scalar diagnostics, without gradient.

The loss is minimised (it is the negative of the paper's objective). Where a ratio value
is needed the log-ratio is clamped to +-20 first (see `MAX_LOG_RATIO`), so log-probs of any
magnitude give finite values and gradients; beyond the clamp the ratio is held constant.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from gac_jax.objectives._common import (
    as_float,
    broadcast_per_token,
    check_choice,
    check_nonnegative,
    check_positive,
    check_tokens,
    clamped_exp,
    clip_fraction_stats,
    is_python_number,
    masked_log_ratio,
    masked_mean,
    ppo_clip_flags,
    sequence_valid,
)
from gac_jax.objectives._groups import dense_group_ids, group_sum
from gac_jax.objectives.aggregation import aggregate, check_aggregation
from gac_jax.objectives.importance import m2po_harmful_clip, m2po_mask

BAPO_CONTRIBUTIONS = ("unclipped", "clamped")
M2PO_VARIANTS = ("mask", "harmful_budget")

_sg = jax.lax.stop_gradient


# --------------------------------------------------------------------------- helpers


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


def _fraction(flags_bt, mask_bt):
    return _sg(masked_mean(flags_bt.astype(jnp.float32), mask_bt))


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


# --------------------------------------------------------------------------- losses


def reinforce_loss(
    logp: jax.Array,
    behaviour_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    is_weights: jax.Array | None = None,
    aggregation: str = "token-mean",
) -> tuple[jax.Array, dict[str, jax.Array]]:
    r"""Importance-weighted REINFORCE (Williams, 1992; off-policy form as in Degris et al.,
    arXiv 1205.4839):

    .. math::

        \mathcal{L} = -\operatorname{agg}_{b,t}\; \operatorname{sg}[w_{bt}]\, A_{bt}\,
                      \log\pi_\theta(y_{bt}),
        \qquad \nabla\mathcal{L} = -\operatorname{agg}\; w A\, \nabla\log\pi_\theta

    With the default :math:`w_{bt} = \pi_\theta(y_{bt})/\mu(y_{bt})` (token ratio) the
    gradient is the per-token importance-sampled policy gradient. Pass `is_weights` to
    use a corrected weight instead (`truncated_importance_weights`,
    `masked_importance_weights`, `icepop_weights`, or ones for plain REINFORCE); the
    weight never carries gradient.

    Args:
      logp, behaviour_logp, advantages, mask: see the module docstring.
      is_weights: optional [B] or [B, T] weights.
      aggregation: see `aggregate`.

    Returns:
      ``(loss, aux)`` with ``weight_mean``, ``ratio_mean``, ``approx_kl``.
    """
    check_aggregation(aggregation)
    logp_bt, mask_bt, adv_bt, ell_bt = _prepare(logp, behaviour_logp, advantages, mask)
    ratio_bt = _sg(clamped_exp(ell_bt))
    w_bt = (
        jnp.where(mask_bt, ratio_bt, 0.0)
        if is_weights is None
        else _weights_bt(is_weights, mask_bt)
    )
    logp_m = jnp.where(mask_bt, logp_bt, 0.0)
    loss_bt = -w_bt * adv_bt * logp_m
    aux = {"weight_mean": _sg(masked_mean(w_bt, mask_bt, fallback=1.0))}
    aux.update(_ratio_aux(ratio_bt, ell_bt, mask_bt))
    return aggregate(loss_bt, mask_bt, aggregation), aux


def ppo_clip_loss(
    logp: jax.Array,
    behaviour_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
    is_weights: jax.Array | None = None,
    aggregation: str = "token-mean",
) -> tuple[jax.Array, dict[str, jax.Array]]:
    r"""PPO's clipped surrogate (Schulman et al., arXiv 1707.06347, Eq. 7) with decoupled
    bounds (clip-higher, DAPO, arXiv 2503.14476, Eq. 10) and optional dual clip (Ye et
    al., arXiv 1912.09729, Eq. 5):

    .. math::

        \ell_{bt} = \max\!\big(-A r,\; -A\,\operatorname{clip}(r, 1-\epsilon_{\mathrm{low}},
                    1+\epsilon_{\mathrm{high}})\big),
        \qquad \ell_{bt} \leftarrow \min(\ell_{bt}, -A c) \text{ if } A < 0

    with :math:`r = \pi_\theta/\mu`. Tokens with :math:`A > 0, r > 1+\epsilon_{high}`, with
    :math:`A < 0, r < 1-\epsilon_{low}`, or (dual clip) with :math:`A < 0, r > c` get zero
    gradient. An optional extra weight (e.g. a TIS correction between the proximal and the
    inference policy) multiplies each token's loss without gradient.

    Args:
      logp, behaviour_logp, advantages, mask: see the module docstring.
      eps_low, eps_high: clip ranges, :math:`\ge 0`.
      dual_clip: :math:`c > 1`, or None for no dual clip (verl uses 3).
      is_weights: optional [B] or [B, T] extra weights.
      aggregation: see `aggregate`.

    Returns:
      ``(loss, aux)`` with ``clip_fraction`` (= low + high), ``clip_fraction_low``,
      ``clip_fraction_high``, ``dual_clip_fraction``, ``ratio_mean``, ``approx_kl``.
    """
    _check_clip(eps_low, eps_high, dual_clip)
    check_aggregation(aggregation)
    _, mask_bt, adv_bt, ell_bt = _prepare(logp, behaviour_logp, advantages, mask)
    ratio_bt = clamped_exp(ell_bt)
    loss_bt, low_bt, high_bt, dual_bt = _ppo_terms(
        ratio_bt, adv_bt, 1.0 - eps_low, 1.0 + eps_high, dual_clip
    )
    if is_weights is not None:
        loss_bt = loss_bt * _weights_bt(is_weights, mask_bt)
    aux = clip_fraction_stats(low_bt, high_bt, dual_bt, mask_bt)
    aux.update(_ratio_aux(_sg(ratio_bt), ell_bt, mask_bt))
    return aggregate(loss_bt, mask_bt, aggregation), aux


def decoupled_ppo_loss(
    logp: jax.Array,
    behaviour_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    proximal_logp: jax.Array,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
    behaviour_weight_cap: float | None = None,
    aggregation: str = "token-mean",
) -> tuple[jax.Array, dict[str, jax.Array]]:
    r"""AReaL's decoupled PPO objective (Fu et al., arXiv 2505.24298, Eq. 5): clip against
    a proximal policy, correct for the behaviour policy with a separate weight.

    .. math::

        \ell_{bt} = \operatorname{sg}\!\left[\frac{\pi_{\mathrm{prox}}}{\pi_{\mathrm{behav}}}
        \right] \max\!\big(-A u,\; -A\,\operatorname{clip}(u, 1-\epsilon_{\mathrm{low}},
        1+\epsilon_{\mathrm{high}})\big), \qquad u = \frac{\pi_\theta}{\pi_{\mathrm{prox}}}

    The proximal policy is a recent snapshot (in AReaL, the parameters before this update),
    so the trust region is measured from it, however stale the behaviour policy is. With
    `behaviour_weight_cap` set, tokens whose weight
    :math:`\pi_{\mathrm{prox}}/\pi_{\mathrm{behav}}` exceeds it are dropped (AReaL's
    ``behav_imp_weight_cap``); the loss keeps the normaliser of the original mask, as AReaL
    does.

    Args:
      logp: [B, T] current-policy log-probabilities.
      behaviour_logp: [B, T] behaviour (inference) policy log-probabilities.
      advantages, mask: see the module docstring.
      proximal_logp: [B, T] proximal-policy log-probabilities.
      eps_low, eps_high, dual_clip: as `ppo_clip_loss`.
      behaviour_weight_cap: optional cap > 0 on the behaviour weight.
      aggregation: see `aggregate`.

    Returns:
      ``(loss, aux)``: the clip diagnostics of `ppo_clip_loss` (against the proximal
      policy), ``behaviour_weight_mean`` and ``behaviour_mask_fraction``.
    """
    _check_clip(eps_low, eps_high, dual_clip)
    if behaviour_weight_cap is not None:
        check_positive("behaviour_weight_cap", behaviour_weight_cap)
    check_aggregation(aggregation)
    _, mask_bt, adv_bt, _ = _prepare(logp, behaviour_logp, advantages, mask)
    logp_bt, prox_bt, _ = check_tokens(logp, proximal_logp, mask_bt)
    behaviour_bt = as_float(behaviour_logp)
    ell_prox_bt = masked_log_ratio(logp_bt, prox_bt, mask_bt)
    ratio_bt = clamped_exp(ell_prox_bt)
    weight_bt = _sg(
        jnp.where(mask_bt, clamped_exp(masked_log_ratio(prox_bt, behaviour_bt, mask_bt)), 0.0)
    )
    keep_bt = mask_bt
    if behaviour_weight_cap is not None:
        keep_bt = mask_bt & (weight_bt <= behaviour_weight_cap)
    loss_bt, low_bt, high_bt, dual_bt = _ppo_terms(
        ratio_bt, adv_bt, 1.0 - eps_low, 1.0 + eps_high, dual_clip
    )
    loss_bt = jnp.where(keep_bt, weight_bt * loss_bt, 0.0)
    aux = clip_fraction_stats(low_bt, high_bt, dual_bt, mask_bt)
    aux.update(_ratio_aux(_sg(ratio_bt), ell_prox_bt, mask_bt))
    aux["behaviour_weight_mean"] = _sg(masked_mean(weight_bt, mask_bt, fallback=1.0))
    aux["behaviour_mask_fraction"] = _fraction(mask_bt & ~keep_bt, mask_bt)
    return aggregate(loss_bt, mask_bt, aggregation), aux


def cispo_loss(
    logp: jax.Array,
    behaviour_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    eps_low: float = 1.0,
    eps_high: float = 0.2,
    aggregation: str = "token-mean",
) -> tuple[jax.Array, dict[str, jax.Array]]:
    r"""CISPO: clip the importance weight, not the update (MiniMax-M1, arXiv 2506.13585,
    Eqs. 4-5).

    .. math::

        \ell_{bt} = -\operatorname{sg}\!\big[\operatorname{clip}(r_{bt},
                    1-\epsilon_{\mathrm{low}}, 1+\epsilon_{\mathrm{high}})\big]\,
                    A_{bt}\, \log\pi_\theta(y_{bt})

    Every token keeps a gradient (unlike PPO, where clipped tokens get none); its size is
    bounded by the clipped, stop-gradient weight. The paper disables the lower bound
    (default :math:`\epsilon_{low} = 1`, i.e. a lower ratio bound of 0; verl's recipe sets
    10, equivalent) and tunes :math:`\epsilon_{high}` (0.2 in verl's recipe). Token-mean
    aggregation, as in the paper.

    Args:
      logp, behaviour_logp, advantages, mask: see the module docstring.
      eps_low, eps_high: the weight is clipped to
        :math:`[1-\epsilon_{low}, 1+\epsilon_{high}]`.
      aggregation: see `aggregate`.

    Returns:
      ``(loss, aux)`` with the fractions of clipped weights (``clip_fraction``,
      ``clip_fraction_low``, ``clip_fraction_high``), ``weight_mean``, ``ratio_mean``,
      ``approx_kl``.
    """
    _check_clip(eps_low, eps_high)
    check_aggregation(aggregation)
    logp_bt, mask_bt, adv_bt, ell_bt = _prepare(logp, behaviour_logp, advantages, mask)
    ratio_bt = _sg(clamped_exp(ell_bt))
    lower, upper = 1.0 - eps_low, 1.0 + eps_high
    weight_bt = jnp.where(mask_bt, jnp.clip(ratio_bt, lower, upper), 0.0)
    logp_m = jnp.where(mask_bt, logp_bt, 0.0)
    loss_bt = -weight_bt * adv_bt * logp_m
    high_bt = mask_bt & (ratio_bt > upper)
    low_bt = mask_bt & (ratio_bt < lower)
    aux = {
        "clip_fraction": _fraction(low_bt | high_bt, mask_bt),
        "clip_fraction_low": _fraction(low_bt, mask_bt),
        "clip_fraction_high": _fraction(high_bt, mask_bt),
        "weight_mean": _sg(masked_mean(weight_bt, mask_bt, fallback=1.0)),
    }
    aux.update(_ratio_aux(ratio_bt, ell_bt, mask_bt))
    return aggregate(loss_bt, mask_bt, aggregation), aux


def gspo_loss(
    logp: jax.Array,
    behaviour_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    aggregation: str = "seq-mean-token-mean",
) -> tuple[jax.Array, dict[str, jax.Array]]:
    r"""GSPO, token form (Zheng et al., "Group Sequence Policy Optimization",
    arXiv 2507.18071, Eqs. 7 and 13-14).

    .. math::

        s_b = \exp\!\Big(\frac{1}{n_b}\sum_t \log\frac{\pi_\theta(y_{bt})}{\mu(y_{bt})}\Big),
        \qquad
        s_{bt} = \operatorname{sg}[s_b]\,\frac{\pi_\theta(y_{bt})}{\operatorname{sg}[
                 \pi_\theta(y_{bt})]}

        \ell_{bt} = \max\!\big(-A_{bt} s_{bt},\;
                    -A_{bt}\operatorname{clip}(s_{bt}, 1-\epsilon_{low}, 1+\epsilon_{high})\big)

    :math:`s_{bt}` equals the sequence ratio in value and passes each token's gradient
    with weight :math:`s_b`; with per-sequence advantages and the default
    ``seq-mean-token-mean`` aggregation this is exactly sequence-level GSPO, and a clipped
    sequence gives all its tokens zero gradient. Defaults :math:`3\cdot 10^{-4}` /
    :math:`4\cdot 10^{-4}` are the paper's ranges.

    Args:
      logp, behaviour_logp, advantages, mask: see the module docstring.
      eps_low, eps_high: clip ranges of the sequence ratio.
      aggregation: see `aggregate`.

    Returns:
      ``(loss, aux)``: token-level clip fractions as `ppo_clip_loss`, ``ratio_mean`` (of
      the sequence ratios over valid sequences), ``approx_kl``.
    """
    _check_clip(eps_low, eps_high)
    check_aggregation(aggregation)
    logp_bt, mask_bt, adv_bt, ell_bt = _prepare(logp, behaviour_logp, advantages, mask)
    count_b = jnp.sum(mask_bt, axis=-1, dtype=jnp.float32)
    seq_log_b = _sg(jnp.sum(ell_bt, axis=-1) / jnp.maximum(count_b, 1.0))
    seq_ratio_b = clamped_exp(seq_log_b)
    logp_m = jnp.where(mask_bt, logp_bt, 0.0)
    token_ratio_bt = jnp.broadcast_to(seq_ratio_b[:, None], mask_bt.shape) * jnp.exp(
        logp_m - _sg(logp_m)
    )
    loss_bt, low_bt, high_bt, dual_bt = _ppo_terms(
        token_ratio_bt, adv_bt, 1.0 - eps_low, 1.0 + eps_high, None
    )
    aux = clip_fraction_stats(low_bt, high_bt, dual_bt, mask_bt)
    aux["ratio_mean"] = _sg(masked_mean(seq_ratio_b, sequence_valid(mask_bt), fallback=1.0))
    aux["approx_kl"] = _sg(masked_mean(-ell_bt, mask_bt))
    return aggregate(loss_bt, mask_bt, aggregation), aux


def topr_loss(
    logp: jax.Array,
    behaviour_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    aggregation: str = "seq-mean-token-sum",
) -> tuple[jax.Array, dict[str, jax.Array]]:
    r"""Tapered Off-Policy REINFORCE (Le Roux, Bellemare et al., arXiv 2503.14286, Eq. 6).

    .. math::

        \nabla J = \sum_{A(\tau) \ge 0} A(\tau)\,\nabla\log\pi(\tau)
                 + \sum_{A(\tau) < 0} \Big[\frac{\pi(\tau)}{\mu(\tau)}\Big]_0^1
                   A(\tau)\,\nabla\log\pi(\tau)

    Samples with non-negative advantage are learned from as in supervised fine-tuning
    (weight 1, no importance ratio, however unlikely they have become); samples with
    negative advantage are weighted by their sequence ratio truncated to [0, 1], which
    stops the push-down once :math:`\pi` has left them behind. The loss is
    :math:`-\operatorname{sg}[w_b] A_{bt} \log\pi_\theta(y_{bt})`; the sequence ratio is
    formed in log space (:math:`\min(\sum_t \ell_{bt}, 0)`, exact for any length). The
    default aggregation sums each sequence's tokens (:math:`\log\pi(\tau)`).

    Args:
      logp, behaviour_logp, advantages, mask: see the module docstring (advantages are
        normally per sequence, :math:`R(\tau)` minus a baseline).
      aggregation: see `aggregate`.

    Returns:
      ``(loss, aux)`` with ``positive_fraction`` (valid tokens with :math:`A \ge 0`),
      ``truncated_fraction`` (negative tokens whose sequence ratio exceeded 1),
      ``weight_mean``, ``ratio_mean``, ``approx_kl``.
    """
    check_aggregation(aggregation)
    logp_bt, mask_bt, adv_bt, ell_bt = _prepare(logp, behaviour_logp, advantages, mask)
    seq_log_b = _sg(jnp.sum(ell_bt, axis=-1))
    neg_weight_b = jnp.exp(jnp.minimum(seq_log_b, 0.0))
    neg_weight_bt = jnp.broadcast_to(neg_weight_b[:, None], mask_bt.shape)
    positive_bt = adv_bt >= 0
    weight_bt = jnp.where(mask_bt, jnp.where(positive_bt, 1.0, neg_weight_bt), 0.0)
    logp_m = jnp.where(mask_bt, logp_bt, 0.0)
    loss_bt = -weight_bt * adv_bt * logp_m
    truncated_bt = ~positive_bt & jnp.broadcast_to(seq_log_b[:, None] > 0, mask_bt.shape)
    aux = {
        "positive_fraction": _fraction(positive_bt, mask_bt),
        "truncated_fraction": _fraction(truncated_bt, mask_bt),
        "weight_mean": _sg(masked_mean(weight_bt, mask_bt, fallback=1.0)),
    }
    aux.update(_ratio_aux(_sg(clamped_exp(ell_bt)), ell_bt, mask_bt))
    return aggregate(loss_bt, mask_bt, aggregation), aux


class BAPOBounds(NamedTuple):
    """Clip bounds chosen by BAPO's search (explicit ratio bounds, not epsilons)."""

    clip_low: jax.Array  # f32 []: lower ratio bound c_low.
    clip_high: jax.Array  # f32 []: upper ratio bound c_high.
    positive_share: jax.Array  # f32 []: positive share of the contributions at the bounds.
    num_steps: jax.Array  # i32 []: widening steps taken.


def _positive_share(ratio_bt, adv_bt, mask_bt, low, high, contribution):
    if contribution == "unclipped":
        # Contributions of the tokens whose gradient survives the clip: r |A|.
        pos = jnp.where(mask_bt & (adv_bt > 0) & (ratio_bt <= high), ratio_bt * adv_bt, 0.0)
        neg = jnp.where(mask_bt & (adv_bt < 0) & (ratio_bt >= low), -ratio_bt * adv_bt, 0.0)
    else:
        # The official recipe's effective advantages: clipped-ratio times |A|.
        pos = jnp.where(mask_bt & (adv_bt > 0), jnp.minimum(ratio_bt, high) * adv_bt, 0.0)
        neg = jnp.where(mask_bt & (adv_bt < 0), -jnp.maximum(ratio_bt, low) * adv_bt, 0.0)
    pos_sum, neg_sum = jnp.sum(pos), jnp.sum(neg)
    total = pos_sum + neg_sum
    # Nothing negative to balance (or nothing at all): the target is met.
    return jnp.where(total > 0, pos_sum / jnp.where(total > 0, total, 1.0), 1.0)


def _check_bapo(
    target_positive_share,
    low_start,
    low_max,
    low_step,
    high_start,
    high_max,
    high_step,
    contribution,
):
    check_choice("contribution", contribution, BAPO_CONTRIBUTIONS)
    values = {
        "target_positive_share": target_positive_share,
        "low_start": low_start,
        "low_max": low_max,
        "low_step": low_step,
        "high_start": high_start,
        "high_max": high_max,
        "high_step": high_step,
    }
    for name, value in values.items():
        if not is_python_number(value):
            raise ValueError(
                f"BAPO's `{name}` must be a Python number, got {type(value).__name__}."
            )
    if not 0.0 <= target_positive_share <= 1.0:
        raise ValueError(f"`target_positive_share` must be in [0, 1], got {target_positive_share}.")
    check_positive("low_step", low_step)
    check_positive("high_step", high_step)
    check_nonnegative("low_start", low_start)
    if low_start > low_max:
        raise ValueError(f"`low_start` ({low_start}) must not exceed `low_max` ({low_max}).")
    if high_start > high_max:
        raise ValueError(f"`high_start` ({high_start}) must not exceed `high_max` ({high_max}).")


def bapo_clip_bounds(
    logp: jax.Array,
    behaviour_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    target_positive_share: float = 0.5,
    low_start: float = 0.6,
    low_max: float = 0.9,
    low_step: float = 0.05,
    high_start: float = 1.2,
    high_max: float = 3.0,
    high_step: float = 0.05,
    contribution: str = "unclipped",
) -> BAPOBounds:
    r"""BAPO's per-batch search for clip bounds (Xi et al., arXiv 2510.18927, Sec. 4,
    Algorithm 1; official code WooooDyy/BAPO ``recipe/bapo/policy_loss.py``).

    Starting from :math:`[c_{low}, c_{high}] = [a^-, a^+]`, the bounds are widened in steps
    until the positive share of the clipped objective

    .. math::

        \rho = \frac{\sum_{A_t > 0} \mathrm{contrib}_t}{\sum_{A_t \ne 0} \mathrm{contrib}_t}

    reaches :math:`\rho_0`, or both bounds reach their limits :math:`b^-, b^+`. As in the
    official code, :math:`c_{low}` is raised first (towards :math:`b^-`), then
    :math:`c_{high}`; each step is :math:`\min(c + \delta, b)`. Raising :math:`c_{low}`
    silences more low-probability negative tokens and raising :math:`c_{high}` lets more
    positive tokens through, both re-balancing towards the positive side.

    ``contribution="unclipped"`` (default) counts :math:`r_t |A_t|` over the tokens whose
    gradient survives the clip (:math:`A>0, r \le c_{high}`; :math:`A<0, r \ge c_{low}`):
    our reading of the paper, where clipping is what removes updates (the paper's own
    equation was not available to us); with it :math:`\rho` never falls along the search.
    ``"clamped"`` counts :math:`|A_t| \min(r, c_{high})` and :math:`|A_t| \max(r, c_{low})`
    over all tokens, as the official verl recipe does; there raising :math:`c_{low}` enlarges
    the negative side and can lower :math:`\rho`. The defaults are those the official
    README gives for the paper: :math:`\rho_0 = 0.5`, :math:`[a^-, b^-] = [0.6, 0.9]`,
    :math:`[a^+, b^+] = [1.2, 3.0]`; step 0.05 as in the recipe's config.

    Args:
      logp, behaviour_logp, advantages, mask: see the module docstring.
      target_positive_share: :math:`\rho_0 \in [0, 1]`.
      low_start, low_max, low_step: :math:`a^-, b^-, \delta^-` of the lower ratio bound.
      high_start, high_max, high_step: :math:`a^+, b^+, \delta^+` of the upper ratio bound.
      contribution: ``"unclipped"`` or ``"clamped"``.

    The search is a `jax.lax.while_loop` over integer step counts (at most
    :math:`\lceil (b^- - a^-)/\delta^- \rceil + \lceil (b^+ - a^+)/\delta^+ \rceil` iterations);
    the bounds carry no gradient. Search hyperparameters must be Python numbers.

    Returns:
      `BAPOBounds`.
    """
    _check_bapo(
        target_positive_share,
        low_start,
        low_max,
        low_step,
        high_start,
        high_max,
        high_step,
        contribution,
    )
    _, mask_bt, adv_bt, ell_bt = _prepare(logp, behaviour_logp, advantages, mask)
    ratio_bt = _sg(clamped_exp(ell_bt))
    # Bounds are indexed by integer step counts, so the last step lands exactly on the limit
    # (repeated float additions could stop a hair short of it and take one more step).
    num_low = max(math.ceil((low_max - low_start) / low_step - 1e-6), 0)
    num_high = max(math.ceil((high_max - high_start) / high_step - 1e-6), 0)

    def bound(start, step, limit, count, k):
        return jnp.where(k < count, start + step * k.astype(jnp.float32), limit)

    def bounds(k_low, k_high):
        return (
            bound(low_start, low_step, low_max, num_low, k_low),
            bound(high_start, high_step, high_max, num_high, k_high),
        )

    def share(k_low, k_high):
        low, high = bounds(k_low, k_high)
        return _positive_share(ratio_bt, adv_bt, mask_bt, low, high, contribution)

    def cond(state):
        k_low, k_high, rho = state
        return (rho < target_positive_share) & ((k_low < num_low) | (k_high < num_high))

    def body(state):
        k_low, k_high, _ = state
        raise_low = k_low < num_low
        k_low = jnp.where(raise_low, k_low + 1, k_low)
        k_high = jnp.where(raise_low, k_high, k_high + 1)
        return k_low, k_high, share(k_low, k_high)

    zero = jnp.asarray(0, jnp.int32)
    k_low, k_high, rho = jax.lax.while_loop(cond, body, (zero, zero, share(zero, zero)))
    low, high = bounds(k_low, k_high)
    steps = k_low + k_high
    return BAPOBounds(clip_low=low, clip_high=high, positive_share=rho, num_steps=steps)


def bapo_loss(
    logp: jax.Array,
    behaviour_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    target_positive_share: float = 0.5,
    low_start: float = 0.6,
    low_max: float = 0.9,
    low_step: float = 0.05,
    high_start: float = 1.2,
    high_max: float = 3.0,
    high_step: float = 0.05,
    contribution: str = "unclipped",
    dual_clip: float | None = 3.0,
    aggregation: str = "token-mean",
) -> tuple[jax.Array, dict[str, jax.Array]]:
    r"""BAPO: PPO clip with bounds searched per batch (Xi et al., arXiv 2510.18927).

    .. math::

        \ell_{bt} = \max\!\big(-A r,\; -A\,\operatorname{clip}(r, c_{low}, c_{high})\big)

    with :math:`[c_{low}, c_{high}]` from `bapo_clip_bounds` (same arguments) and the dual
    clip :math:`c = 3` of the official recipe (None disables it).

    Args:
      logp, behaviour_logp, advantages, mask: see the module docstring.
      target_positive_share, low_start, low_max, low_step, high_start, high_max,
        high_step, contribution: see `bapo_clip_bounds`.
      dual_clip: :math:`c > 1` or None.
      aggregation: see `aggregate`.

    Returns:
      ``(loss, aux)``: the diagnostics of `ppo_clip_loss` plus ``clip_low``,
      ``clip_high``, ``positive_share`` and ``search_steps`` (the bounds it chose).
    """
    _check_clip(0.0, 0.0, dual_clip)
    check_aggregation(aggregation)
    bounds = bapo_clip_bounds(
        logp,
        behaviour_logp,
        advantages,
        mask,
        target_positive_share=target_positive_share,
        low_start=low_start,
        low_max=low_max,
        low_step=low_step,
        high_start=high_start,
        high_max=high_max,
        high_step=high_step,
        contribution=contribution,
    )
    _, mask_bt, adv_bt, ell_bt = _prepare(logp, behaviour_logp, advantages, mask)
    ratio_bt = clamped_exp(ell_bt)
    loss_bt, low_bt, high_bt, dual_bt = _ppo_terms(
        ratio_bt, adv_bt, bounds.clip_low, bounds.clip_high, dual_clip
    )
    aux = clip_fraction_stats(low_bt, high_bt, dual_bt, mask_bt)
    aux.update(_ratio_aux(_sg(ratio_bt), ell_bt, mask_bt))
    aux.update(
        clip_low=bounds.clip_low,
        clip_high=bounds.clip_high,
        positive_share=bounds.positive_share,
        search_steps=bounds.num_steps.astype(jnp.float32),
    )
    return aggregate(loss_bt, mask_bt, aggregation), aux


def m2po_loss(
    logp: jax.Array,
    behaviour_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    tau_m2: float = 0.04,
    variant: str = "mask",
    min_eps_low: float | None = None,
    min_eps_high: float | None = None,
    aggregation: str = "token-mean",
) -> tuple[jax.Array, dict[str, jax.Array]]:
    r"""M2PO: second-moment trust region instead of ratio clipping (Zheng, Zhao, Chen,
    arXiv 2510.01161, Eq. 6).

    ``variant="mask"`` (the paper's objective):

    .. math::

        \mathcal{L} = -\frac{1}{\sum_i |o_i|}\sum_{i,t} M_{i,t}\, r_{i,t}\, A_{i,t},
        \qquad r = \frac{\pi_\theta}{\pi_{\mathrm{behav}}}

    with :math:`M` from `m2po_mask`: the fewest largest-:math:`(\log r)^2` tokens are
    dropped so the kept second moment is below :math:`\tau_{M_2}`; no clipping. The
    normaliser counts all valid tokens, dropped ones included, as the formula does.

    ``variant="harmful_budget"`` (the official code's ``compute_m2po_policy_loss``): PPO
    clip with the ranges of `m2po_harmful_clip`, which spends the M2 budget only on tokens
    whose ratio moved in the rewarded direction.

    Args:
      logp, behaviour_logp, advantages, mask: see the module docstring.
      tau_m2: :math:`\tau_{M_2} \ge 0` (0.04 in the paper and the official scripts).
      variant: ``"mask"`` or ``"harmful_budget"``.
      min_eps_low, min_eps_high: ``harmful_budget`` only, see `m2po_harmful_clip`.
      aggregation: see `aggregate`.

    Returns:
      ``(loss, aux)`` with ``m2_before``, ``m2_after``, ``masked_fraction``, ``ratio_mean``,
      ``approx_kl``, and for ``harmful_budget`` the clip diagnostics and chosen
      ``eps_low``/``eps_high``.
    """
    check_choice("variant", variant, M2PO_VARIANTS)
    check_nonnegative("tau_m2", tau_m2)
    check_aggregation(aggregation)
    if variant == "harmful_budget":
        clip = m2po_harmful_clip(
            logp,
            behaviour_logp,
            advantages,
            mask,
            tau_m2=tau_m2,
            min_eps_low=min_eps_low,
            min_eps_high=min_eps_high,
        )
        loss, aux = ppo_clip_loss(
            logp,
            behaviour_logp,
            advantages,
            mask,
            eps_low=clip.eps_low,
            eps_high=clip.eps_high,
            aggregation=aggregation,
        )
        aux.update(
            m2_before=clip.m2_before,
            m2_after=clip.m2_after,
            masked_fraction=clip.masked_fraction,
            eps_low=clip.eps_low,
            eps_high=clip.eps_high,
        )
        return loss, aux
    _, mask_bt, adv_bt, ell_bt = _prepare(logp, behaviour_logp, advantages, mask)
    m2 = m2po_mask(logp, behaviour_logp, mask_bt, tau_m2=tau_m2)
    ratio_bt = clamped_exp(ell_bt)
    loss_bt = jnp.where(m2.mask, -adv_bt * ratio_bt, 0.0)
    aux = {
        "m2_before": m2.m2_before,
        "m2_after": m2.m2_after,
        "masked_fraction": m2.masked_fraction,
    }
    aux.update(_ratio_aux(_sg(ratio_bt), ell_bt, mask_bt))
    return aggregate(loss_bt, mask_bt, aggregation), aux


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
    :math:`\beta` is the KL coefficient; the default 0.012 is the official GSM8K config's
    starting value (annealed there to 0.004). Sequences without valid tokens are left out.

    Args:
      logp: [B, T] current-policy log-probabilities.
      behaviour_logp: [B, T] (unused by the objective).
      rewards: [B] raw rewards :math:`R_i` (in the advantages position of the common
        signature).
      mask: [B, T] valid tokens.
      reference_logp: [B, T] reference-policy log-probabilities.
      group_ids: [B] integers, sequences of the same prompt share one.
      beta: :math:`\beta > 0`.

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
