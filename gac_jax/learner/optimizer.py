"""The learner's optax chain: clip -> GAC (or its monitor) -> AdamW -> ESS step scaling."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import optax

from gac_jax.transforms import (
    gradient_alignment_control,
    gradient_alignment_monitor,
    scale_by_ess,
)


def make_optimizer(
    *,
    learning_rate: float,
    weight_decay: float = 0.0,
    b1: float = 0.9,
    b2: float = 0.999,
    clip_norm: float | None = 1.0,
    gac: Mapping[str, Any] | None = None,
    ess: Mapping[str, Any] | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Builds the chain every run uses, so every run reports the same statistics.

    Args:
      learning_rate, weight_decay, b1, b2: AdamW's.
      clip_norm: global-norm clip before anything else; None disables it.
      gac: keyword arguments of `gradient_alignment_control`, or None for the monitor only
        (the cosine is recorded either way).
      ess: keyword arguments of `scale_by_ess`, or None to leave the step unscaled. The
        update then needs the extra arg `log_importance_weights`.
    """
    parts = []
    if clip_norm is not None:
        parts.append(optax.clip_by_global_norm(clip_norm))
    parts.append(
        gradient_alignment_control(**gac) if gac is not None else gradient_alignment_monitor()
    )
    parts.append(optax.adamw(learning_rate, b1=b1, b2=b2, weight_decay=weight_decay))
    if ess is not None:
        parts.append(scale_by_ess(**ess))
    return optax.chain(*parts)
