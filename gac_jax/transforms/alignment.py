r"""Gradient Alignment Control (GAC), arXiv 2603.01501, as an optax transformation.

Xu et al. observe that consecutive policy gradients of asynchronous RL stay aligned (cosine
near 1), unlike synchronous training's near-orthogonal ones, and that this "stale-aligned"
drift precedes collapse. GAC measures

.. math::

    c_t = \cos(g_t, r_{t-1}) = \frac{\langle g_t, r_{t-1} \rangle}{\|g_t\| \, \|r_{t-1}\|}

over the whole flattened parameter tree (or per leaf), with `r` a reference direction (the
previous gradient by default), and with two thresholds `tau_low < tau_high` passes the
step, projects out its aligned component or skips it (`gradient_alignment_control`).

On its own, this transformation emits zeros for a skipped step, which an optimizer after it
still moves the params on; the paper's skip, params and optimizer state kept, is
`alignment_controlled(adamw(...), gradient_alignment_control())` (`GACConfig.wrap`), what
the learner runs.

Cost, with the default "gradient" reference: `<g, r>` and `|g|^2` per leaf (`|r|^2` is the
previous `|g|^2`, carried), one pass emitting the update (fused into the optimizer after
it) and one writing the next reference; "ema", and "update" under control, measure `|r|^2`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from optax import GradientTransformationExtraArgs

from gac_jax._validation import check_choice, check_range, concrete_number
from gac_jax.numerics import computed_once
from gac_jax.transforms._alignment_math import (
    Alignment,
    Control,
    control_coefficients,
    cosine_after_control,
    emitted_and_next_references,
    per_leaf_alignment,
    per_leaf_control,
    removed_fraction,
    safe_cosine,
)

REGIME_PASS = 0
REGIME_PROJECT = 1
REGIME_SKIP = 2
REGIME_NONFINITE = 3
REGIME_NAMES = ("pass", "project", "skip", "nonfinite")

PROJECTIONS = ("partial", "full")
REFERENCES = ("gradient", "update", "ema")
SCOPES = ("global", "per_leaf")
THRESHOLD_MODES = ("fixed", "adaptive")
MAX_CONSECUTIVE_SKIPS = 8  # The default bound on a streak of skips: see the factory's docstring.


class GradientAlignmentControlState(NamedTuple):
    """State of `gradient_alignment_control` (and of `gradient_alignment_monitor`)."""

    gac_count: jax.Array  # int32 []: updates seen, finite or not.
    gac_reference: optax.Updates  # tree like the params: r_{t-1}, in `reference_dtype`.
    # f32 [leaves]: |r_{t-1}|^2 per leaf (`jax.tree.leaves` order), the previous |g|^2 with
    # the "gradient" reference (others re-measure theirs). Set it with `set_gac_reference`.
    gac_reference_sq: jax.Array
    gac_cosine: jax.Array  # f32 []: c_t = cos(g_t, r_{t-1}) over the whole tree, before control.
    gac_cosine_after: jax.Array  # f32 []: cos(emitted update, r_{t-1}) over the whole tree.
    gac_regime: jax.Array  # int32 []: 0 pass, 1 project, 2 skip, 3 non-finite (most severe leaf).
    gac_pass_count: jax.Array  # int32 []: steps whose regime was pass.
    gac_project_count: jax.Array  # int32 []: steps with at least one projected leaf, none skipped.
    gac_skip_count: jax.Array  # int32 []: steps with at least one skipped leaf.
    gac_nonfinite_count: jax.Array  # int32 []: steps with a non-finite gradient.
    gac_cosine_mean: jax.Array  # f32 []: EMA of c_t over steps with a usable reference.
    gac_cosine_var: jax.Array  # f32 []: EMA variance of c_t, same steps.
    gac_stats_count: jax.Array  # int32 []: steps that entered the two EMAs above.
    gac_tau_low: jax.Array  # f32 []: lower threshold in force at the last step.
    gac_tau_high: jax.Array  # f32 []: upper threshold in force at the last step.
    gac_removed_fraction: jax.Array  # f32 []: |g - emitted| / |g| (NaN if non-finite).
    gac_skip_streak: jax.Array  # int32 []: consecutive skipped steps up to the last (0: applied).
    gac_skip_streak_longest: jax.Array  # int32 []: the longest such streak so far.


def set_gac_reference(
    state: GradientAlignmentControlState, reference: optax.Updates
) -> GradientAlignmentControlState:
    """`state` with its reference direction replaced by `reference` (and its norms updated).

    Set a reference through this function rather than `state._replace(gac_reference=...)`:
    a stale norm would silently give wrong cosines. `reference` must have the structure of
    the state's reference; its leaves are cast to the stored dtypes.
    """
    old_leaves, treedef = jax.tree.flatten(state.gac_reference)
    new_leaves = treedef.flatten_up_to(reference)
    cast = [jnp.asarray(new, old.dtype) for new, old in zip(new_leaves, old_leaves, strict=True)]
    norms = [jnp.sum(jnp.square(jnp.asarray(x, jnp.float32))) for x in cast]
    return state._replace(
        gac_reference=treedef.unflatten(cast),
        gac_reference_sq=jnp.stack(norms) if norms else jnp.zeros([0], jnp.float32),
    )


def _zeros_like(param, dtype):
    if isinstance(param, jax.ShapeDtypeStruct):
        return jnp.zeros(param.shape, dtype or param.dtype, device=param.sharding)
    return jnp.zeros_like(param, dtype=dtype or param.dtype)


def _thresholds(state, tau_low, tau_high, threshold_mode, adaptive_k, adaptive_warmup):
    """Thresholds for this step: the adaptive band follows the cosines seen before this step
    (a spike cannot raise its own threshold) and only slides down, so persistently aligned
    runs (the failure the method exists for) never loosen it beyond the configured band."""
    tau_low = jnp.asarray(tau_low, jnp.float32)
    tau_high = jnp.asarray(tau_high, jnp.float32)
    if threshold_mode == "fixed":
        return tau_low, tau_high
    follow = jnp.clip(
        state.gac_cosine_mean + adaptive_k * jnp.sqrt(state.gac_cosine_var), 0.0, tau_low
    )
    ready = state.gac_stats_count >= adaptive_warmup
    low = jnp.where(ready, follow, tau_low)
    return low, low + (tau_high - tau_low)


def _update_cosine_stats(state, cosine, usable, decay):
    """EMA mean and variance of c_t (West's incremental form), only on usable steps."""
    first = state.gac_stats_count == 0
    diff = cosine - state.gac_cosine_mean
    mean = jnp.where(first, cosine, state.gac_cosine_mean + (1.0 - decay) * diff)
    var = jnp.where(first, 0.0, decay * (state.gac_cosine_var + (1.0 - decay) * diff * diff))
    return (
        jnp.where(usable, mean, state.gac_cosine_mean),
        jnp.where(usable, var, state.gac_cosine_var),
        jnp.where(usable, optax.safe_increment(state.gac_stats_count), state.gac_stats_count),
    )


def _regime(finite, control: Control) -> jax.Array:
    """int32 []: the most severe regime of any unit (non-finite > skip > project > pass)."""
    severe_first = [~finite, jnp.any(control.skip), jnp.any(control.project)]
    regimes = [REGIME_NONFINITE, REGIME_SKIP, REGIME_PROJECT]
    return jnp.select(severe_first, regimes, REGIME_PASS).astype(jnp.int32)


def regime_counters(state: GradientAlignmentControlState, regime) -> dict[str, jax.Array]:
    """The state's counters after a step of `regime`: the regime's count advanced, the skip
    streak advanced by a skip and reset by anything else, the longest streak kept."""

    def bump(counter, regime_id):
        return jnp.where(regime == regime_id, optax.safe_increment(counter), counter)

    streak = jnp.where(regime == REGIME_SKIP, optax.safe_increment(state.gac_skip_streak), 0)
    return dict(
        gac_regime=regime,
        gac_pass_count=bump(state.gac_pass_count, REGIME_PASS),
        gac_project_count=bump(state.gac_project_count, REGIME_PROJECT),
        gac_skip_count=bump(state.gac_skip_count, REGIME_SKIP),
        gac_nonfinite_count=bump(state.gac_nonfinite_count, REGIME_NONFINITE),
        gac_skip_streak=streak,
        gac_skip_streak_longest=jnp.maximum(state.gac_skip_streak_longest, streak),
    )


def gradient_alignment_control(
    tau_low: float = 0.2,
    tau_high: float = 0.8,
    *,
    projection: str = "partial",
    skip: bool = True,
    reference: str = "gradient",
    ema_decay: float = 0.9,
    scope: str = "global",
    thresholds: str = "fixed",
    adaptive_k: float = 2.0,
    adaptive_decay: float = 0.98,
    adaptive_warmup: int = 10,
    monitor_only: bool = False,
    reference_dtype: Any = None,
    max_consecutive_skips: int | None = MAX_CONSECUTIVE_SKIPS,
) -> GradientTransformationExtraArgs:
    r"""Gradient Alignment Control (Xu et al., arXiv 2603.01501, Sec. 4).

    With `c = cos(g, r)` and `target = max(tau_low, 0)`, the emitted update is

    .. math::

        \tilde g = \begin{cases}
          g & c \le \tau_{low} \\
          g - \alpha r & \tau_{low} < c \le \tau_{high} \\
          0 & c > \tau_{high}\ \text{(skip on)}
        \end{cases}
        \qquad
        \alpha = \frac{\|g\|}{\|r\|}
            \Big(c - \text{target}\sqrt{\tfrac{1 - c^2}{1 - \text{target}^2}}\Big)

    for `projection="partial"`, which leaves `cos(g~, r) = target` and the component of `g`
    orthogonal to `r` untouched; `projection="full"` uses `alpha = <g, r> / |r|^2` (cosine 0).
    With skip off, or after `max_consecutive_skips` skips in a row, `c > tau_high` is projected
    too. The first step, a zero gradient and a zero reference all give `c = 0` and pass
    unchanged. A non-finite gradient passes unchanged (pair with
    `optax.apply_if_finite` to drop it) and leaves the reference and statistics untouched.

    Args:
      tau_low: cosine at or below which the gradient passes, in [0, 1). Projection brings
        the cosine down to it.
      tau_high: cosine above which the step is skipped, in (tau_low, 1]; 1 never skips.
      skip: whether `c > tau_high` skips the step (emits zeros, regime "skip"; the true
        skip is `alignment_controlled`'s) instead of projecting it.
      reference: the direction `r` the next step is compared with: "gradient" (this step's
        raw gradient, the paper's signal), "update" (the update this transformation
        emitted; a skipped step keeps the previous reference, since a zero update has no
        direction), or "ema" (exponential moving average of raw gradients, `ema_decay`).
      ema_decay: decay of the "ema" reference, in [0, 1).
      scope: "global" (one cosine over the whole tree) or "per_leaf" (each leaf controlled
        on its own; the reported cosines stay global).
      thresholds: "fixed", or "adaptive": after `adaptive_warmup` usable steps the band
        `[tau_low, tau_high]` keeps its width and slides down so its lower edge sits at
        `mean + adaptive_k * std` of the cosines seen so far (EMA with `adaptive_decay`, in
        [0, 1)), clipped to `[0, tau_low]`. It never rises above the configured band.
      monitor_only: record the cosine (and statistics) without changing the gradient.
      reference_dtype: storage dtype of the reference (e.g. "bfloat16" to halve its
        memory); None keeps the params' dtypes. Inner products are always float32.
      max_consecutive_skips: after this many skipped steps in a row, a step that would be
        skipped is projected instead (to `tau_low`) and the streak starts again; None:
        unbounded, where a skip can repeat itself forever (params, optimizer state and
        reference frozen). Why 8: benchmarks/README.md.

    Returns:
      A transformation with `GradientAlignmentControlState` (`optax.tree.get` reads it).
    """
    check_range("tau_high", tau_high, -1.0, 1.0)
    check_range("tau_low", tau_low, 0.0, 1.0, high_open=True)
    check_range("ema_decay", ema_decay, 0.0, 1.0, high_open=True)
    check_range("adaptive_decay", adaptive_decay, 0.0, 1.0, high_open=True)
    check_range("adaptive_k", adaptive_k, 0.0, float("inf"))
    check_range("adaptive_warmup", adaptive_warmup, 0.0, float("inf"))
    check_choice("projection", projection, PROJECTIONS)
    check_choice("reference", reference, REFERENCES)
    check_choice("scope", scope, SCOPES)
    check_choice("thresholds", thresholds, THRESHOLD_MODES)
    bound = concrete_number(max_consecutive_skips)
    if bound is not None and (bound < 1 or bound != int(bound)):
        bad = f"max_consecutive_skips={max_consecutive_skips!r}"
        raise ValueError(f"{bad} must be an int >= 1 or None (unbounded).")
    low, high = concrete_number(tau_low), concrete_number(tau_high)
    if low is not None and high is not None and not low < high:
        raise ValueError(f"tau_low={tau_low!r} must be smaller than tau_high={tau_high!r}.")
    try:
        storage_dtype = None if reference_dtype is None else jnp.dtype(reference_dtype)
    except TypeError:
        raise ValueError(f"reference_dtype={reference_dtype!r} is not a dtype.") from None

    def init_fn(params):
        zero_f32, zero_i32 = jnp.zeros([], jnp.float32), jnp.zeros([], jnp.int32)
        return GradientAlignmentControlState(
            gac_count=zero_i32,
            gac_reference=jax.tree.map(lambda p: _zeros_like(p, storage_dtype), params),
            gac_reference_sq=jnp.zeros([len(jax.tree.leaves(params))], jnp.float32),
            gac_cosine=zero_f32,
            gac_cosine_after=zero_f32,
            gac_regime=zero_i32,
            gac_pass_count=zero_i32,
            gac_project_count=zero_i32,
            gac_skip_count=zero_i32,
            gac_nonfinite_count=zero_i32,
            gac_cosine_mean=zero_f32,
            gac_cosine_var=zero_f32,
            gac_stats_count=zero_i32,
            gac_tau_low=jnp.asarray(tau_low, jnp.float32),
            gac_tau_high=jnp.asarray(tau_high, jnp.float32),
            gac_removed_fraction=zero_f32,
            gac_skip_streak=zero_i32,
            gac_skip_streak_longest=zero_i32,
        )

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        grads, treedef = jax.tree.flatten(updates)
        refs = treedef.flatten_up_to(state.gac_reference)
        if not grads:
            return updates, state._replace(gac_count=optax.safe_increment(state.gac_count))

        # |r|^2 of the next reference is this step's |g|^2 when the reference is what came in.
        cache_norms = reference == "gradient" or (reference == "update" and monitor_only)
        per_leaf = per_leaf_alignment(grads, refs, state.gac_reference_sq, cache_norms)
        total = computed_once(Alignment(*(jnp.sum(x, keepdims=True) for x in per_leaf)))
        unit = per_leaf if scope == "per_leaf" else total

        global_cosine = safe_cosine(total.dot[0], total.grad_sq[0], total.ref_sq[0])
        finite = jnp.isfinite(total.grad_sq[0]) & jnp.isfinite(total.dot[0])
        usable = finite & (total.grad_sq[0] > 0) & (total.ref_sq[0] > 0)
        low, high = _thresholds(state, tau_low, tau_high, thresholds, adaptive_k, adaptive_warmup)
        may_skip = skip
        if max_consecutive_skips is not None and skip and not monitor_only:  # Then project.
            may_skip = state.gac_skip_streak < max_consecutive_skips
        control = control_coefficients(unit, low, high, finite, may_skip, projection, monitor_only)
        cosine_after = cosine_after_control(unit, control, total.ref_sq[0], finite)

        next_ref_sq = state.gac_reference_sq
        if cache_norms:  # |r|^2 of the next reference, per leaf, with no pass over it.
            next_ref_sq = jnp.where(finite, per_leaf.grad_sq, next_ref_sq)
        leaf_control = per_leaf_control(control, len(grads), scope)
        emitted, new_refs = emitted_and_next_references(
            grads, refs, leaf_control, finite, reference, ema_decay, monitor_only
        )
        regime = _regime(finite, control)
        mean, var, stats_count = _update_cosine_stats(state, global_cosine, usable, adaptive_decay)
        new_state = GradientAlignmentControlState(
            gac_count=optax.safe_increment(state.gac_count),
            gac_reference=jax.tree.unflatten(treedef, new_refs),
            gac_reference_sq=next_ref_sq,
            gac_cosine=jnp.where(finite, global_cosine, jnp.nan),
            gac_cosine_after=cosine_after,
            **regime_counters(state, regime),
            gac_cosine_mean=mean,
            gac_cosine_var=var,
            gac_stats_count=stats_count,
            gac_tau_low=low,
            gac_tau_high=high,
            gac_removed_fraction=removed_fraction(unit, control, total.grad_sq[0], finite),
        )
        return jax.tree.unflatten(treedef, emitted), new_state

    update_fn.can_skip = skip and not monitor_only  # Read by `can_skip`.
    return GradientTransformationExtraArgs(init_fn, update_fn)


def can_skip(transform: optax.GradientTransformation) -> bool:
    """False for a `gradient_alignment_control` that never skips (a monitor, or skip off)."""
    return getattr(transform.update, "can_skip", True)


def gradient_alignment_monitor(
    *, reference: str = "gradient", ema_decay: float = 0.9, reference_dtype: Any = None
) -> GradientTransformationExtraArgs:
    """Records `c_t = cos(g_t, r_{t-1})` without changing the gradient (GAC's signal only).

    The baseline runs of a comparison use it so that every run reports the same
    `gac_cosine`: `gradient_alignment_control(monitor_only=True)`, whose arguments and state.
    """
    return gradient_alignment_control(
        monitor_only=True, reference=reference, ema_decay=ema_decay, reference_dtype=reference_dtype
    )
