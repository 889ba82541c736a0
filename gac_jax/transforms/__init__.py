"""Stateful optax transformations for asynchronous RL: GAC and VCPO's ESS step scaling
(jax and optax only, so any optax training loop can use them)."""

from gac_jax.transforms.alignment import (
    REGIME_NAMES,
    REGIME_NONFINITE,
    REGIME_PASS,
    REGIME_PROJECT,
    REGIME_SKIP,
    GradientAlignmentControlState,
    gradient_alignment_control,
    gradient_alignment_monitor,
    set_gac_reference,
)
from gac_jax.transforms.controlled import (
    AlignmentControlledState,
    GACConfig,
    RandomSkipState,
    alignment_controlled,
    alignment_statistics,
    random_skip,
)
from gac_jax.transforms.ess_scaling import ESSConfig, ScaleByEssState, ess_step_scale, scale_by_ess

__all__ = ["REGIME_NAMES", "REGIME_NONFINITE", "REGIME_PASS", "REGIME_PROJECT", "REGIME_SKIP",
           "AlignmentControlledState", "ESSConfig", "GACConfig", "GradientAlignmentControlState",
           "RandomSkipState", "ScaleByEssState", "alignment_controlled", "alignment_statistics",
           "ess_step_scale", "gradient_alignment_control", "gradient_alignment_monitor",
           "random_skip", "scale_by_ess", "set_gac_reference"]  # fmt: skip
