"""Typed, frozen configuration of a GRPO run, and the named presets (the one list of defaults).

A run is a `TrainConfig` of nested sections. `get_preset(name)` returns a preset;
`gac_jax.train.overrides.apply_overrides(config, ["rollout.lag=8", ...])` changes fields by
dotted name (an unknown or ill-typed key is an error naming it).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from gac_jax.objectives import ADVANTAGE_ESTIMATORS, IMPORTANCE_CORRECTIONS, POLICY_LOSSES
from gac_jax.transforms.alignment import PROJECTIONS, REFERENCES, SCOPES, THRESHOLD_MODES

ROLLOUT_MODES = ("sync", "lagged", "async")
INIT_MODES = ("random", "warm_start")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW after optional global-norm clipping."""

    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    clip_norm: float | None = 1.0  # None disables clipping.


@dataclasses.dataclass(frozen=True)
class GACConfig:
    """Gradient Alignment Control; when disabled the cosine is still monitored."""

    enabled: bool = False
    tau_low: float = 0.2
    tau_high: float = 0.8
    projection: str = "partial"
    skip: bool = True
    reference: str = "gradient"
    scope: str = "global"
    thresholds: str = "fixed"


@dataclasses.dataclass(frozen=True)
class ESSConfig:
    """VCPO's effective-sample-size step scaling."""

    enabled: bool = False
    rho_base: float = 1.0
    power: str = "sqrt"


@dataclasses.dataclass(frozen=True)
class ObjectiveConfig:
    """The policy loss and advantage estimator, by registry name, with their arguments."""

    policy_loss: str = "ppo"
    advantage: str = "grpo"
    # Keyword arguments of the policy loss (e.g. eps_low, tau_m2), as name -> value.
    loss_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    # VCPO baseline only: "exact" per-example gradient norms, or a proxy name.
    grad_norm: str = "exact"
    # None, or an importance correction by name ("tis", "mis", "icepop") whose weights the
    # loss takes as is_weights; e.g. sequence TIS: correction=tis,
    # correction_kwargs.level=sequence with policy_loss=reinforce.
    correction: str | None = None
    correction_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """How rollouts are made, and how stale they may be."""

    mode: str = "lagged"  # "sync", "lagged" or "async".
    lag: int = 0  # Lagged mode: step t trains on version max(0, t - lag).
    max_staleness: int | None = 1  # Async mode: ROLL Flash's alpha (None: unbounded).
    stale_policy: str = "block"  # Async mode: "drop" or "block".
    num_workers: int = 1  # Async mode: worker threads.
    groups_per_call: int = 1  # Async mode: groups per sampler call.
    groups_per_batch: int = 8  # Prompts per learner step.
    group_size: int = 8  # G completions per prompt.
    prompt_length: int = 32  # Prompts are left-padded to this many tokens.
    max_new_tokens: int = 16
    temperature: float = 1.0


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh sizes; -1 for "all remaining devices" (at most one axis)."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a run needs. `steps` counts learner updates."""

    task: str = "countdown/n3_max20"
    data_dir: str | None = None  # tfds data dir; None: ~/tensorflow_datasets.
    model: str = "tiny"  # A gac_jax.models preset.
    # "warm_start" (supervised on the task: the shipped checkpoint for countdown on tiny,
    # else trained once and cached), "random", or a Hugging Face checkpoint directory.
    init: str = "warm_start"
    steps: int = 100
    seed: int = 0
    micro_batches: int = 1  # Gradient accumulation: the batch is split into this many.
    eval_every: int = 25  # 0 disables held-out evaluation.
    eval_size: int = 64  # Test problems per evaluation.
    eval_samples: int = 8  # k of pass@k.
    checkpoint_every: int = 50  # 0 disables checkpoints.
    keep_checkpoints: int = 2
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    gac: GACConfig = dataclasses.field(default_factory=GACConfig)
    ess: ESSConfig = dataclasses.field(default_factory=ESSConfig)
    objective: ObjectiveConfig = dataclasses.field(default_factory=ObjectiveConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)

    @property
    def batch_size(self) -> int:
        """Sequences per learner step."""
        return self.rollout.groups_per_batch * self.rollout.group_size


def _choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"{name}={value!r} is unknown; expected one of {sorted(choices)}.")


def validate(config: TrainConfig) -> TrainConfig:
    """Raises ValueError naming the first inconsistent field; returns the config."""
    r, g = config.rollout, config.gac
    _choice("rollout.mode", r.mode, ROLLOUT_MODES)
    if config.init not in INIT_MODES and not os.path.isdir(config.init):
        raise ValueError(
            f"init={config.init!r} is neither one of {list(INIT_MODES)} nor an existing "
            "directory (a Hugging Face checkpoint with config.json)."
        )
    _choice("objective.policy_loss", config.objective.policy_loss, POLICY_LOSSES)
    _choice("objective.advantage", config.objective.advantage, ADVANTAGE_ESTIMATORS)
    if config.objective.correction is not None:
        _choice("objective.correction", config.objective.correction, IMPORTANCE_CORRECTIONS)
    _choice("gac.projection", g.projection, PROJECTIONS)
    _choice("gac.reference", g.reference, REFERENCES)
    _choice("gac.scope", g.scope, SCOPES)
    _choice("gac.thresholds", g.thresholds, THRESHOLD_MODES)
    if not 0.0 <= g.tau_low < g.tau_high <= 1.0:
        raise ValueError(
            f"gac.tau_low={g.tau_low} and gac.tau_high={g.tau_high} must satisfy "
            "0 <= tau_low < tau_high <= 1."
        )
    if r.group_size < 2:
        raise ValueError(
            f"rollout.group_size={r.group_size} must be >= 2: GRPO compares "
            "completions within a group."
        )
    for name in (
        "groups_per_batch",
        "max_new_tokens",
        "prompt_length",
        "num_workers",
        "groups_per_call",
    ):
        if getattr(r, name) < 1:
            raise ValueError(f"rollout.{name}={getattr(r, name)} must be >= 1.")
    if r.lag < 0:
        raise ValueError(f"rollout.lag={r.lag} must be >= 0.")
    if r.max_staleness is not None and r.max_staleness < 0:
        raise ValueError(f"rollout.max_staleness={r.max_staleness} must be >= 0 or None.")
    if config.steps < 1:
        raise ValueError(f"steps={config.steps} must be >= 1.")
    if config.micro_batches < 1 or config.batch_size % config.micro_batches:
        raise ValueError(
            f"micro_batches={config.micro_batches} must divide the batch of "
            f"{config.batch_size} sequences."
        )
    sizes = [config.mesh.data, config.mesh.fsdp, config.mesh.tensor]
    if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
        raise ValueError(
            f"mesh sizes data={sizes[0]}, fsdp={sizes[1]}, tensor={sizes[2]} must be positive, "
            "with at most one -1."
        )
    return config


def _preset_demo() -> TrainConfig:
    # Sized from short sweeps here: at lr 1e-3 the warm start degraded, at 1e-4 to 2e-4 the
    # batch reward rose; 16 prompts per step keep the reward curve readable.
    return TrainConfig(
        steps=300,
        eval_every=100,
        eval_size=128,
        checkpoint_every=100,
        optimizer=OptimizerConfig(learning_rate=2e-4),
        gac=GACConfig(enabled=True),
        rollout=RolloutConfig(
            mode="async", max_staleness=2, num_workers=1, groups_per_batch=16, groups_per_call=16
        ),
    )


def _preset_countdown_sweep() -> TrainConfig:
    # The base of the experiments in experiments/ (lagged naive GRPO from the warm start):
    # sized so that one run takes about three minutes on one CPU core.
    return TrainConfig(
        steps=200,
        eval_every=50,
        eval_size=128,
        checkpoint_every=50,
        keep_checkpoints=1,
        optimizer=OptimizerConfig(learning_rate=SWEEP_LEARNING_RATE),
        rollout=RolloutConfig(mode="lagged", groups_per_batch=16),
    )


SWEEP_LEARNING_RATE = 6e-4

PRESETS: dict[str, Any] = {
    # The embedded default: countdown from the shipped warm start, async GRPO with GAC.
    "demo": _preset_demo,
    "countdown_sync": lambda: TrainConfig(rollout=RolloutConfig(mode="sync")),
    "countdown_lagged8": lambda: TrainConfig(rollout=RolloutConfig(mode="lagged", lag=8)),
    "countdown_sweep": _preset_countdown_sweep,
    # Real hardware: Qwen3 on GSM8K from a Hugging Face checkpoint (see README).
    "qwen3_0_6b_gsm8k": lambda: TrainConfig(
        task="gsm8k",
        model="qwen3_0_6b",
        init="random",
        steps=500,
        optimizer=OptimizerConfig(learning_rate=1e-6, weight_decay=0.1),
        gac=GACConfig(enabled=True),
        rollout=RolloutConfig(
            mode="async",
            max_staleness=4,
            groups_per_batch=64,
            group_size=8,
            prompt_length=256,
            max_new_tokens=512,
            num_workers=2,
            groups_per_call=8,
        ),
        mesh=MeshConfig(data=1, fsdp=-1),
    ),
}


def preset_names() -> list[str]:
    return sorted(PRESETS)


def get_preset(name: str) -> TrainConfig:
    """A preset by name; ValueError listing the names otherwise."""
    if name not in PRESETS:
        raise ValueError(f"Unknown config preset {name!r}; known presets: {preset_names()}.")
    return validate(PRESETS[name]())
