"""The learner's optax chain: clip -> GAC (or its monitor) -> AdamW -> ESS step scaling."""

from __future__ import annotations

import dataclasses

import optax

from gac_jax._validation import check_range
from gac_jax.transforms import ESSConfig, GACConfig, gradient_alignment_monitor


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW after optional global-norm clipping (GAC and ESS scaling have their own configs).

    Attributes:
      learning_rate: AdamW's step size, > 0.
      weight_decay: AdamW's decoupled weight decay, >= 0.
      b1, b2: AdamW's moment decays, in [0, 1).
      clip_norm: global-norm clip before anything else, > 0; None disables it.
    """

    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    clip_norm: float | None = 1.0

    def validate(self) -> None:
        """Raises ValueError naming a bad field."""
        check_range("learning_rate", self.learning_rate, 0.0, float("inf"), low_open=True)
        check_range("weight_decay", self.weight_decay, 0.0, float("inf"))
        check_range("b1", self.b1, 0.0, 1.0, high_open=True)
        check_range("b2", self.b2, 0.0, 1.0, high_open=True)
        if self.clip_norm is not None:
            check_range("clip_norm", self.clip_norm, 0.0, float("inf"), low_open=True)


def make_optimizer(
    config: OptimizerConfig | None = None,
    gac: GACConfig | None = None,
    ess: ESSConfig | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Builds the chain every run uses, so every run reports the same statistics.

    Args:
      config: AdamW and clipping (`OptimizerConfig()` by default).
      gac: Gradient Alignment Control, or None for its monitor only (the cosine is
        recorded either way).
      ess: VCPO's ESS step scaling, or None to leave the step unscaled. The update then
        needs the extra arg `log_importance_weights`.
    """
    config = OptimizerConfig() if config is None else config
    config.validate()
    parts = []
    if config.clip_norm is not None:
        parts.append(optax.clip_by_global_norm(config.clip_norm))
    parts.append(gac.build() if gac is not None else gradient_alignment_monitor())
    parts.append(
        optax.adamw(
            config.learning_rate, b1=config.b1, b2=config.b2, weight_decay=config.weight_decay
        )
    )
    if ess is not None:
        parts.append(ess.build())
    return optax.chain(*parts)
