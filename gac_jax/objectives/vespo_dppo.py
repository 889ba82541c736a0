"""VESPO and DPPO, 2026 loss-side cures for stale rollouts, as their authors' code computes
them (tests/objectives/test_authors_losses.py runs that code). VESPO reshapes each
sequence's importance weight with a kernel; DPPO replaces PPO's ratio clip with a trust
region on the divergence between the policies at the sampled token.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from gac_jax.objectives._common import (
    MAX_LOG_RATIO,
    as_float,
    check_nonnegative,
    check_positive,
    masked_mean,
    sequence_valid,
)
from gac_jax.objectives._loss_terms import (
    _check_clip,
    _prepare,
    _sg,
    _trust_region_pg,
    _weighted_pg,
)


def vespo_weights(
    log_weights: jax.Array,
    advantages: jax.Array,
    *,
    k_pos: float = 2.0,
    lambda_pos: float = 3.0,
    k_neg: float = 3.0,
    lambda_neg: float = 2.0,
) -> jax.Array:
    r"""VESPO's kernel on sequence importance weights (arXiv 2602.10693; the authors'
    ``compute_policy_loss_vespo``, https://github.com/FloyedShen/VESPO,
    ``recipe/vespo/code/core_algos.py``):

    .. math::

        \phi(w) = e^{\lambda}\, w^{k} e^{-\lambda w} \quad (\phi(1) = 1),

    with :math:`(k, \lambda)` = (`k_pos`, `lambda_pos`) where the advantage ([B] or [B, T])
    is :math:`\ge 0`, else (`k_neg`, `lambda_neg`), all :math:`\ge 0`. It peaks at
    :math:`w = k/\lambda` and vanishes for :math:`w \to 0` and :math:`w \to \infty`. As the
    authors compute it: :math:`\log w \ge \log 10^{-8}`, :math:`\lambda \ge 10^{-4}`,
    non-finite values 0. Defaults are the authors' code and run scripts (their docstring's
    1.5 / 4 / 2.5 are not what the code uses). `log_weights` are [B], :math:`\log w_b`;
    the result has the shape of `advantages`.
    """
    shape = dict(k_pos=k_pos, lambda_pos=lambda_pos, k_neg=k_neg, lambda_neg=lambda_neg)
    for name, value in shape.items():
        check_nonnegative(name, value)
    adv, log_w = as_float(advantages), as_float(log_weights)
    log_w = log_w.reshape(log_w.shape + (1,) * (adv.ndim - 1))
    k = jnp.where(adv >= 0, k_pos, k_neg)
    lam = jnp.maximum(jnp.where(adv >= 0, lambda_pos, lambda_neg), 1e-4)
    phi = jnp.exp(lam + k * jnp.maximum(log_w, math.log(1e-8)) - lam * jnp.exp(log_w))
    return jnp.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0)


def vespo_loss(
    logp: jax.Array,
    behaviour_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    aggregation: str = "token-mean",
    **kernel: float,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    r"""VESPO's policy gradient (arXiv 2602.10693, the authors' ``compute_policy_loss_vespo``):
    each sequence's importance weight, the true product over its tokens, reshaped by
    `vespo_weights`' kernel :math:`\phi`:

    .. math::

        w_b = \prod_t \frac{\pi_\theta(y_{bt})}{\mu(y_{bt})}, \qquad
        \mathcal{L} = -\operatorname{agg}_{b,t}\; \operatorname{sg}[\phi(w_b)]\, A_{bt}
        \log\pi_\theta(y_{bt})

    Stale sequences far from the current policy fade out instead of being clipped. As the
    authors compute it: token log-ratios clamped to +-20, their sum (no length
    normalisation) clamped to +-20. The authors take the sign of a sequence's advantage
    at its first token; here each token's own sign picks the kernel (the same for
    per-sequence advantages). ``**kernel``: `vespo_weights`' keyword arguments.

    Returns:
      ``(loss, aux)`` with ``weight_mean`` (:math:`\phi` over valid tokens), ``ratio_mean``,
      ``approx_kl`` and ``log_weight_mean`` (the clamped :math:`\log w_b`, valid sequences).
    """
    logp_bt, mask_bt, adv_bt, ell_bt = _prepare(logp, behaviour_logp, advantages, mask, aggregation)
    clamp = MAX_LOG_RATIO
    seq_log_b = _sg(jnp.clip(jnp.sum(jnp.clip(ell_bt, -clamp, clamp), axis=-1), -clamp, clamp))
    phi_bt = vespo_weights(seq_log_b, adv_bt, **kernel)
    loss, aux = _weighted_pg(logp_bt, mask_bt, adv_bt, ell_bt, phi_bt, aggregation)
    aux["log_weight_mean"] = _sg(masked_mean(seq_log_b, sequence_valid(mask_bt)))
    return loss, aux


def _dppo_loss(logp, behaviour_logp, advantages, mask, divergence, eps, ratio_cap, aggregation):
    _check_clip(*eps)
    check_positive("ratio_cap", ratio_cap)
    logp_bt, mask_bt, adv_bt, ell_bt = _prepare(logp, behaviour_logp, advantages, mask, aggregation)
    # The sampled token's log-probs; above 0 (never valid) they count as 0.
    lp_bt, lp_old_bt = (
        jnp.minimum(jnp.where(mask_bt, x, 0.0), 0.0)
        for x in (_sg(logp_bt), as_float(behaviour_logp))
    )
    p_bt, p_old_bt = jnp.exp(lp_bt), jnp.exp(lp_old_bt)
    if divergence == "tv":
        up_bt, down_bt = p_bt - p_old_bt > eps[1], p_bt - p_old_bt < -eps[0]
    else:  # Binary KL(old || new) over {the sampled token, the rest}, as the authors write it,
        # with 1 - p as -expm1(log p): float32 cancels 1 - p near 1 (and XLA may fold the 1e-8).
        rest_bt, rest_old_bt = -jnp.expm1(lp_bt), -jnp.expm1(lp_old_bt)
        kl_bt = p_old_bt * (lp_old_bt - lp_bt) + rest_old_bt * (
            jnp.log(rest_old_bt + 1e-8) - jnp.log(rest_bt + 1e-8)
        )
        up_bt, down_bt = (kl_bt > eps[1]) & (p_bt > p_old_bt), (kl_bt > eps[0]) & (p_bt < p_old_bt)
    weight_bt = jnp.minimum(jnp.exp(jnp.minimum(ell_bt, MAX_LOG_RATIO)), ratio_cap)
    low_bt, high_bt = (adv_bt < 0) & down_bt, (adv_bt > 0) & up_bt
    return _trust_region_pg(
        logp_bt, mask_bt, adv_bt, ell_bt, weight_bt, low_bt, high_bt, aggregation
    )


def dppo_binary_tv_loss(
    logp: jax.Array,
    behaviour_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    eps_low: float = 0.15,
    eps_high: float = 0.15,
    ratio_cap: float = 10.0,
    aggregation: str = "token-mean",
) -> tuple[jax.Array, dict[str, jax.Array]]:
    r"""DPPO-Binary-TV (Qi et al., arXiv 2602.04879; the authors' ``dppo_binary_tv`` mode of
    ``compute_policy_loss_with_mask``, https://github.com/sail-sg/Stable-RL,
    ``verl/trainer/ppo/core_algos.py``): the importance-weighted policy gradient inside a
    trust region on the divergence :math:`D` between behaviour and current policy at the
    sampled token, reduced to the binary distribution {that token, the rest}:

    .. math::

        \mathcal{L} = -\operatorname{agg}_{b,t}\; \operatorname{sg}[\min(r, c)\,
        m_{bt}]\, A\, \log\pi_\theta, \qquad r = \pi_\theta/\mu, \qquad
        D_{TV} = |\pi_\theta(y) - \mu(y)|

    :math:`m_{bt} = 0` (no gradient) where :math:`A > 0` and the token's probability rose
    past the region (:math:`D > \epsilon_{high}`), or :math:`A < 0` and it fell past it
    (:math:`D > \epsilon_{low}`); :math:`c > 0` is `ratio_cap`. Unlike PPO's ratio clip, a
    rare token may move far in ratio and little in divergence. Defaults: the thresholds of
    the authors' verl example (``examples/dppo_trainer/run_qwen30b_dppo.sh``), the cap
    their function falls back to (that example sets 10000, no cap).

    Returns:
      ``(loss, aux)`` with ``clip_fraction``, ``clip_fraction_low``, ``clip_fraction_high``
      (the valid tokens dropped), ``weight_mean``, ``ratio_mean``, ``approx_kl``.
    """
    eps = (eps_low, eps_high)
    return _dppo_loss(logp, behaviour_logp, advantages, mask, "tv", eps, ratio_cap, aggregation)


def dppo_binary_kl_loss(
    logp: jax.Array,
    behaviour_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    eps_low: float = 0.05,
    eps_high: float = 0.05,
    ratio_cap: float = 10.0,
    aggregation: str = "token-mean",
) -> tuple[jax.Array, dict[str, jax.Array]]:
    r"""DPPO-Binary-KL (arXiv 2602.04879, the authors' ``dppo_binary_kl``):
    `dppo_binary_tv_loss` with the binary KL(behaviour || current)

    .. math::

        D_{KL} = \mu \log\frac{\mu}{\pi_\theta} + (1-\mu)\log\frac{1-\mu}{1-\pi_\theta}

    as the divergence, and its example's thresholds.
    """
    eps = (eps_low, eps_high)
    return _dppo_loss(logp, behaviour_logp, advantages, mask, "kl", eps, ratio_cap, aggregation)
