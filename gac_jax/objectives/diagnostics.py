"""Off-policy diagnostics: effective sample size, ratio statistics, clip and mask
fractions, the second moment of the log-ratio, and KL(behaviour || current).

All return float32 scalars (or dicts of them) without gradient, finite for log-probabilities
of any magnitude, over valid tokens only; with no valid token, ratio statistics are 1 and
the others 0. Arrays as in `gac_jax.objectives.losses`.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from gac_jax.numerics import effective_sample_size
from gac_jax.objectives._common import (
    as_mask,
    broadcast_per_token,
    check_nonnegative,
    check_tokens,
    clamped_exp,
    clip_fraction_stats,
    is_python_number,
    masked_log_ratio,
    masked_mean,
    ppo_clip_flags,
    sequence_valid,
)
from gac_jax.objectives.kl import kl_estimate

DEFAULT_QUANTILES = (0.5, 0.9, 0.99)

_sg = jax.lax.stop_gradient


def _inputs(logp, behaviour_logp, mask):
    logp_bt, behaviour_bt, mask_bt = check_tokens(logp, behaviour_logp, mask)
    ell_bt = _sg(masked_log_ratio(logp_bt, behaviour_bt, mask_bt))
    return ell_bt, mask_bt


def sequence_ess(
    logp: jax.Array, behaviour_logp: jax.Array, mask: jax.Array
) -> dict[str, jax.Array]:
    r"""Kish's ESS of the sequence importance weights, computed in log space.

    .. math::

        w_b = \prod_t \frac{\pi_\theta(y_{bt})}{\mu(y_{bt})}, \qquad
        \mathrm{ESS} = \frac{(\sum_b w_b)^2}{\sum_b w_b^2}, \qquad
        \rho = \mathrm{ESS}/n

    over the :math:`n` sequences with at least one valid token (VCPO, arXiv 2602.17616,
    uses :math:`\rho` to detect collapse and to scale the step). Returns ``{"ess",
    "ess_ratio"}``.
    """
    ell_bt, mask_bt = _inputs(logp, behaviour_logp, mask)
    result = effective_sample_size(jnp.sum(ell_bt, axis=-1), where=sequence_valid(mask_bt))
    return {"ess": result.ess, "ess_ratio": result.ess_ratio}


def ratio_statistics(
    logp: jax.Array,
    behaviour_logp: jax.Array,
    mask: jax.Array,
    *,
    quantiles: Sequence[float] = DEFAULT_QUANTILES,
) -> dict[str, jax.Array]:
    r"""Mean, min, max and quantiles of the token ratio :math:`r = \pi_\theta/\mu` over
    valid tokens, plus the largest :math:`|\log r|`.

    Ratios saturate at :math:`e^{\pm 20}` (the clamp); ``log_ratio_abs_max`` is exact.
    Heavy upper quantiles are the symptom VCPO (arXiv 2602.17616) and M2PO
    (arXiv 2510.01161) describe for stale rollouts. `quantiles` are levels in [0, 1],
    linearly interpolated (NumPy's default).

    Returns:
      A dict with ``ratio_mean``, ``ratio_min``, ``ratio_max``, ``ratio_q{100 q}`` (e.g.
      ``ratio_q99``) and ``log_ratio_abs_max``.
    """
    for q in quantiles:
        if not is_python_number(q) or not 0.0 <= q <= 1.0:
            raise ValueError(f"Quantiles must be numbers in [0, 1], got {q!r}.")
    ell_bt, mask_bt = _inputs(logp, behaviour_logp, mask)
    ratio_bt = clamped_exp(ell_bt)
    any_valid = jnp.any(mask_bt)
    stats = {
        "ratio_mean": masked_mean(ratio_bt, mask_bt, fallback=1.0),
        "ratio_min": jnp.where(any_valid, jnp.min(jnp.where(mask_bt, ratio_bt, jnp.inf)), 1.0),
        "ratio_max": jnp.where(any_valid, jnp.max(jnp.where(mask_bt, ratio_bt, -jnp.inf)), 1.0),
        "log_ratio_abs_max": jnp.max(jnp.abs(ell_bt)),
    }
    if quantiles:
        values = jnp.where(mask_bt, ratio_bt, jnp.nan).reshape(-1)
        qs = jnp.nanquantile(values, jnp.asarray(quantiles, jnp.float32))
        for q, value in zip(quantiles, qs, strict=True):
            stats[f"ratio_q{100 * q:g}"] = jnp.where(any_valid, value, 1.0)
    return stats


def second_moment(logp: jax.Array, behaviour_logp: jax.Array, mask: jax.Array) -> jax.Array:
    r"""Second moment of the token log-ratio, M2PO's trust-region statistic
    (arXiv 2510.01161, Eq. 5): :math:`\hat M_2 = \frac1N \sum_i (\log r_i)^2` over the N
    valid tokens (0 if there are none)."""
    ell_bt, mask_bt = _inputs(logp, behaviour_logp, mask)
    return masked_mean(ell_bt * ell_bt, mask_bt)


def kl_behaviour_current(
    logp: jax.Array, behaviour_logp: jax.Array, mask: jax.Array
) -> dict[str, jax.Array]:
    r""":math:`\mathrm{KL}(\mu \,\|\, \pi_\theta)` estimated from the behaviour samples.

    With :math:`\ell = \log\pi_\theta - \log\mu` per valid token: ``kl_k1`` is the mean of
    :math:`-\ell` (verl's ``ppo_kl``) and ``kl_k3`` the mean of :math:`e^{\ell} - 1 - \ell`
    (Schulman's non-negative estimator, http://joschu.net/blog/kl-approx.html). Returns
    ``{"kl_k1", "kl_k3"}``.
    """
    ell_bt, mask_bt = _inputs(logp, behaviour_logp, mask)
    k3_bt = kl_estimate(jnp.zeros_like(ell_bt), ell_bt, estimator="k3")
    return {"kl_k1": masked_mean(-ell_bt, mask_bt), "kl_k3": masked_mean(k3_bt, mask_bt)}


def clip_fractions(
    logp: jax.Array,
    behaviour_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
) -> dict[str, jax.Array]:
    r"""Fractions of valid tokens a PPO clip silences (zero gradient):

    - ``clip_fraction_high``: :math:`A > 0,\ r > 1 + \epsilon_{high}`;
    - ``clip_fraction_low``: :math:`A < 0,\ r < 1 - \epsilon_{low}`;
    - ``dual_clip_fraction``: :math:`A < 0,\ r > c` (dual clip, arXiv 1912.09729);
    - ``clip_fraction``: low + high.

    The same numbers `ppo_clip_loss` reports (same arguments), without the loss.
    """
    check_nonnegative("eps_low", eps_low)
    check_nonnegative("eps_high", eps_high)
    ell_bt, mask_bt = _inputs(logp, behaviour_logp, mask)
    adv_bt = _sg(broadcast_per_token(advantages, mask_bt.shape, "advantages"))
    flags = ppo_clip_flags(clamped_exp(ell_bt), adv_bt, 1.0 - eps_low, 1.0 + eps_high, dual_clip)
    return clip_fraction_stats(*(mask_bt & f for f in flags), mask_bt)


def mask_fraction(mask: jax.Array, kept_mask: jax.Array) -> jax.Array:
    r"""Share of valid tokens that a correction dropped:
    :math:`\sum (m \wedge \neg k) / \sum m` (0 when nothing is valid), e.g. the keep-mask
    of MIS, IcePop (arXiv 2510.18855) or M2PO (arXiv 2510.01161)."""
    mask_bt = as_mask(mask, jnp.shape(mask))
    kept_bt = as_mask(kept_mask, mask_bt.shape)
    return masked_mean((mask_bt & ~kept_bt).astype(jnp.float32), mask_bt)


def off_policy_diagnostics(
    logp: jax.Array,
    behaviour_logp: jax.Array,
    mask: jax.Array,
    *,
    quantiles: Sequence[float] = DEFAULT_QUANTILES,
) -> dict[str, jax.Array]:
    """Everything a step should log about how off-policy its batch is, in one dict:
    `sequence_ess` (VCPO, arXiv 2602.17616), `ratio_statistics`, ``m2`` (`second_moment`,
    M2PO, arXiv 2510.01161), `kl_behaviour_current` and ``num_valid_tokens``."""
    logp_bt, behaviour_bt, mask_bt = check_tokens(logp, behaviour_logp, mask)
    out = dict(sequence_ess(logp_bt, behaviour_bt, mask_bt))
    out.update(ratio_statistics(logp_bt, behaviour_bt, mask_bt, quantiles=quantiles))
    out["m2"] = second_moment(logp_bt, behaviour_bt, mask_bt)
    out.update(kl_behaviour_current(logp_bt, behaviour_bt, mask_bt))
    out["num_valid_tokens"] = jnp.sum(mask_bt, dtype=jnp.float32)
    return out
