"""Pure-array objectives for (asynchronous, off-policy) RL of language models: advantages,
importance weights and masks, policy losses, loss aggregation, KL terms and off-policy
diagnostics. Arrays in, arrays out: nothing here runs a model or reads a config. Shapes:
tokens [B, T] with an explicit [B, T] mask, sequences [B], group ids [B]. Policy losses
return ``(loss, aux)``; `registry` names them for configs.
"""

from gac_jax.objectives.advantages import (
    GRAD_NORM_PROXIES,
    dr_grpo_advantages,
    grad_sq_norm_proxy,
    grpo_advantages,
    rloo_advantages,
    vcpo_advantages,
)
from gac_jax.objectives.aggregation import AGGREGATIONS, aggregate, aggregation_size
from gac_jax.objectives.bapo import BAPOBounds, bapo_batch_statistics, bapo_clip_bounds, bapo_loss
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
    cispo_loss,
    decoupled_ppo_loss,
    gspo_loss,
    ppo_clip_loss,
    reinforce_loss,
    topr_loss,
)
from gac_jax.objectives.m2po import m2po_batch_statistics, m2po_loss
from gac_jax.objectives.naive import naive_pg_loss, naive_pg_trust_region_loss, ppo_recompute_loss
from gac_jax.objectives.registry import (
    ADVANTAGE_ESTIMATORS,
    ADVANTAGE_SPECS,
    IMPORTANCE_CORRECTIONS,
    POLICY_LOSS_SPECS,
    POLICY_LOSSES,
    AdvantageSpec,
    PolicyLossSpec,
    get_advantage_estimator,
    get_advantage_spec,
    get_importance_correction,
    get_policy_loss,
    get_policy_loss_spec,
)
from gac_jax.objectives.trajectory_balance import trajectory_balance_loss
from gac_jax.objectives.vespo_dppo import (
    dppo_binary_kl_loss,
    dppo_binary_tv_loss,
    vespo_loss,
    vespo_weights,
)

__all__ = ["ADVANTAGE_ESTIMATORS", "ADVANTAGE_SPECS", "AGGREGATIONS", "AdvantageSpec", "BAPOBounds",
           "GRAD_NORM_PROXIES", "IMPORTANCE_CORRECTIONS", "ImportanceWeights", "KL_ESTIMATORS",
           "M2POHarmfulClip", "M2POMask", "POLICY_LOSSES", "POLICY_LOSS_SPECS", "PolicyLossSpec",
           "aggregate", "aggregation_size", "bapo_batch_statistics", "bapo_clip_bounds",
           "bapo_loss", "cispo_loss", "clip_fractions", "decoupled_ppo_loss", "dppo_binary_kl_loss",
           "dppo_binary_tv_loss", "dr_grpo_advantages", "get_advantage_estimator",
           "get_advantage_spec", "get_importance_correction", "get_policy_loss",
           "get_policy_loss_spec", "grad_sq_norm_proxy", "grpo_advantages", "gspo_loss",
           "icepop_weights", "importance_ratio", "kl_behaviour_current", "kl_estimate",
           "kl_penalty", "m2po_batch_statistics", "m2po_harmful_clip", "m2po_loss", "m2po_mask",
           "mask_fraction", "masked_importance_weights", "naive_pg_loss",
           "naive_pg_trust_region_loss", "off_policy_diagnostics", "ppo_clip_loss",
           "ppo_recompute_loss", "ratio_statistics", "reinforce_loss", "rloo_advantages",
           "second_moment", "sequence_ess", "sequence_log_ratio", "token_log_ratio", "topr_loss",
           "trajectory_balance_loss", "truncated_importance_weights", "vcpo_advantages",
           "vespo_loss", "vespo_weights"]  # fmt: skip
