"""The learner's optax chain: clip -> the optimizer under GAC (`alignment_controlled`: GAC or
its monitor on the raw gradient and on the applied update, a true skip) -> ESS step scaling.

The optimizer is one of optax's own (`OPTIMIZERS`), its learning rate one of optax's
schedules (`SCHEDULES`), injected with `optax.inject_hyperparams` so that the rate each
update used is in the optimizer state (the learner logs it as `learning_rate`).
"""

from __future__ import annotations

import dataclasses

import jax
import optax

from gac_jax._validation import check_choice, check_int, check_range
from gac_jax.transforms import ESSConfig, GACConfig, GradientAlignmentControlState

# The optimizers, by their names in optax (looked up there when the chain is built).
OPTIMIZERS = ("adamw", "adafactor", "lion", "sgd")
SCHEDULES = ("constant", "warmup_cosine", "warmup_linear")
# The fields each optimizer reads besides the learning rate; the others must keep their
# defaults, so that a setting is never silently ignored.
_OPTIMIZER_FIELDS = {
    "adamw": ("weight_decay", "b1", "b2"),
    "adafactor": ("weight_decay", "momentum"),
    "lion": ("weight_decay", "b1", "b2"),
    "sgd": ("momentum",),
}
_SCHEDULE_FIELDS = ("warmup_steps", "decay_steps", "end_lr_ratio")
SGD_MOMENTUM = 0.9


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """An optax optimizer with a learning-rate schedule, after optional global-norm
    clipping (GAC and ESS scaling have their own configs).

    Attributes:
      name: one of `OPTIMIZERS`, optax's function of that name (lion's paper uses b2=0.99
        and a rate 3-10x smaller than AdamW's).
      learning_rate: the peak step size, > 0.
      weight_decay: decoupled weight decay, >= 0 (adafactor's `weight_decay_rate`).
      b1, b2: moment decays of adamw and lion, in [0, 1).
      momentum: sgd's momentum (None: 0.9) or adafactor's (None: none), in [0, 1).
      clip_norm: global-norm clip before anything else, > 0; None disables it.
      schedule: the learning rate over optimizer steps, one of `SCHEDULES`: "constant";
        "warmup_cosine" (linear from 0 to `learning_rate` over `warmup_steps`, then cosine
        decay to `end_lr_ratio * learning_rate` at `decay_steps`,
        `optax.schedules.warmup_cosine_decay_schedule`); "warmup_linear" (the same warm-up,
        then linear decay, `optax.schedules.linear_schedule`s joined by
        `optax.schedules.join_schedules`). The rate stays at its end value after
        `decay_steps`.
      warmup_steps: steps of the linear warm-up, an int >= 0 (0: start at the peak).
      decay_steps: the schedule's whole length, warm-up included (optax's convention), an
        int > warmup_steps; None: the run's `steps`.
      end_lr_ratio: the final learning rate over the peak, in [0, 1].
    """

    name: str = "adamw"
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    momentum: float | None = None
    clip_norm: float | None = 1.0
    schedule: str = "constant"
    warmup_steps: int = 0
    decay_steps: int | None = None
    end_lr_ratio: float = 0.0

    def validate(self) -> None:
        """Raises ValueError naming a bad field."""
        check_choice("name", self.name, OPTIMIZERS)
        check_range("learning_rate", self.learning_rate, 0.0, float("inf"), low_open=True)
        check_range("weight_decay", self.weight_decay, 0.0, float("inf"))
        check_range("b1", self.b1, 0.0, 1.0, high_open=True)
        check_range("b2", self.b2, 0.0, 1.0, high_open=True)
        if self.momentum is not None:
            check_range("momentum", self.momentum, 0.0, 1.0, high_open=True)
        if self.clip_norm is not None:
            check_range("clip_norm", self.clip_norm, 0.0, float("inf"), low_open=True)
        check_choice("schedule", self.schedule, SCHEDULES)
        w, d = self.warmup_steps, self.decay_steps
        check_int("warmup_steps", w, 0)
        check_int("decay_steps", d, 1, allow_none=True, note=" (None: the run's steps)")
        if d is not None and w >= d:
            raise ValueError(
                f"warmup_steps={w} must be < decay_steps={d} (the schedule's whole length)."
            )
        check_range("end_lr_ratio", self.end_lr_ratio, 0.0, 1.0)
        defaults = OptimizerConfig()
        scheduled = self.schedule != "constant"
        used = _OPTIMIZER_FIELDS[self.name] + (_SCHEDULE_FIELDS if scheduled else ())
        for field in ("weight_decay", "b1", "b2", "momentum", *_SCHEDULE_FIELDS):
            value = getattr(self, field)
            if field not in used and value != getattr(defaults, field):
                what = "schedule='constant'" if field in _SCHEDULE_FIELDS else f"name={self.name!r}"
                raise ValueError(
                    f"{field}={value!r} is not used with {what}; leave it at "
                    f"{getattr(defaults, field)!r}."
                )


def make_schedule(config: OptimizerConfig, steps: int | None = None) -> optax.Schedule:
    """The learning rate as a function of the optimizer's step count (0 for the first
    update), from optax's schedules; `steps` (the run's length) stands in for a None
    `config.decay_steps`."""
    config.validate()
    peak, warmup = config.learning_rate, config.warmup_steps
    if config.schedule == "constant":
        return optax.schedules.constant_schedule(peak)
    decay_steps = steps if config.decay_steps is None else config.decay_steps
    if decay_steps is None:
        raise ValueError(
            f"decay_steps=None means the run's steps, which this optimizer is built without; "
            f"set decay_steps for schedule={config.schedule!r}."
        )
    if not _is_int(decay_steps) or decay_steps <= warmup:
        raise ValueError(
            f"warmup_steps={warmup} must be < decay_steps={decay_steps} "
            "(the schedule's whole length; None: the run's steps)."
        )
    end = config.end_lr_ratio * peak
    if config.schedule == "warmup_cosine":
        return optax.schedules.warmup_cosine_decay_schedule(
            init_value=0.0,
            peak_value=peak,
            warmup_steps=warmup,
            decay_steps=decay_steps,
            end_value=end,
        )
    return optax.schedules.join_schedules(
        [
            optax.schedules.linear_schedule(0.0, peak, warmup),
            optax.schedules.linear_schedule(peak, end, decay_steps - warmup),
        ],
        boundaries=[warmup],
    )


def _optimizer_kwargs(config: OptimizerConfig) -> dict:
    """The chosen optax optimizer's arguments besides the learning rate."""
    if config.name in ("adamw", "lion"):
        return {"b1": config.b1, "b2": config.b2, "weight_decay": config.weight_decay}
    if config.name == "adafactor":
        return {"momentum": config.momentum, "weight_decay_rate": config.weight_decay}
    momentum = SGD_MOMENTUM if config.momentum is None else config.momentum
    return {"momentum": momentum}


def make_optimizer(
    config: OptimizerConfig | None = None,
    gac: GACConfig | None = None,
    ess: ESSConfig | None = None,
    *,
    steps: int | None = None,
    seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
    """Builds the chain every run uses, so every run reports the same statistics.

    The optimizer is optax's own, built by `optax.inject_hyperparams` with only the
    learning rate injected: the rate of each update is `make_schedule`'s at the optimizer's
    step count, kept in the state (`hyperparams["learning_rate"]`), where the learner
    reads back the value the update used. The other arguments are passed as Python
    numbers, as a plain `optax.adamw(...)` gets them, so the default (adamw, constant)
    computes the same update bit for bit.

    Args:
      gac: Gradient Alignment Control, or None for its monitors only (both cosines, of
        raw gradients and of applied updates, are recorded either way). It wraps the
        optimizer (`GACConfig.wrap`), so a skipped step leaves the params and the whole
        optimizer state, the schedule's step included, as they were.
      ess: VCPO's ESS step scaling, or None to leave the step unscaled. The update then
        needs the extra arg `log_importance_weights`.
      steps: the run's length, for a schedule whose `config.decay_steps` is None.
      seed: the seed of `gac`'s random skips (`GACConfig.random_skip_rate`), if any.
    """
    config = OptimizerConfig() if config is None else config
    schedule = make_schedule(config, steps)
    kwargs = _optimizer_kwargs(config)

    def optimizer(learning_rate):
        # Looked up in optax when called: optax's own implementation, nothing copied.
        return getattr(optax, config.name)(learning_rate, **kwargs)

    parts = []
    if config.clip_norm is not None:
        parts.append(optax.clip_by_global_norm(config.clip_norm))
    gac = GACConfig(monitor_only=True) if gac is None else gac
    inner = optax.inject_hyperparams(optimizer)(learning_rate=schedule)
    parts.append(gac.wrap(inner, seed=seed))
    if ess is not None:
        parts.append(ess.build())
    return optax.chain(*parts)


def injected_learning_rate(opt_state):
    """The learning rate of the last update, as `optax.inject_hyperparams` stored it in
    `opt_state` (None for a chain without an injected one)."""

    def in_hyperparams(path, _):
        return any(getattr(key, "name", None) == "hyperparams" for key in path)

    return optax.tree.get(opt_state, "learning_rate", None, filtering=in_hyperparams)


def replaced_leaves(opt_state):
    """A bool per leaf of a chain's state (an optax mask): True for GAC's references, which
    each update replaces wholesale while still reading the old value (the new one is the
    step's gradient). The learner donates the other leaves; donating these would make XLA
    copy the old value out of the way first, where the gradient's own buffer can become it."""
    gac = GradientAlignmentControlState

    def mark(node):
        flags = jax.tree.map(lambda _: False, node)
        if isinstance(node, gac):
            flags = flags._replace(gac_reference=jax.tree.map(lambda _: True, node.gac_reference))
        return flags

    return jax.tree.map(mark, opt_state, is_leaf=lambda node: isinstance(node, gac))
