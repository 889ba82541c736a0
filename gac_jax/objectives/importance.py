"""Importance ratios between the current and the behaviour policy, and the corrections
built on them: truncated IS (TIS), masked IS (MIS), IcePop's band and M2PO's masks.

Every weight returned here carries no gradient (a correction factor, as verl's
``rollout_is_weights``); every mask is a new bool [B, T] array of the tokens a loss keeps.
Sequence-level ratios are formed in log space. Arrays as in `gac_jax.objectives.losses`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from gac_jax.objectives._common import (
    MAX_LOG_RATIO,
    broadcast_per_token,
    check_choice,
    check_nonnegative,
    check_positive,
    check_tokens,
    clamped_exp,
    fraction,
    is_python_number,
    masked_log_ratio,
    masked_mean,
)

LEVELS = ("token", "sequence", "geometric")
SEQUENCE_MODES = ("sum", "mean")


class ImportanceWeights(NamedTuple):
    """Correction weights and the mask of tokens they keep."""

    weights: jax.Array  # f32 [B, T]: no gradient; 0 on padded and on dropped tokens.
    mask: jax.Array  # bool [B, T]: valid tokens still in the loss.
    fraction: jax.Array  # f32 []: share of valid tokens truncated (TIS) or dropped (MIS).


class M2POMask(NamedTuple):
    """Result of M2PO's second-moment masking."""

    mask: jax.Array  # bool [B, T]: valid tokens kept.
    m2_before: jax.Array  # f32 []: mean squared log-ratio over the valid tokens.
    m2_after: jax.Array  # f32 []: mean squared log-ratio over the kept tokens (0 if none).
    masked_fraction: jax.Array  # f32 []: share of valid tokens dropped.


class M2POHarmfulClip(NamedTuple):
    """Result of the harmful-token M2 budget of M2PO's official code."""

    mask: jax.Array  # bool [B, T]: valid tokens whose gradient survives the clip.
    eps_low: jax.Array  # f32 []: PPO lower clip range (ratio bound 1 - eps_low).
    eps_high: jax.Array  # f32 []: PPO upper clip range (ratio bound 1 + eps_high).
    m2_before: jax.Array  # f32 []: mean squared log-ratio over harmful tokens.
    m2_after: jax.Array  # f32 []: the same after capping |log-ratio| at the chosen tau.
    masked_fraction: jax.Array  # f32 []: share of valid tokens whose gradient is clipped.


def token_log_ratio(logp: jax.Array, behaviour_logp: jax.Array, mask: jax.Array) -> jax.Array:
    r"""Per-token log importance ratio :math:`\ell_{bt} = \log\pi_\theta - \log\mu`,
    the log of PPO's :math:`r_t(\theta)` (arXiv 1707.06347, Eq. 6): [B, T] float32, exactly
    0 (with zero gradient) on padded tokens."""
    logp, behaviour_logp, mask_bt = check_tokens(logp, behaviour_logp, mask)
    return masked_log_ratio(logp, behaviour_logp, mask_bt)


def sequence_log_ratio(
    logp: jax.Array, behaviour_logp: jax.Array, mask: jax.Array, *, mode: str = "sum"
) -> jax.Array:
    r"""Per-sequence log importance weight.

    - ``"sum"``: :math:`\log w_b = \sum_t \ell_{bt}`, the log of the product of token
      ratios, :math:`\pi_\theta(y_b)/\mu(y_b)` (the trajectory weight of VCPO,
      arXiv 2602.17616, and of sequence-level TIS).
    - ``"mean"``: :math:`\frac{1}{n_b}\sum_t \ell_{bt}`, the log of the geometric mean
      (GSPO, arXiv 2507.18071, Eq. 7). 0 for a sequence without valid tokens.

    Returns:
      [B] float32 (logs, so no overflow however large the log-probabilities).
    """
    check_choice("mode", mode, SEQUENCE_MODES)
    logp, behaviour_logp, mask_bt = check_tokens(logp, behaviour_logp, mask)
    sum_b = jnp.sum(masked_log_ratio(logp, behaviour_logp, mask_bt), axis=-1)
    if mode == "sum":
        return sum_b
    count_b = jnp.sum(mask_bt, axis=-1, dtype=jnp.float32)
    return sum_b / jnp.maximum(count_b, 1.0)


def _level_log_ratio(logp, behaviour_logp, mask_bt, level: str) -> jax.Array:
    """[B, T] log ratios at `level`; sequence levels are broadcast over tokens."""
    check_choice("level", level, LEVELS)
    ell_bt = masked_log_ratio(logp, behaviour_logp, mask_bt)
    if level == "token":
        return ell_bt
    seq_b = sequence_log_ratio(
        logp, behaviour_logp, mask_bt, mode="sum" if level == "sequence" else "mean"
    )
    return jnp.where(mask_bt, broadcast_per_token(seq_b, mask_bt.shape, "seq"), 0.0)


def importance_ratio(
    logp: jax.Array, behaviour_logp: jax.Array, mask: jax.Array, *, level: str = "token"
) -> jax.Array:
    r"""Importance ratio :math:`\pi_\theta/\mu` at token or sequence level, with gradient.

    - ``"token"``: :math:`r_{bt} = e^{\ell_{bt}}` (PPO, arXiv 1707.06347).
    - ``"sequence"``: :math:`w_b = \prod_t r_{bt}` broadcast to the tokens of sequence b.
    - ``"geometric"``: :math:`s_b = (\prod_t r_{bt})^{1/n_b}` broadcast (GSPO).

    Returns:
      [B, T] float32, 0 on padded tokens; the log-ratio is clamped to :math:`\pm 20`.
    """
    logp, behaviour_logp, mask_bt = check_tokens(logp, behaviour_logp, mask)
    ell_bt = _level_log_ratio(logp, behaviour_logp, mask_bt, level)
    return jnp.where(mask_bt, clamped_exp(ell_bt), 0.0)


def truncated_importance_weights(
    logp: jax.Array,
    behaviour_logp: jax.Array,
    mask: jax.Array,
    *,
    cap: float = 2.0,
    level: str = "token",
) -> ImportanceWeights:
    r"""Truncated importance sampling (TIS): :math:`w = \min(\pi_\theta/\mu,\ C)`.

    Computed as :math:`\exp(\min(\ell, \log C))`, exact for any log-ratio, at `level`
    (as `importance_ratio`'s; sequence levels give every token of a sequence one weight).
    F. Yao et al., "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"
    (2025, https://fengyao.notion.site/off-policy-rl) use :math:`C = 2` for the
    rollout/trainer mismatch; TOPR (arXiv 2503.14286) truncates the sequence ratio, and VCPO
    (arXiv 2602.17616) compares against sequence-level TIS.

    Returns:
      `ImportanceWeights`; the mask is unchanged, ``fraction`` is the share of valid
      tokens whose weight was truncated.
    """
    check_positive("cap", cap)
    logp, behaviour_logp, mask_bt = check_tokens(logp, behaviour_logp, mask)
    ell_bt = jax.lax.stop_gradient(_level_log_ratio(logp, behaviour_logp, mask_bt, level))
    log_cap = jnp.log(jnp.asarray(cap, jnp.float32))
    weights = jnp.where(mask_bt, jnp.exp(jnp.minimum(ell_bt, log_cap)), 0.0)
    truncated = mask_bt & (ell_bt > log_cap)
    return ImportanceWeights(weights=weights, mask=mask_bt, fraction=fraction(truncated, mask_bt))


def _band_weights(ell_bt, mask_bt, low, high) -> ImportanceWeights:
    """Weights e^ell kept where log(low) <= ell <= log(high), dropped (0, masked) outside."""
    keep = mask_bt & (ell_bt <= jnp.log(jnp.asarray(high, jnp.float32)))
    if low is not None:
        keep = keep & (ell_bt >= jnp.log(jnp.asarray(low, jnp.float32)))
    weights = jnp.where(keep, jnp.exp(jnp.where(keep, ell_bt, 0.0)), 0.0)
    return ImportanceWeights(
        weights=weights, mask=keep, fraction=fraction(mask_bt & ~keep, mask_bt)
    )


def masked_importance_weights(
    logp: jax.Array,
    behaviour_logp: jax.Array,
    mask: jax.Array,
    *,
    cap: float = 2.0,
    lower: float | None = None,
    level: str = "token",
) -> ImportanceWeights:
    r"""Masked importance sampling (MIS): keep the weight where it is at most the cap,
    drop the token (or the whole sequence) where it is not.

    .. math::

        w = \frac{\pi_\theta}{\mu}\,\mathbb{1}\!\left[L \le \frac{\pi_\theta}{\mu} \le C\right]

    (:math:`L \ge 0` only if `lower` is given; :math:`C > 0` is `cap`). Unlike TIS, which
    keeps the sample with a capped weight, MIS rejects it. At ``"sequence"`` level one
    outlying token removes its whole sequence, at ``"geometric"`` level the geometric mean
    is tested (Geo-MIS): the sequence-level MIS of Liu, Li et al., "When Speed Kills
    Stability: Demystifying RL Collapse from the Training-Inference Mismatch" (2025,
    https://richardli.xyz/rl-collapse), as merged into verl's rollout correction.

    Returns:
      `ImportanceWeights`; ``mask`` drops the rejected tokens, ``fraction`` is their share
      of the valid tokens.
    """
    check_positive("cap", cap)
    check_nonnegative("lower", lower)  # None (no lower bound) passes, as arrays do.
    if is_python_number(lower) and is_python_number(cap) and lower > cap:
        raise ValueError(f"`lower` ({lower}) must not exceed `cap` ({cap}).")
    logp, behaviour_logp, mask_bt = check_tokens(logp, behaviour_logp, mask)
    ell_bt = jax.lax.stop_gradient(_level_log_ratio(logp, behaviour_logp, mask_bt, level))
    return _band_weights(ell_bt, mask_bt, lower, cap)


def icepop_weights(
    logp: jax.Array,
    behaviour_logp: jax.Array,
    mask: jax.Array,
    *,
    low: float = 0.5,
    high: float = 5.0,
) -> ImportanceWeights:
    r"""IcePop's two-sided token mask (Ling Team, Ring-1T, arXiv 2510.18855, Sec. 3).

    .. math::

        M(k) = \begin{cases} k & \alpha \le k \le \beta \\ 0 & \text{otherwise}\end{cases},
        \qquad k = \frac{\pi_{\mathrm{train}}(y_t)}{\pi_{\mathrm{infer}}(y_t)}

    Tokens whose training/inference probability ratio (`logp`, `behaviour_logp`) leaves
    the band :math:`[\alpha, \beta]` = [`low`, `high`] (the paper's 0.5 and 5) are excluded
    from the gradient; the others are corrected by their ratio.

    Returns:
      `ImportanceWeights` (token level).
    """
    check_positive("low", low)
    check_positive("high", high)
    if is_python_number(low) and is_python_number(high) and low > high:
        raise ValueError(f"IcePop band is empty: `low` ({low}) > `high` ({high}).")
    logp, behaviour_logp, mask_bt = check_tokens(logp, behaviour_logp, mask)
    ell_bt = jax.lax.stop_gradient(masked_log_ratio(logp, behaviour_logp, mask_bt))
    return _band_weights(ell_bt, mask_bt, low, high)


def m2po_mask(
    logp: jax.Array, behaviour_logp: jax.Array, mask: jax.Array, *, tau_m2: float = 0.04
) -> M2POMask:
    r"""M2PO's second-moment mask (Zheng, Zhao, Chen, arXiv 2510.01161, Sec. 4).

    .. math::

        \hat M_2 = \frac{1}{N}\sum_{i=1}^{N} (\log r_i)^2, \qquad
        r_i = \frac{\pi_\theta(y_i)}{\pi_{\mathrm{behav}}(y_i)}

    Tokens are dropped in decreasing order of :math:`(\log r_i)^2` until the mean over the
    kept tokens is strictly below :math:`\tau_{M_2}` = `tau_m2` (0.04 in the paper): the
    fewest drops, largest first, as AReaL's ``get_m2po_loss_mask`` (which is passed the
    proximal policy's `logp`). One sort and a cumulative sum: keeping the :math:`m` smallest
    values is feasible iff their sum is below :math:`m\,\tau_{M_2}`, and that mean grows
    with :math:`m`. Sums run from the smallest value up, so a huge value never cancels the
    small ones. When even the smallest value is :math:`\ge \tau_{M_2}` every token is
    dropped (AReaL keeps one, leaving the mean above the threshold): a zero loss, a skipped
    step. Ties at the boundary are broken by position. Returns an `M2POMask`, no gradient.
    """
    check_nonnegative("tau_m2", tau_m2)
    logp, behaviour_logp, mask_bt = check_tokens(logp, behaviour_logp, mask)
    ell_bt = jax.lax.stop_gradient(masked_log_ratio(logp, behaviour_logp, mask_bt))
    m2_n = jnp.where(mask_bt, ell_bt * ell_bt, jnp.inf).reshape(-1)
    num_valid = jnp.sum(mask_bt, dtype=jnp.int32)
    order = jnp.argsort(m2_n, stable=True)  # ascending; padded (+inf) entries last
    positions = jnp.arange(m2_n.shape[0])
    sorted_valid = positions < num_valid
    sorted_m2 = jnp.where(sorted_valid, m2_n[order], 0.0)
    kept_sum = jnp.cumsum(sorted_m2)  # sum of the (k+1) smallest values
    kept_count = (positions + 1).astype(jnp.float32)
    feasible = sorted_valid & (kept_sum < tau_m2 * kept_count)
    # The kept set is a prefix; a cumulative AND guards against rounding breaking it.
    feasible = jnp.cumsum(~feasible) == 0
    num_kept = jnp.sum(feasible, dtype=jnp.int32)
    keep_sorted = positions < num_kept
    keep_n = jnp.zeros_like(keep_sorted).at[order].set(keep_sorted)
    keep_bt = keep_n.reshape(mask_bt.shape) & mask_bt
    valid_f = num_valid.astype(jnp.float32)
    total = jnp.sum(sorted_m2)
    kept_total = jnp.sum(jnp.where(keep_sorted, sorted_m2, 0.0))
    kept_f = num_kept.astype(jnp.float32)
    return M2POMask(
        mask=keep_bt,
        m2_before=jnp.where(valid_f > 0, total / jnp.maximum(valid_f, 1.0), 0.0),
        m2_after=jnp.where(kept_f > 0, kept_total / jnp.maximum(kept_f, 1.0), 0.0),
        masked_fraction=jnp.where(valid_f > 0, (valid_f - kept_f) / jnp.maximum(valid_f, 1.0), 0.0),
    )


def m2po_harmful_clip(
    logp: jax.Array,
    behaviour_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    tau_m2: float = 0.04,
    min_eps_low: float | None = None,
    min_eps_high: float | None = None,
) -> M2POHarmfulClip:
    r"""The harmful-token M2 budget of M2PO's official code (arXiv 2510.01161;
    Infini-AI-Lab/M2PO ``kpo_clip_harmful_tokens``), as PPO clip ranges and the equivalent
    keep-mask.

    Only *harmful* tokens enter: those whose ratio moves in the direction the advantage rewards,
    :math:`(A > 0 \wedge r > 1)` or :math:`(A < 0 \wedge r < 1)`. With :math:`v_i = (\log r_i)^2`
    over the :math:`n` harmful tokens, sorted ascending, if :math:`\bar v > \tau_{M_2}` the code
    picks the first index :math:`k` with :math:`(n-k-1)\,v_k + \sum_{j\le k} v_j \ge n\,\tau_{M_2}`
    and sets :math:`\tau^2 = v_{k-1}` (0 when :math:`k = 0`): the largest breakpoint at which
    capping :math:`|\log r|` keeps the harmful second moment under budget. The cap maps to ratio
    bounds :math:`[e^{-\tau}, e^{\tau}]`, i.e. :math:`\epsilon_{\mathrm{low}} = 1 - e^{-\tau}`,
    :math:`\epsilon_{\mathrm{high}} = e^{\tau} - 1`, each raised to its optional minimum (the code's
    ``miniclip_low``/``miniclip_high``). Under a PPO clip with these ranges a harmful token beyond
    the cap gets zero gradient, so ``mask`` marks exactly the tokens whose gradient survives.

    Within budget (or with no harmful token) the bounds are unconstraining, :math:`\tau = 20`
    (`MAX_LOG_RATIO`). The code's 1e-12 tolerances are dropped; its scripts' `tau_m2` is 0.04.
    Returns an `M2POHarmfulClip`, without gradient.
    """
    check_nonnegative("tau_m2", tau_m2)
    check_nonnegative("min_eps_low", min_eps_low)  # None (no minimum) passes, as arrays do.
    check_nonnegative("min_eps_high", min_eps_high)
    logp, behaviour_logp, mask_bt = check_tokens(logp, behaviour_logp, mask)
    adv_bt = jax.lax.stop_gradient(broadcast_per_token(advantages, mask_bt.shape, "advantages"))
    ell_bt = jax.lax.stop_gradient(masked_log_ratio(logp, behaviour_logp, mask_bt))
    harmful_bt = mask_bt & (((adv_bt > 0) & (ell_bt > 0)) | ((adv_bt < 0) & (ell_bt < 0)))
    v_n = jnp.where(harmful_bt, ell_bt * ell_bt, jnp.inf).reshape(-1)
    num_harmful = jnp.sum(harmful_bt, dtype=jnp.int32)
    n_f = num_harmful.astype(jnp.float32)
    positions = jnp.arange(v_n.shape[0])
    valid = positions < num_harmful
    sorted_v = jnp.where(valid, jnp.sort(v_n), 0.0)
    csum = jnp.cumsum(sorted_v)
    total = jnp.sum(sorted_v)
    m2_before = jnp.where(n_f > 0, total / jnp.maximum(n_f, 1.0), 0.0)
    need_clip = (n_f > 0) & (m2_before > tau_m2)
    capped_at_k = sorted_v * (n_f - positions.astype(jnp.float32) - 1.0) + csum
    reach = valid & (capped_at_k >= tau_m2 * n_f)
    k = jnp.argmax(reach)  # first index reaching the budget (exists when need_clip)
    prev = jnp.maximum(k - 1, 0)
    tau_sq = jnp.where(k > 0, sorted_v[prev], 0.0)
    capped_sum = sorted_v[prev] * (n_f - k.astype(jnp.float32)) + csum[prev]
    m2_capped = jnp.where(k > 0, capped_sum / jnp.maximum(n_f, 1.0), 0.0)
    tau = jnp.where(need_clip, jnp.minimum(jnp.sqrt(tau_sq), MAX_LOG_RATIO), MAX_LOG_RATIO)
    m2_after = jnp.where(need_clip, m2_capped, m2_before)
    eps_low = 1.0 - jnp.exp(-tau)
    eps_high = jnp.expm1(tau)
    if min_eps_low is not None:
        eps_low = jnp.maximum(eps_low, min_eps_low)
    if min_eps_high is not None:
        eps_high = jnp.maximum(eps_high, min_eps_high)
    ratio_bt = clamped_exp(ell_bt)
    clipped_bt = mask_bt & (
        ((adv_bt > 0) & (ratio_bt > 1.0 + eps_high)) | ((adv_bt < 0) & (ratio_bt < 1.0 - eps_low))
    )
    return M2POHarmfulClip(
        mask=mask_bt & ~clipped_bt,
        eps_low=eps_low,
        eps_high=eps_high,
        m2_before=m2_before,
        m2_after=m2_after,
        masked_fraction=masked_mean(clipped_bt.astype(jnp.float32), mask_bt),
    )
