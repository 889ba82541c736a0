"""Ratio-based policy losses (the other modules' losses share their signature):
``loss_fn(logp, behaviour_logp, advantages, mask, *, ...) -> (loss, aux)``, with ``logp``
[B, T] under the policy being trained (the only input a gradient flows into),
``behaviour_logp`` [B, T] under the policy that sampled the tokens, ``advantages`` [B]
(broadcast to the tokens) or [B, T], ``mask`` [B, T] valid tokens (bool, or nonzero
float: padded tokens contribute exactly zero to the loss and its gradient), ``aggregation``
as `aggregate`'s; ``aux`` holds float32 scalar diagnostics without gradient. The loss is
minimised (the negative of the paper's objective); ratios come from log-ratios clamped to
+-20 (`MAX_LOG_RATIO`), so log-probs of any magnitude give finite values and gradients.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gac_jax.objectives._common import (
    as_float,
    check_positive,
    check_tokens,
    clamped_exp,
    clip_fraction_stats,
    fraction,
    masked_log_ratio,
    masked_mean,
    sequence_valid,
)
from gac_jax.objectives._loss_terms import (
    _check_clip,
    _ppo_terms,
    _prepare,
    _ratio_aux,
    _sg,
    _weighted_pg,
    _weights_bt,
)
from gac_jax.objectives.aggregation import aggregate


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
    gradient is the per-token importance-sampled policy gradient. `is_weights` ([B] or
    [B, T]) replaces it with a corrected weight (`truncated_importance_weights`,
    `masked_importance_weights`, `icepop_weights`, or ones for plain REINFORCE).

    Returns:
      ``(loss, aux)`` with ``weight_mean``, ``ratio_mean``, ``approx_kl``.
    """
    logp_bt, mask_bt, adv_bt, ell_bt = _prepare(logp, behaviour_logp, advantages, mask, aggregation)
    w_bt = clamped_exp(ell_bt) if is_weights is None else _weights_bt(is_weights, mask_bt)
    return _weighted_pg(logp_bt, mask_bt, adv_bt, ell_bt, w_bt, aggregation)


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
    gradient.

    Args:
      eps_low, eps_high: clip ranges, :math:`\ge 0`.
      dual_clip: :math:`c > 1`, or None for no dual clip (verl uses 3).
      is_weights: optional [B] or [B, T] extra weights (e.g. a TIS correction between the
        proximal and the inference policy) multiplying each token's loss, no gradient.

    Returns:
      ``(loss, aux)`` with ``clip_fraction`` (= low + high), ``clip_fraction_low``,
      ``clip_fraction_high``, ``dual_clip_fraction``, ``ratio_mean``, ``approx_kl``.
    """
    _check_clip(eps_low, eps_high, dual_clip)
    _, mask_bt, adv_bt, ell_bt = _prepare(logp, behaviour_logp, advantages, mask, aggregation)
    ratio_bt = clamped_exp(ell_bt)
    lower, upper = 1.0 - eps_low, 1.0 + eps_high
    loss_bt, aux = _ppo_terms(ratio_bt, adv_bt, mask_bt, lower, upper, dual_clip)
    if is_weights is not None:
        loss_bt = loss_bt * _weights_bt(is_weights, mask_bt)
    aux.update(_ratio_aux(_sg(ratio_bt), ell_bt, mask_bt))
    return aggregate(loss_bt, mask_bt, aggregation), aux


def decoupled_ppo_loss(
    logp: jax.Array,
    behaviour_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    proximal_logp: jax.Array,
    behaviour_weight_cap: float | None = None,
    **clip: float | str | None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    r"""AReaL's decoupled PPO objective (Fu et al., arXiv 2505.24298, Eq. 5): clip against
    a proximal policy (a recent snapshot: in AReaL, the params before this update, so the
    trust region does not depend on how stale the behaviour policy is), correct for the
    behaviour policy with a separate weight.

    .. math::

        \ell_{bt} = \operatorname{sg}\!\left[\frac{\pi_{\mathrm{prox}}}{\pi_{\mathrm{behav}}}
        \right] \max\!\big(-A u,\; -A\,\operatorname{clip}(u, 1-\epsilon_{\mathrm{low}},
        1+\epsilon_{\mathrm{high}})\big), \qquad u = \frac{\pi_\theta}{\pi_{\mathrm{prox}}}

    Args:
      proximal_logp: [B, T] proximal-policy log-probabilities.
      behaviour_weight_cap: optional cap > 0: tokens whose behaviour weight exceeds it are
        dropped (AReaL's ``behav_imp_weight_cap``), the normaliser kept, as AReaL does.
      **clip: `ppo_clip_loss`'s clip ranges and aggregation; any other is a TypeError.

    Returns:
      ``(loss, aux)``: the clip diagnostics of `ppo_clip_loss` (against the proximal
      policy), ``behaviour_weight_mean`` and ``behaviour_mask_fraction``.
    """
    check_positive("behaviour_weight_cap", behaviour_weight_cap)  # None (no cap) passes.
    _, mask_bt, _, _ = _prepare(logp, behaviour_logp, advantages, mask)
    _, prox_bt, _ = check_tokens(logp, proximal_logp, mask_bt)
    log_weight_bt = masked_log_ratio(prox_bt, as_float(behaviour_logp), mask_bt)
    weight_bt = _sg(jnp.where(mask_bt, clamped_exp(log_weight_bt), 0.0))
    keep_bt = mask_bt
    if behaviour_weight_cap is not None:
        keep_bt = mask_bt & (weight_bt <= behaviour_weight_cap)
    is_weights = jnp.where(keep_bt, weight_bt, 0.0)
    loss, aux = ppo_clip_loss(logp, proximal_logp, advantages, mask, is_weights=is_weights, **clip)
    aux["behaviour_weight_mean"] = _sg(masked_mean(weight_bt, mask_bt, fallback=1.0))
    aux["behaviour_mask_fraction"] = fraction(mask_bt & ~keep_bt, mask_bt)
    return loss, aux


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

    Every token keeps a gradient (unlike PPO's clipped tokens), bounded by the clipped,
    stop-gradient weight. The paper disables the lower bound (default
    :math:`\epsilon_{low} = 1`, a lower ratio bound of 0; verl's recipe sets 10, equivalent)
    and tunes :math:`\epsilon_{high}` (0.2 in verl's recipe); token-mean, as the paper.

    Returns:
      ``(loss, aux)`` with ``clip_fraction``, ``clip_fraction_low``, ``clip_fraction_high``
      (clipped weights), ``weight_mean``, ``ratio_mean``, ``approx_kl``.
    """
    _check_clip(eps_low, eps_high)
    logp_bt, mask_bt, adv_bt, ell_bt = _prepare(logp, behaviour_logp, advantages, mask, aggregation)
    ratio_bt = clamped_exp(ell_bt)
    lower, upper = 1.0 - eps_low, 1.0 + eps_high
    loss, aux = _weighted_pg(
        logp_bt, mask_bt, adv_bt, ell_bt, jnp.clip(ratio_bt, lower, upper), aggregation
    )
    low_bt, high_bt = mask_bt & (ratio_bt < lower), mask_bt & (ratio_bt > upper)
    aux.update(clip_fraction_stats(low_bt, high_bt, None, mask_bt))
    return loss, aux


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
    ``seq-mean-token-mean`` aggregation this is exactly sequence-level GSPO. `eps_low`,
    `eps_high` clip the sequence ratio (defaults: the paper's ranges).

    Returns:
      ``(loss, aux)``: `ppo_clip_loss`'s token clip fractions and ``approx_kl``, and
      ``ratio_mean`` over valid sequences.
    """
    _check_clip(eps_low, eps_high)
    logp_bt, mask_bt, adv_bt, ell_bt = _prepare(logp, behaviour_logp, advantages, mask, aggregation)
    count_b = jnp.sum(mask_bt, axis=-1, dtype=jnp.float32)
    seq_log_b = _sg(jnp.sum(ell_bt, axis=-1) / jnp.maximum(count_b, 1.0))
    seq_ratio_b = clamped_exp(seq_log_b)
    logp_m = jnp.where(mask_bt, logp_bt, 0.0)
    seq_ratio_bt = jnp.broadcast_to(seq_ratio_b[:, None], mask_bt.shape)
    token_ratio_bt = seq_ratio_bt * jnp.exp(logp_m - _sg(logp_m))
    loss_bt, aux = _ppo_terms(token_ratio_bt, adv_bt, mask_bt, 1.0 - eps_low, 1.0 + eps_high, None)
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
    (weight 1, however unlikely they have become); negative ones are weighted by their
    sequence ratio truncated to [0, 1], which stops the push-down once :math:`\pi` has
    left them behind. The loss is :math:`-\operatorname{sg}[w_b] A_{bt} \log\pi_\theta`,
    the ratio formed in log space; the default aggregation sums each sequence's tokens.

    Returns:
      ``(loss, aux)`` with ``positive_fraction`` (valid tokens with :math:`A \ge 0`),
      ``truncated_fraction`` (negative tokens whose sequence ratio exceeded 1),
      ``weight_mean``, ``ratio_mean``, ``approx_kl``.
    """
    logp_bt, mask_bt, adv_bt, ell_bt = _prepare(logp, behaviour_logp, advantages, mask, aggregation)
    seq_log_b = _sg(jnp.sum(ell_bt, axis=-1))
    neg_weight_b = jnp.exp(jnp.minimum(seq_log_b, 0.0))
    neg_weight_bt = jnp.broadcast_to(neg_weight_b[:, None], mask_bt.shape)
    positive_bt = adv_bt >= 0
    weight_bt = jnp.where(positive_bt, 1.0, neg_weight_bt)
    loss, aux = _weighted_pg(logp_bt, mask_bt, adv_bt, ell_bt, weight_bt, aggregation)
    truncated_bt = ~positive_bt & jnp.broadcast_to(seq_log_b[:, None] > 0, mask_bt.shape)
    aux["positive_fraction"] = fraction(positive_bt, mask_bt)
    aux["truncated_fraction"] = fraction(truncated_bt, mask_bt)
    return loss, aux
