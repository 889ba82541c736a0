"""Private helpers shared by the objective modules: argument checks, masks, stable ratios."""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp

from gac_jax._validation import check_choice  # noqa: F401 - re-exported to the objectives
from gac_jax.numerics import masked_mean  # noqa: F401 - re-exported to the objectives

# Log-ratios are clamped to +-MAX_LOG_RATIO before `exp` wherever a ratio value is needed:
# exp(20) ~ 4.9e8 is far beyond any clip bound, and values and gradients stay finite for
# log-probabilities of any size (beyond the clamp the ratio is constant). verl clamps at +-20.
MAX_LOG_RATIO = 20.0


def is_python_number(value) -> bool:
    """True for Python (and NumPy scalar) numbers, False for arrays and tracers."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_nonnegative(name: str, value) -> None:
    """Raises ValueError if `value` is a Python number below zero; arrays pass unchecked."""
    if is_python_number(value) and not value >= 0:
        raise ValueError(f"`{name}` must be >= 0, got {value!r}.")


def check_positive(name: str, value) -> None:
    """Raises ValueError if `value` is a Python number that is not > 0."""
    if is_python_number(value) and not value > 0:
        raise ValueError(f"`{name}` must be > 0, got {value!r}.")


def as_float(x) -> jax.Array:
    """Casts to float32 (the dtype every objective computes in)."""
    return jnp.asarray(x, jnp.float32)


def as_mask(mask, shape: tuple[int, ...]) -> jax.Array:
    """A boolean mask of `shape`: nonzero entries of a float mask count as valid."""
    mask = jnp.asarray(mask)
    if mask.shape != tuple(shape):
        raise ValueError(f"`mask` has shape {mask.shape}, expected {tuple(shape)}.")
    return mask if mask.dtype == jnp.bool_ else mask != 0


def check_same_shape(**arrays) -> tuple[int, ...]:
    """Checks that every array has the shape of the first; returns that shape."""
    names = list(arrays)
    shape = jnp.shape(arrays[names[0]])
    for name in names[1:]:
        if jnp.shape(arrays[name]) != shape:
            raise ValueError(
                f"`{name}` has shape {jnp.shape(arrays[name])}, expected the shape of "
                f"`{names[0]}` {shape}."
            )
    return shape


def check_tokens(
    logp, behaviour_logp, mask, name: str = "behaviour_logp"
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Validates [B, T] token inputs; returns (logp, behaviour_logp, mask) as f32/f32/bool.
    `name` is the second array's in error messages."""
    shape = check_same_shape(**{"logp": logp, name: behaviour_logp})
    if len(shape) != 2:
        raise ValueError(f"`logp` must be [B, T], got shape {shape}.")
    return as_float(logp), as_float(behaviour_logp), as_mask(mask, shape)


def masked_log_ratio(logp_bt, behaviour_logp_bt, mask_bt) -> jax.Array:
    """`logp - behaviour_logp` where valid, exactly 0 (value and gradient) elsewhere."""
    # The difference is taken inside `where` on both operands, so garbage (inf, NaN) in
    # padded positions never reaches a value or a gradient.
    safe_logp = jnp.where(mask_bt, logp_bt, 0.0)
    safe_behaviour = jnp.where(mask_bt, behaviour_logp_bt, 0.0)
    return safe_logp - safe_behaviour


def clamped_exp(log_x: jax.Array) -> jax.Array:
    """exp(clip(log_x, -MAX_LOG_RATIO, MAX_LOG_RATIO)); see `MAX_LOG_RATIO`."""
    return jnp.exp(jnp.clip(log_x, -MAX_LOG_RATIO, MAX_LOG_RATIO))


def broadcast_per_token(values, shape: tuple[int, int], name: str) -> jax.Array:
    """Per-sequence [B] values broadcast explicitly to [B, T]; [B, T] values pass through."""
    values = as_float(values)
    if values.shape == tuple(shape):
        return values
    if values.shape == (shape[0],):
        return jnp.broadcast_to(values[:, None], shape)
    raise ValueError(
        f"`{name}` has shape {values.shape}, expected [B]={(shape[0],)} or [B, T]={shape}."
    )


def sequence_valid(mask_bt: jax.Array) -> jax.Array:
    """[B] bool: the sequence has at least one valid token."""
    return jnp.any(mask_bt, axis=-1)


def ppo_clip_flags(ratio_bt, adv_bt, lower, upper, dual_clip):
    """Masks of the tokens a PPO clip silences, ``(low, high, dual)``: A < 0 and r < lower,
    A > 0 and r > upper, A < 0 and r > dual_clip (None: no dual clip)."""
    high_bt = (adv_bt > 0) & (ratio_bt > upper)
    low_bt = (adv_bt < 0) & (ratio_bt < lower)
    dual_bt = (
        jnp.zeros_like(high_bt) if dual_clip is None else (adv_bt < 0) & (ratio_bt > dual_clip)
    )
    return low_bt, high_bt, dual_bt


def fraction(flags_bt, mask_bt) -> jax.Array:
    """The share of valid tokens flagged, without gradient."""
    return jax.lax.stop_gradient(masked_mean(flags_bt.astype(jnp.float32), mask_bt))


def clip_fraction_stats(low_bt, high_bt, dual_bt, mask_bt) -> dict[str, jax.Array]:
    """The shares of valid tokens each clip silenced (no gradient); no dual one for None."""
    stats = {
        "clip_fraction": fraction(low_bt | high_bt, mask_bt),
        "clip_fraction_low": fraction(low_bt, mask_bt),
        "clip_fraction_high": fraction(high_bt, mask_bt),
    }
    if dual_bt is not None:
        stats["dual_clip_fraction"] = fraction(dual_bt, mask_bt)
    return stats
