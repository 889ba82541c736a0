"""Sample-based KL estimators (Schulman's k1, k2, k3) and the KL penalty term."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gac_jax.objectives._common import (
    MAX_LOG_RATIO,
    as_float,
    check_choice,
    check_nonnegative,
    check_same_shape,
    check_tokens,
    masked_log_ratio,
    masked_mean,
)
from gac_jax.objectives.aggregation import aggregate, check_aggregation

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(logp: jax.Array, reference_logp: jax.Array, *, estimator: str = "k3") -> jax.Array:
    r"""Per-sample estimate of :math:`\mathrm{KL}(\pi \,\|\, \pi_{\mathrm{ref}})` from
    samples of :math:`\pi`.

    With :math:`\delta = \log \pi_{\mathrm{ref}}(y) - \log \pi(y)` (J. Schulman,
    "Approximating KL divergence", 2020, http://joschu.net/blog/kl-approx.html):

    - ``k1`` :math:`= -\delta` (unbiased, high variance, can be negative),
    - ``k2`` :math:`= \tfrac12 \delta^2` (biased, low variance),
    - ``k3`` :math:`= e^{\delta} - 1 - \delta` (unbiased, always :math:`\ge 0`; the
      "low_var_kl" of verl and of GRPO, arXiv 2402.03300, Eq. 4).

    For ``k3``, :math:`e^{\delta}` is continued by its tangent line beyond
    :math:`|\delta| = 20` (`MAX_LOG_RATIO`), so log-probabilities of any size give a finite
    value and a finite gradient of the right sign; inside the band the formula is exact.
    `logp` and `reference_logp` have any one shape; the estimates (float32) have it too.
    """
    check_choice("estimator", estimator, KL_ESTIMATORS)
    check_same_shape(logp=logp, reference_logp=reference_logp)
    delta = as_float(reference_logp) - as_float(logp)
    if estimator == "k1":
        return -delta
    if estimator == "k2":
        return 0.5 * delta * delta
    clipped = jnp.clip(delta, -MAX_LOG_RATIO, MAX_LOG_RATIO)
    exp_delta = jnp.exp(clipped) * (1.0 + (delta - clipped))
    return exp_delta - 1.0 - delta


def kl_penalty(
    logp: jax.Array,
    reference_logp: jax.Array,
    mask: jax.Array,
    *,
    estimator: str = "k3",
    coef: float = 0.001,
    aggregation: str = "token-mean",
) -> tuple[jax.Array, dict[str, jax.Array]]:
    r"""KL penalty term :math:`\beta \cdot \mathrm{agg}_{t}\, \hat{k}(\pi, \pi_{\mathrm{ref}})_t`.

    Added to a policy loss, this is GRPO's KL regulariser (arXiv 2402.03300, Eq. 3, with
    ``k3``). The default :math:`\beta = 10^{-3}` is verl's ``kl_loss_coef`` default.

    `logp`, `reference_logp` and `mask` are [B, T]; `estimator` as `kl_estimate`'s,
    `aggregation` as `aggregate`'s.

    Returns:
      ``(loss, aux)``: the scaled penalty; ``aux["kl"]``, the unscaled token-mean KL.
    """
    check_nonnegative("coef", coef)
    check_aggregation(aggregation)
    logp, reference_bt, mask_bt = check_tokens(logp, reference_logp, mask, "reference_logp")
    # Padded positions get a zero log-ratio (zero KL, zero gradient) before the estimator.
    neg_delta = masked_log_ratio(logp, reference_bt, mask_bt)
    kl_bt = kl_estimate(neg_delta, jnp.zeros_like(neg_delta), estimator=estimator)
    loss = coef * aggregate(kl_bt, mask_bt, aggregation)
    aux = {"kl": jax.lax.stop_gradient(masked_mean(kl_bt, mask_bt))}
    return loss, aux
