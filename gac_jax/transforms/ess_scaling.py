r"""VCPO's effective-sample-size step scaling (arXiv 2602.17616) as an optax transformation.

Stale rollouts make the sequence-level importance weights heavy-tailed: the effective
sample size (ESS) collapses, and VCPO shrinks the step in proportion:

.. math::

    \rho = \frac{\mathrm{ESS}}{B} = \frac{(\sum_i w_i)^2}{B \sum_i w_i^2}, \qquad
    \eta_t = \eta_0 \, \min\!\Big(1, \frac{\rho}{\rho_{base}}\Big)^{p}

with `p = 1/2` for Adam-style optimisers (whose update size does not scale with the
gradient) and `p = 1` for SGD. Placed after the optimizer in a chain, scaling the update
is scaling the learning rate.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from optax import GradientTransformationExtraArgs

from gac_jax._configs import arguments
from gac_jax._validation import check_range, concrete_number
from gac_jax.numerics import effective_sample_size

POWERS = {"sqrt": 0.5, "linear": 1.0}


class ScaleByEssState(NamedTuple):
    """State of `scale_by_ess`."""

    ess_count: jax.Array  # int32 []: updates seen.
    ess_ratio: jax.Array  # f32 []: rho = ESS / B of the last step.
    ess_scale: jax.Array  # f32 []: min(1, rho / rho_base) ** p applied at the last step.
    ess_ratio_ema: jax.Array  # f32 []: EMA of rho over finite steps (first value unsmoothed).


def _resolve_power(power) -> float:
    if isinstance(power, str):
        if power not in POWERS:
            raise ValueError(f"power={power!r} is not one of {tuple(POWERS)} or a positive number.")
        return POWERS[power]
    check_range("power", power, 0.0, float("inf"), low_open=True)
    return power


def ess_step_scale(ess_ratio: jax.Array, rho_base, power) -> jax.Array:
    """`min(1, ess_ratio / rho_base) ** power`, VCPO's learning-rate multiplier."""
    ess_ratio = jnp.asarray(ess_ratio, jnp.float32)
    ratio = jnp.clip(ess_ratio / rho_base, 0.0, 1.0)
    # Compared, not divided: XLA may divide through a reciprocal, and x / x can land a ulp
    # below 1; at or above the base the step is exactly unscaled.
    return jnp.where(ess_ratio >= rho_base, 1.0, jnp.power(ratio, power))


def scale_by_ess(
    rho_base: float = 1.0,
    power: float | str = "sqrt",
    *,
    ema_decay: float = 0.9,
    truncation_cap: float | None = None,
) -> GradientTransformationExtraArgs:
    r"""Scales updates by `min(1, rho / rho_base) ** p` (VCPO, arXiv 2602.17616).

    The update takes, as keyword-only extra args, either `log_importance_weights` ([B]:
    per-sequence `sum_t (logp_theta - logp_behaviour)`, with an optional boolean `sequence_mask` [B]
    excluding padded sequences) or a precomputed scalar `ess_ratio`. Infinite log weights are taken
    at their limit (`effective_sample_size`). A NaN weight gives a NaN scale, so the update is NaN
    rather than silently rescaled (the learner's step then skips it); the EMA skips such steps.

    Args:
      rho_base: ESS ratio at and above which the step is not scaled, in (0, 1] (VCPO's
        released GSM8K and MATH runs: 1.0, always scaled; its multi-turn tool-use run 0.55).
      power: exponent `p`: "sqrt" (0.5, for Adam-style optimisers), "linear" (1.0, for
        SGD), or any positive number.
      ema_decay: decay of `ess_ratio_ema`, in [0, 1).
      truncation_cap: None (the raw weights, VCPO's released runs: ``use_clipped=False``)
        or c > 0: the ESS of the truncated weights ``min(w, c)`` that truncated IS trains
        with (their ``use_clipped=True`` switch). Applies to `log_importance_weights` only.

    Returns:
      A transformation with `ScaleByEssState`.
    """
    check_range("rho_base", rho_base, 0.0, 1.0, low_open=True)
    check_range("ema_decay", ema_decay, 0.0, 1.0, high_open=True)
    if truncation_cap is not None:
        check_range("truncation_cap", truncation_cap, 0.0, float("inf"), low_open=True)
    exponent = _resolve_power(power)

    def init_fn(params):
        del params
        return ScaleByEssState(
            ess_count=jnp.zeros([], jnp.int32),
            ess_ratio=jnp.ones([], jnp.float32),
            ess_scale=jnp.ones([], jnp.float32),
            ess_ratio_ema=jnp.ones([], jnp.float32),
        )

    def update_fn(
        updates,
        state,
        params=None,
        *,
        log_importance_weights=None,
        sequence_mask=None,
        ess_ratio=None,
        **extra_args,
    ):
        del params, extra_args
        if (log_importance_weights is None) == (ess_ratio is None):
            raise ValueError(
                "scale_by_ess needs exactly one of the extra args `log_importance_weights` "
                f"(got {'an array' if log_importance_weights is not None else 'None'}) and "
                f"`ess_ratio` (got {'a value' if ess_ratio is not None else 'None'})."
            )
        if ess_ratio is None:
            weights = jnp.asarray(log_importance_weights)
            if weights.ndim != 1:
                raise ValueError(
                    "log_importance_weights must be per-sequence, shape [B]; got shape "
                    f"{weights.shape}."
                )
            if truncation_cap is not None:
                weights = jnp.minimum(weights, jnp.log(truncation_cap))
            rho = effective_sample_size(weights, sequence_mask).ess_ratio
        else:
            number = concrete_number(ess_ratio)
            if number is not None and not 0.0 <= number <= 1.0:
                raise ValueError(f"ess_ratio={ess_ratio!r} is outside [0, 1].")
            rho = jnp.asarray(ess_ratio, jnp.float32)
        scale = ess_step_scale(rho, rho_base, exponent)
        finite = jnp.isfinite(rho)
        ema = jnp.where(
            state.ess_count == 0, rho, ema_decay * state.ess_ratio_ema + (1 - ema_decay) * rho
        )
        new_state = ScaleByEssState(
            ess_count=optax.safe_increment(state.ess_count),
            ess_ratio=rho,
            ess_scale=scale,
            ess_ratio_ema=jnp.where(finite, ema, state.ess_ratio_ema),
        )
        scaled = jax.tree.map(lambda u: (scale * u).astype(u.dtype), updates)
        return scaled, new_state

    return GradientTransformationExtraArgs(init_fn, update_fn)


@dataclasses.dataclass(frozen=True)
class ESSConfig:
    """`scale_by_ess`'s arguments, one to one; `build()` makes the transformation."""

    rho_base: float = 1.0
    power: float | str = "sqrt"
    ema_decay: float = 0.9
    truncation_cap: float | None = None

    def build(self) -> GradientTransformationExtraArgs:
        """`scale_by_ess` with these arguments (which it validates)."""
        return scale_by_ess(**arguments(self))

    def validate(self) -> None:
        """Raises ValueError naming a bad field: the factory's own checks."""
        self.build()
