"""The per-step arithmetic of gradient alignment control, on arrays of control units.

A control unit is the whole parameter tree (scope "global", U = 1) or one leaf (scope
"per_leaf", U = leaves); `gradient_alignment_control` strings these functions together.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from gac_jax.numerics import safe_divide


class Alignment(NamedTuple):
    """Inner products of a gradient with the reference, per control unit (tree or leaf)."""

    dot: jax.Array  # f32 [U]: <g, r>.
    grad_sq: jax.Array  # f32 [U]: |g|^2.
    ref_sq: jax.Array  # f32 [U]: |r|^2.


def leaf_products(g: jax.Array, r: jax.Array, cached_ref_sq: jax.Array | None):
    """`<g, r>`, `|g|^2` and `|r|^2` in float32; `|r|^2` is `cached_ref_sq` unless None."""
    g32 = g.astype(jnp.float32)
    r32 = r.astype(jnp.float32)
    ref_sq = jnp.sum(r32 * r32) if cached_ref_sq is None else cached_ref_sq
    return jnp.sum(g32 * r32), jnp.sum(g32 * g32), ref_sq


def reference_is_gradient_exactly(g: jax.Array, r: jax.Array) -> bool:
    """Whether storing `g` as `r` keeps its values (so `|r|^2` is this step's `|g|^2`)."""
    widened = r.dtype == jnp.float32 and jnp.finfo(g.dtype).bits < 32  # bf16/f16 -> f32.
    return r.dtype == g.dtype or widened


def safe_cosine(dot, grad_sq, ref_sq):
    """`dot / (sqrt(grad_sq) sqrt(ref_sq))` clipped to [-1, 1]; 0 where a norm is 0."""
    # sqrt before multiplying: |g|^2 |r|^2 overflows float32 long before |g| |r| does.
    return jnp.clip(safe_divide(dot, jnp.sqrt(grad_sq) * jnp.sqrt(ref_sq)), -1.0, 1.0)


def per_leaf_alignment(grads, refs, cached_ref_sq: jax.Array, cache_norms: bool) -> Alignment:
    """`<g, r>`, `|g|^2` and `|r|^2` of every leaf, stacked [leaves].

    With `cache_norms` (the "gradient" reference), a leaf's `|r|^2` is read from
    `cached_ref_sq` when the stored reference holds the gradient's values exactly.
    """
    products = []
    for i, (g, r) in enumerate(zip(grads, refs, strict=True)):
        cached = cache_norms and reference_is_gradient_exactly(g, r)
        products.append(leaf_products(g, r, cached_ref_sq[i] if cached else None))
    return Alignment(*(jnp.stack(column) for column in zip(*products, strict=True)))


class Control(NamedTuple):
    """How each control unit is changed: emitted = keep * g - alpha * r."""

    keep: jax.Array  # f32 [U]: 0 for a skipped unit, else 1.
    alpha: jax.Array  # f32 [U]: multiple of r removed; 0 unless projected.
    skip: jax.Array  # bool [U]: the unit is skipped.
    project: jax.Array  # bool [U]: the unit is projected.


def control_coefficients(
    unit: Alignment, low, high, finite, skip, projection, monitor_only
) -> Control:
    """The control coefficients per unit, for the thresholds `low < high` in force."""
    cosine = safe_cosine(unit.dot, unit.grad_sq, unit.ref_sq)
    target = jnp.maximum(low, 0.0)
    skip_unit = jnp.asarray(skip) & (cosine > high) & finite
    project_unit = (cosine > target) & ~skip_unit & finite
    if monitor_only:
        skip_unit = jnp.zeros_like(skip_unit)
        project_unit = jnp.zeros_like(project_unit)
    norm_ratio = safe_divide(jnp.sqrt(unit.grad_sq), jnp.sqrt(unit.ref_sq))
    if projection == "full":
        alpha = safe_divide(unit.dot, unit.ref_sq)
    else:
        sine = jnp.sqrt(jnp.maximum((1.0 - cosine) * (1.0 + cosine), 0.0))
        target_sine = jnp.sqrt(jnp.maximum(1.0 - target * target, 1e-12))
        alpha = norm_ratio * (cosine - target * sine / target_sine)
    alpha = jnp.where(project_unit, alpha, 0.0)
    keep = jnp.where(skip_unit, 0.0, 1.0)
    return Control(keep, alpha, skip_unit, project_unit)


def cosine_after_control(unit: Alignment, control: Control, total_ref_sq, finite) -> jax.Array:
    """cos(emitted update, r) over the whole tree (NaN for a non-finite gradient).

    Computed from the inner products, with no second pass over memory: the along-r and
    orthogonal parts are tracked separately to avoid cancellation.
    """
    keep, alpha = control.keep, control.alpha
    along = keep * safe_divide(unit.dot, jnp.sqrt(unit.ref_sq)) - alpha * jnp.sqrt(unit.ref_sq)
    orthogonal_sq = (
        keep * keep * jnp.maximum(unit.grad_sq - safe_divide(unit.dot * unit.dot, unit.ref_sq), 0.0)
    )
    after_dot = jnp.sum(along * jnp.sqrt(unit.ref_sq))
    after_sq = jnp.sum(along * along + orthogonal_sq)
    return jnp.where(finite, safe_cosine(after_dot, after_sq, total_ref_sq), jnp.nan)


def removed_fraction(unit: Alignment, control: Control, total_grad_sq, finite) -> jax.Array:
    """|g - emitted| / |g| over the whole tree (0 for a zero gradient, NaN if non-finite).

    From the inner products: per unit, |(1 - keep) g + alpha r|^2 =
    (1 - keep)^2 |g|^2 + 2 (1 - keep) alpha <g, r> + alpha^2 |r|^2.
    """
    drop = 1.0 - control.keep
    removed_sq = (
        drop * drop * unit.grad_sq
        + 2.0 * drop * control.alpha * unit.dot
        + control.alpha * control.alpha * unit.ref_sq
    )
    fraction = jnp.sqrt(safe_divide(jnp.maximum(jnp.sum(removed_sq), 0.0), total_grad_sq))
    return jnp.where(finite, jnp.minimum(fraction, 1.0), jnp.nan)


def per_leaf_control(control: Control, num_leaves: int, scope: str) -> Control:
    """`control` with one entry per leaf (a global control is broadcast to every leaf)."""
    if scope == "per_leaf":
        return control
    return Control(*(jnp.broadcast_to(x, (num_leaves,)) for x in control))


def emitted_and_next_references(grads, refs, control, finite, reference, ema_decay, unchanged):
    """The emitted update and the next reference, leaf by leaf (`control` is per leaf);
    `unchanged` (a monitor) emits the gradients themselves, reading no reference.

    A non-finite gradient keeps the previous reference; so does a skipped leaf under the
    "update" reference, since a zero update has no direction.
    """
    emitted, new_refs = [], []
    for i, (g, r) in enumerate(zip(grads, refs, strict=True)):
        keep, alpha = control.keep[i], control.alpha[i]
        out = g if unchanged else (keep * g.astype(jnp.float32) - alpha * r.astype(jnp.float32))
        out = out.astype(g.dtype)
        if reference == "gradient":
            new_r = g
        elif reference == "update":
            new_r = jnp.where(control.skip[i], r, out)
        else:
            new_r = ema_decay * r.astype(jnp.float32) + (1.0 - ema_decay) * g.astype(jnp.float32)
        new_r = jnp.where(finite, new_r, r).astype(r.dtype)
        emitted.append(out)
        new_refs.append(new_r)
    return emitted, new_refs
