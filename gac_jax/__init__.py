"""gac_jax: stable asynchronous reinforcement learning of language models in JAX.

The stabilizers are optax transformations that drop into any `optax.chain`::

    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        gac_jax.alignment_controlled(  # a skipped step keeps params and Adam's state
            optax.adamw(1e-6),
            gac_jax.gradient_alignment_control(tau_low=0.2, tau_high=0.8),
        ),
        gac_jax.scale_by_ess(rho_base=1.0),
    )
"""

from gac_jax import objectives, transforms
from gac_jax.numerics import effective_sample_size
from gac_jax.transforms import (
    AlignmentControlledState,
    GradientAlignmentControlState,
    ScaleByEssState,
    alignment_controlled,
    alignment_statistics,
    gradient_alignment_control,
    gradient_alignment_monitor,
    scale_by_ess,
)

__version__ = "0.1.0"

__all__ = ["AlignmentControlledState", "GradientAlignmentControlState", "ScaleByEssState",
           "alignment_controlled", "alignment_statistics", "effective_sample_size",
           "gradient_alignment_control", "gradient_alignment_monitor", "objectives", "scale_by_ess",
           "transforms"]  # fmt: skip
