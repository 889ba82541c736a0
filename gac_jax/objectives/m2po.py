r"""M2PO: a second-moment trust region instead of ratio clipping (arXiv 2510.01161).

Its mask (or, for the official code's variant, its clip ranges) is a statistic of the
whole batch: a learner that splits the batch into micro-batches computes it once with
`m2po_batch_statistics` and passes it to every micro-batch's `m2po_loss`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gac_jax.objectives._common import check_choice, clamped_exp
from gac_jax.objectives._loss_terms import _prepare, _ratio_aux, _sg
from gac_jax.objectives.aggregation import aggregate, check_aggregation
from gac_jax.objectives.importance import M2POHarmfulClip, M2POMask, m2po_harmful_clip, m2po_mask
from gac_jax.objectives.losses import ppo_clip_loss

M2PO_VARIANTS = ("mask", "harmful_budget")


def m2po_loss(
    logp: jax.Array,
    behaviour_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    variant: str = "mask",
    aggregation: str = "token-mean",
    statistics: M2POMask | M2POHarmfulClip | None = None,
    **knobs: float | None,
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
      statistics: the whole batch's `m2po_batch_statistics`, when this call sees only part
        of the batch (a micro-batch); None computes them from this call's inputs.
      **knobs: ``tau_m2`` :math:`\ge 0` (0.04 in the paper), and for ``harmful_budget``
        `m2po_harmful_clip`'s ``min_eps_low``, ``min_eps_high``; any other is a TypeError.

    Returns:
      ``(loss, aux)`` with ``m2_before``, ``m2_after``, ``masked_fraction``, ``ratio_mean``,
      ``approx_kl``, and for ``harmful_budget`` the clip diagnostics and chosen
      ``eps_low``/``eps_high``.
    """
    check_choice("variant", variant, M2PO_VARIANTS)
    check_aggregation(aggregation)
    if statistics is None:
        statistics = m2po_batch_statistics(
            logp, behaviour_logp, advantages, mask, variant=variant, **knobs
        )["statistics"]
    if variant == "harmful_budget":
        clip = statistics
        eps = dict(eps_low=clip.eps_low, eps_high=clip.eps_high)
        loss, aux = ppo_clip_loss(
            logp, behaviour_logp, advantages, mask, **eps, aggregation=aggregation
        )
        aux.update(_statistics_aux(clip), **eps)
        return loss, aux
    _, mask_bt, adv_bt, ell_bt = _prepare(logp, behaviour_logp, advantages, mask)
    ratio_bt = clamped_exp(ell_bt)
    loss_bt = jnp.where(statistics.mask, -adv_bt * ratio_bt, 0.0)
    aux = _statistics_aux(statistics)
    aux.update(_ratio_aux(_sg(ratio_bt), ell_bt, mask_bt))
    return aggregate(loss_bt, mask_bt, aggregation), aux


def _statistics_aux(statistics: M2POMask | M2POHarmfulClip) -> dict[str, jax.Array]:
    names = ("m2_before", "m2_after", "masked_fraction")
    return {name: getattr(statistics, name) for name in names}


def m2po_batch_statistics(
    logp, behaviour_logp, advantages, mask, *, variant="mask", aggregation="token-mean", **clip
) -> dict[str, M2POMask | M2POHarmfulClip]:
    """The whole batch's M2PO statistic (arXiv 2510.01161, Sec. 4), as the ``statistics``
    argument of `m2po_loss`: its second-moment mask (`m2po_mask`), or for ``harmful_budget``
    its clip ranges (`m2po_harmful_clip`). Takes `m2po_loss`'s keyword arguments, as the
    learner passes them (`aggregation` unused); any other is a TypeError."""
    del aggregation
    check_choice("variant", variant, M2PO_VARIANTS)
    if variant == "harmful_budget":
        return {"statistics": m2po_harmful_clip(logp, behaviour_logp, advantages, mask, **clip)}
    # The clip ranges' minima are the harmful budget's only; any other argument is an error.
    mask_args = {k: v for k, v in clip.items() if k not in ("min_eps_low", "min_eps_high")}
    return {"statistics": m2po_mask(logp, behaviour_logp, mask, **mask_args)}
