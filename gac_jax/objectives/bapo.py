r"""BAPO: PPO clip with bounds searched per batch (Xi et al., arXiv 2510.18927).

The search reads the whole batch, so a learner that splits the batch into micro-batches
runs `bapo_clip_bounds` once on the whole batch and passes the result to every
micro-batch's `bapo_loss` as ``bounds``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from gac_jax.objectives._common import (
    check_choice,
    check_nonnegative,
    check_positive,
    clamped_exp,
    is_python_number,
)
from gac_jax.objectives._loss_terms import _check_clip, _ppo_terms, _prepare, _ratio_aux, _sg
from gac_jax.objectives.aggregation import aggregate, check_aggregation

BAPO_CONTRIBUTIONS = ("unclipped", "clamped")


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


def _check_bapo(contribution, **search):
    """Checks `contribution` and the search's hyperparameters (`bapo_clip_bounds`'s)."""
    check_choice("contribution", contribution, BAPO_CONTRIBUTIONS)
    for name, value in search.items():
        if not is_python_number(value):
            raise ValueError(
                f"BAPO's `{name}` must be a Python number, got {type(value).__name__}."
            )
    share = search["target_positive_share"]
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"`target_positive_share` must be in [0, 1], got {share}.")
    check_positive("low_step", search["low_step"])
    check_positive("high_step", search["high_step"])
    check_nonnegative("low_start", search["low_start"])
    for side in ("low", "high"):
        start, limit = search[f"{side}_start"], search[f"{side}_max"]
        if start > limit:
            raise ValueError(f"`{side}_start` ({start}) must not exceed `{side}_max` ({limit}).")


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
    README gives for the paper; step 0.05 as in the recipe's config. The search is a
    `jax.lax.while_loop` over integer step counts (hyperparameters: Python numbers); the
    bounds carry no gradient.

    Args:
      target_positive_share: :math:`\rho_0 \in [0, 1]`.
      low_start, low_max, low_step: :math:`a^-, b^-, \delta^-` of the lower ratio bound.
      high_start, high_max, high_step: :math:`a^+, b^+, \delta^+` of the upper ratio bound.
      contribution: ``"unclipped"`` or ``"clamped"``.
    """
    _check_bapo(
        contribution,
        target_positive_share=target_positive_share,
        low_start=low_start,
        low_max=low_max,
        low_step=low_step,
        high_start=high_start,
        high_max=high_max,
        high_step=high_step,
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
    dual_clip: float | None = 3.0,
    aggregation: str = "token-mean",
    bounds: BAPOBounds | None = None,
    **search: float | str,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    r"""BAPO: PPO clip with bounds searched per batch (Xi et al., arXiv 2510.18927).

    .. math::

        \ell_{bt} = \max\!\big(-A r,\; -A\,\operatorname{clip}(r, c_{low}, c_{high})\big)

    with :math:`[c_{low}, c_{high}]` from `bapo_clip_bounds` and the dual clip
    :math:`c = 3` of the official recipe (None disables it).

    Args:
      bounds: the bounds `bapo_clip_bounds` chose on the whole batch, when this call sees
        only part of it (a micro-batch); None searches on this call's inputs.
      **search: `bapo_clip_bounds`'s keyword arguments; any other is a TypeError.

    Returns:
      ``(loss, aux)``: the diagnostics of `ppo_clip_loss` plus ``clip_low``,
      ``clip_high``, ``positive_share`` and ``search_steps`` (the bounds it chose).
    """
    _check_clip(0.0, 0.0, dual_clip)
    check_aggregation(aggregation)
    if bounds is None:
        bounds = bapo_clip_bounds(logp, behaviour_logp, advantages, mask, **search)
    _, mask_bt, adv_bt, ell_bt = _prepare(logp, behaviour_logp, advantages, mask)
    ratio_bt = clamped_exp(ell_bt)
    low, high = bounds.clip_low, bounds.clip_high
    loss_bt, aux = _ppo_terms(ratio_bt, adv_bt, mask_bt, low, high, dual_clip)
    aux.update(_ratio_aux(_sg(ratio_bt), ell_bt, mask_bt))
    aux.update(
        clip_low=bounds.clip_low,
        clip_high=bounds.clip_high,
        positive_share=bounds.positive_share,
        search_steps=bounds.num_steps.astype(jnp.float32),
    )
    return aggregate(loss_bt, mask_bt, aggregation), aux


def bapo_batch_statistics(
    logp, behaviour_logp, advantages, mask, *, dual_clip=3.0, aggregation="token-mean", **search
) -> dict[str, BAPOBounds]:
    """The whole batch's `bapo_clip_bounds` (arXiv 2510.18927, Algorithm 1), as the
    ``bounds`` argument of `bapo_loss` (takes `bapo_loss`'s keyword arguments; those not of
    the search are ignored)."""
    del dual_clip, aggregation
    return {"bounds": bapo_clip_bounds(logp, behaviour_logp, advantages, mask, **search)}
