r"""GAC's true skip and its control of applied updates: a wrapper around the optimizer.

In a chain, `gradient_alignment_control` can only hand the optimizer after it a zero
gradient, and Adam's momentum still moves the params (experiments/RESULTS.md).
`alignment_controlled(inner, ...)` owns the optimizer instead, as `optax.apply_if_finite`
does for non-finite steps:

1. the raw gradient `g_t` goes through GAC (`acts_on="gradient"`) or its monitor;
2. the optimizer turns what passed into its update `u_t`;
3. `u_t` goes through GAC (`acts_on="update"`) or its monitor, whose reference is the
   previous applied update (momentum keeps this cosine near 0.9 even in synchronous
   training);
4. if either level chose "skip", the step applies nothing and the optimizer's state
   (moments, count, the schedule's step, injected hyperparameters) stays as it was, bit
   for bit; GAC's own states record the skip.

Every run reports both cosines, whichever level (if any) acts. After a skip, the update
level's reference stays the last applied update; the gradient level's is the skipped
gradient ("observed", the default) or the last applied one ("held", which can lock a
persistently aligned run into skipping until `max_consecutive_skips`).

    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        alignment_controlled(optax.adamw(1e-3), gradient_alignment_control(0.2, 0.8)),
        scale_by_ess(),
    )

Thresholds below a problem's own synchronous cosine skip nearly every step: choose them from
a synchronous run's `gac_cosine` / `gac_update_cosine`. `random_skip`, in GAC's place, is
the control of the skip. Cost over the bare optimizer: the two alignment passes, and a
select over its state when the control can skip.

Measured (experiments/RESULTS.md, an 82k-parameter policy): it cured no collapse of naive
stale rollouts (v4; v5: its skips beat random ones at its rate and streaks, +0.018 ±
0.017); on PPO-clip it neither helped nor hurt (v5, on updates, 5 seeds: +0.002 ± 0.017 at
lag 16, -0.001 ± 0.007 at lag 64); on a delayed quadratic it converges where Adam diverges.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from optax import GradientTransformationExtraArgs

from gac_jax._configs import arguments
from gac_jax._validation import check_choice, check_range, concrete_number
from gac_jax.transforms import alignment
from gac_jax.transforms.alignment import MAX_CONSECUTIVE_SKIPS, REGIME_SKIP

ACTS_ON = ("gradient", "update")
REFERENCES_AFTER_SKIP = ("observed", "held")
# The statistics `alignment_statistics` reads from each level's state.
_LEVEL_FIELDS = ("gac_cosine", "gac_cosine_after", "gac_regime", "gac_removed_fraction")
_STREAK_FIELDS = ("gac_skip_streak", "gac_skip_streak_longest")


class AlignmentControlledState(NamedTuple):
    """State of `alignment_controlled`."""

    gac_inner_state: optax.OptState  # The wrapped optimizer's; kept as it was on a skipped step.
    gac_gradient_alignment: Any  # GradientAlignmentControlState of the raw gradients.
    gac_update_alignment: Any  # GradientAlignmentControlState of the applied updates.
    gac_skipped: jax.Array  # bool []: the last step was skipped (nothing applied).
    gac_skipped_steps: jax.Array  # int32 []: steps skipped so far.


def _chose_skip(gac_state) -> jax.Array:
    return optax.tree.get(gac_state, "gac_regime") == REGIME_SKIP


def _select(skipped, old, new):
    return jax.tree.map(lambda o, n: jnp.where(skipped, o, n), old, new)


def _with_reference_of(state, old, skipped):
    """`state` with `old`'s reference (and its norms) where `skipped`."""
    names = ("gac_reference", "gac_reference_sq")
    get = optax.tree.get
    return optax.tree.set(state, **{n: _select(skipped, get(old, n), get(state, n)) for n in names})


def alignment_controlled(
    inner: optax.GradientTransformation,
    control: optax.GradientTransformation | None = None,
    *,
    acts_on: str = "gradient",
    reference_after_skip: str = "observed",
    monitor_dtype: Any = None,
) -> GradientTransformationExtraArgs:
    """`inner` (an optimizer) under Gradient Alignment Control with a true skip.

    Args:
      inner: the optimizer (an `optax.inject_hyperparams` one too); it gets the extra args.
      control: a `gradient_alignment_control` (or `random_skip`); None: monitors only.
      acts_on: where `control` acts: "gradient" (the raw gradient, before `inner`) or
        "update" (`inner`'s update, against the previous applied update: give `control`
        ``reference="update"`` for the update the params got, "gradient" for the
        optimizer's update before control). The other level gets a monitor.
      reference_after_skip: "observed" or "held", see the module docstring.
      monitor_dtype: the monitors' reference dtype (None: the params').

    Returns:
      A transformation with `AlignmentControlledState` (`alignment_statistics` reads it).
    """
    check_choice("acts_on", acts_on, ACTS_ON)
    check_choice("reference_after_skip", reference_after_skip, REFERENCES_AFTER_SKIP)
    inner = optax.with_extra_args_support(inner)
    monitor = functools.partial(alignment.gradient_alignment_monitor, reference_dtype=monitor_dtype)
    levels = {"gradient": monitor(), "update": monitor(reference="update")}
    if control is not None:
        levels[acts_on] = control
    gradient, update = levels["gradient"], levels["update"]

    def init_fn(params):
        return AlignmentControlledState(
            gac_inner_state=inner.init(params),
            gac_gradient_alignment=gradient.init(params),
            gac_update_alignment=update.init(params),
            gac_skipped=jnp.zeros([], jnp.bool_),
            gac_skipped_steps=jnp.zeros([], jnp.int32),
        )

    # Known when the chain is built: a constant False lets XLA drop the selects below.
    can_skip = alignment.can_skip(gradient) or alignment.can_skip(update)

    def update_fn(updates, state, params=None, **extra_args):
        passed, gradient_state = gradient.update(updates, state.gac_gradient_alignment, params)
        proposed, inner_state = inner.update(passed, state.gac_inner_state, params, **extra_args)
        applied, update_state = update.update(proposed, state.gac_update_alignment, params)
        skipped = jnp.zeros([], jnp.bool_)
        if can_skip:
            skipped = _chose_skip(gradient_state) | _chose_skip(update_state)
        if reference_after_skip == "held":
            gradient_state = _with_reference_of(
                gradient_state, state.gac_gradient_alignment, skipped
            )
        steps = state.gac_skipped_steps
        new_state = AlignmentControlledState(
            gac_inner_state=_select(skipped, state.gac_inner_state, inner_state),
            gac_gradient_alignment=gradient_state,
            gac_update_alignment=_with_reference_of(
                update_state, state.gac_update_alignment, skipped
            ),
            gac_skipped=skipped,
            gac_skipped_steps=jnp.where(skipped, optax.safe_increment(steps), steps),
        )
        applied = jax.tree.map(lambda u: jnp.where(skipped, jnp.zeros_like(u), u), applied)
        return applied, new_state

    return GradientTransformationExtraArgs(init_fn, update_fn)


class RandomSkipState(NamedTuple):
    """State of `random_skip`."""

    gac_random_skip_key: jax.Array  # uint32 [2]: the PRNG key of the next draw.
    gac_random_skip_monitor: Any  # The monitor's GAC state: its cosines, the draws' regime.


def _check_random_skip(rate, mean_streak, names=("rate", "mean_streak")) -> None:
    check_range(names[0], rate, 0.0, 1.0, high_open=True)
    p, streak = concrete_number(rate), concrete_number(mean_streak)
    shortest = None if p is None else max(1.0, p / (1.0 - p))
    if streak is not None and shortest is not None and not streak >= shortest:
        raise ValueError(
            f"{names[1]}={mean_streak!r} must be >= max(1, rate / (1 - rate)) = {shortest:.4g} "
            f"at {names[0]}={rate!r} (an applied step between streaks)."
        )


def random_skip(
    rate, mean_streak=None, *, seed=0, monitor: optax.GradientTransformation | None = None
) -> GradientTransformationExtraArgs:
    r"""Skips steps at random, whatever the gradient: the control of GAC's skip.

    In GAC's place, `alignment_controlled(inner, random_skip(0.44, 3.7))` skips as GAC does, at a
    chosen rate and streak length: a two-state Markov chain on whether step t-1 was skipped,

    .. math::

        P(\text{skip} \mid \text{skipped}) = 1 - 1/L, \qquad
        P(\text{skip} \mid \text{applied}) = \frac{p}{L (1 - p)},

    whose stationary skip rate is `p` and whose streaks are geometric with mean `L`;
    `L = 1 / (1 - p)` makes the draws i.i.d. The first step follows an applied one. A
    skipped step emits zeros, as GAC's does.

    Args:
      rate: p, the fraction of steps skipped, in [0, 1).
      mean_streak: L, the mean length of a streak of skips, >= max(1, p / (1 - p));
        None: i.i.d. draws.
      seed: the draws' PRNG seed (the state carries the key: same seed, same skips).
      monitor: the `gradient_alignment_monitor` the gradient passes through (None: one of
        raw gradients); its regime, counts and streaks are the draws'.
    """
    _check_random_skip(rate, mean_streak)
    monitor = alignment.gradient_alignment_monitor() if monitor is None else monitor

    def init_fn(params):
        return RandomSkipState(jax.random.PRNGKey(seed), monitor.init(params))

    def update_fn(updates, state, params=None, **extra_args):
        del extra_args
        old = state.gac_random_skip_monitor
        updates, watched = monitor.update(updates, old, params)
        chance = jnp.asarray(rate, jnp.float32)
        if mean_streak is not None:
            enter = rate / (mean_streak * (1.0 - rate))
            chance = jnp.where(old.gac_skip_streak > 0, 1.0 - 1.0 / mean_streak, enter)
        key, draw = jax.random.split(state.gac_random_skip_key)
        skipped = jax.random.uniform(draw) < chance
        watched = watched._replace(
            **alignment.regime_counters(old, jnp.where(skipped, REGIME_SKIP, watched.gac_regime)),
            gac_cosine_after=jnp.where(skipped, 0.0, watched.gac_cosine_after),
            gac_removed_fraction=jnp.where(skipped, 1.0, watched.gac_removed_fraction),
        )
        updates = jax.tree.map(lambda u: jnp.where(skipped, jnp.zeros_like(u), u), updates)
        return updates, RandomSkipState(key, watched)

    return GradientTransformationExtraArgs(init_fn, update_fn)


def alignment_statistics(opt_state) -> dict[str, jax.Array]:
    """The alignment statistics of a chain's state, by the learner's metric names.

    With an `alignment_controlled` in the chain: ``gac_cosine``, ``gac_cosine_after``,
    ``gac_regime``, ``gac_removed_fraction`` and ``gac_tau_low`` of the raw gradients, the
    same four with a ``gac_update_`` prefix for the applied updates, ``gac_skipped`` (1.0
    if skipped), ``gac_skip_streak`` and ``gac_skip_streak_longest``. A bare
    `gradient_alignment_control` gives its own four, its threshold and streaks.
    """
    get = optax.tree.get
    wrapped = get(opt_state, "gac_gradient_alignment", None)
    if wrapped is None:
        names = (*_LEVEL_FIELDS, "gac_tau_low", *_STREAK_FIELDS)
        found = {name: get(opt_state, name, None) for name in names}
        return {name: value for name, value in found.items() if value is not None}
    levels = (("gac_", wrapped), ("gac_update_", get(opt_state, "gac_update_alignment")))
    metrics = {
        prefix + name[len("gac_") :]: get(level, name)
        for prefix, level in levels
        for name in _LEVEL_FIELDS
    }
    metrics["gac_tau_low"] = get(wrapped, "gac_tau_low")
    metrics["gac_skipped"] = get(opt_state, "gac_skipped").astype(jnp.float32)
    for name in _STREAK_FIELDS:  # One level at most can skip: the other's streaks are 0.
        metrics[name] = jnp.maximum(*(get(level, name) for _, level in levels))
    return metrics


@dataclasses.dataclass(frozen=True)
class GACConfig:
    """Gradient Alignment Control as the learner runs it: `gradient_alignment_control`'s
    arguments one to one, and where it acts (``monitor_only=True``: the baselines' cosines).

    Attributes:
      acts_on, reference_after_skip: `alignment_controlled`'s ("gradient", the raw gradient
        before the optimizer, is the paper's signal).
      random_skip_rate, random_skip_streak: `random_skip`'s `rate` and `mean_streak`: with
        a rate above 0 (and ``monitor_only=True``), steps are skipped at random in GAC's
        place, where `acts_on` says, seeded by the run's seed.
    """

    tau_low: float = 0.2
    tau_high: float = 0.8
    projection: str = "partial"
    skip: bool = True
    reference: str = "gradient"
    ema_decay: float = 0.9
    scope: str = "global"
    thresholds: str = "fixed"
    adaptive_k: float = 2.0
    adaptive_decay: float = 0.98
    adaptive_warmup: int = 10
    monitor_only: bool = False
    reference_dtype: str | None = None
    max_consecutive_skips: int | None = MAX_CONSECUTIVE_SKIPS
    acts_on: str = "gradient"
    reference_after_skip: str = "observed"
    random_skip_rate: float = 0.0
    random_skip_streak: float | None = None

    def build(self) -> GradientTransformationExtraArgs:
        """`gradient_alignment_control` with these arguments (which it validates)."""
        others = (*WRAPPER_FIELDS, *RANDOM_SKIP_FIELDS)
        own = {k: v for k, v in arguments(self).items() if k not in others}
        return alignment.gradient_alignment_control(**own)

    def wrap(
        self, inner: optax.GradientTransformation, *, seed: int = 0
    ) -> GradientTransformationExtraArgs:
        """`inner` under `alignment_controlled`, with this control where `acts_on` says
        (monitors in this `reference_dtype` on the other level); a random skip there,
        seeded by `seed`, when `random_skip_rate` is above 0."""
        control = self.build()
        if self.random_skip_rate:
            rate, streak = self.random_skip_rate, self.random_skip_streak
            control = random_skip(rate, streak, seed=seed, monitor=control)
        return alignment_controlled(
            inner,
            control,
            acts_on=self.acts_on,
            reference_after_skip=self.reference_after_skip,
            monitor_dtype=self.reference_dtype,
        )

    def validate(self) -> None:
        """Raises ValueError naming a bad field: the factories' own checks."""
        _check_random_skip(self.random_skip_rate, self.random_skip_streak, RANDOM_SKIP_FIELDS)
        if self.random_skip_rate and not self.monitor_only:
            raise ValueError(
                f"random_skip_rate={self.random_skip_rate!r} skips in GAC's place: it needs "
                "monitor_only=true."
            )
        if not self.random_skip_rate and self.random_skip_streak is not None:
            raise ValueError(
                f"random_skip_streak={self.random_skip_streak!r} is not used with "
                "random_skip_rate=0; leave it at None."
            )
        self.wrap(optax.identity())


# GACConfig's fields that are not `gradient_alignment_control`'s arguments.
WRAPPER_FIELDS = ("acts_on", "reference_after_skip")  # `alignment_controlled`'s.
RANDOM_SKIP_FIELDS = ("random_skip_rate", "random_skip_streak")  # `random_skip`'s two.
