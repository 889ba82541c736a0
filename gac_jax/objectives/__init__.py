"""Pure-array objectives for (asynchronous, off-policy) RL of language models.

Advantages, importance weights and masks, policy losses, loss aggregation, KL terms and
off-policy diagnostics. Arrays in, arrays out: nothing here runs a model or reads a
config. Shapes: tokens [B, T] with an explicit [B, T] mask, sequences [B], group ids [B].
Policy losses return ``(loss, aux)``; `POLICY_LOSSES` and `ADVANTAGE_ESTIMATORS` are the
registries configs refer to by name.
"""

from gac_jax.objectives.advantages import (
    GRAD_NORM_PROXIES,
    dr_grpo_advantages,
    grad_sq_norm_proxy,
    grpo_advantages,
    rloo_advantages,
    vcpo_advantages,
)
from gac_jax.objectives.aggregation import AGGREGATIONS, aggregate
from gac_jax.objectives.diagnostics import (
    clip_fractions,
    kl_behaviour_current,
    mask_fraction,
    off_policy_diagnostics,
    ratio_statistics,
    second_moment,
    sequence_ess,
)
from gac_jax.objectives.importance import (
    ImportanceWeights,
    M2POHarmfulClip,
    M2POMask,
    icepop_weights,
    importance_ratio,
    m2po_harmful_clip,
    m2po_mask,
    masked_importance_weights,
    sequence_log_ratio,
    token_log_ratio,
    truncated_importance_weights,
)
from gac_jax.objectives.kl import KL_ESTIMATORS, kl_estimate, kl_penalty
from gac_jax.objectives.losses import (
    BAPOBounds,
    bapo_clip_bounds,
    bapo_loss,
    cispo_loss,
    decoupled_ppo_loss,
    gspo_loss,
    m2po_loss,
    ppo_clip_loss,
    reinforce_loss,
    topr_loss,
    trajectory_balance_loss,
)
from gac_jax.objectives.registry import (
    ADVANTAGE_ESTIMATORS,
    IMPORTANCE_CORRECTIONS,
    POLICY_LOSSES,
    get_advantage_estimator,
    get_importance_correction,
    get_policy_loss,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATIONS",
    "BAPOBounds",
    "GRAD_NORM_PROXIES",
    "IMPORTANCE_CORRECTIONS",
    "ImportanceWeights",
    "KL_ESTIMATORS",
    "M2POHarmfulClip",
    "M2POMask",
    "POLICY_LOSSES",
    "aggregate",
    "bapo_clip_bounds",
    "bapo_loss",
    "cispo_loss",
    "clip_fractions",
    "decoupled_ppo_loss",
    "dr_grpo_advantages",
    "get_advantage_estimator",
    "get_importance_correction",
    "get_policy_loss",
    "grad_sq_norm_proxy",
    "grpo_advantages",
    "gspo_loss",
    "icepop_weights",
    "importance_ratio",
    "kl_behaviour_current",
    "kl_estimate",
    "kl_penalty",
    "m2po_harmful_clip",
    "m2po_loss",
    "m2po_mask",
    "mask_fraction",
    "masked_importance_weights",
    "off_policy_diagnostics",
    "ppo_clip_loss",
    "ratio_statistics",
    "reinforce_loss",
    "rloo_advantages",
    "second_moment",
    "sequence_ess",
    "sequence_log_ratio",
    "token_log_ratio",
    "topr_loss",
    "trajectory_balance_loss",
    "truncated_importance_weights",
    "vcpo_advantages",
]
