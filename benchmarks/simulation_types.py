"""What the pipeline simulation takes and gives: its config, lengths and result.

`LengthDistribution`, `SimulationConfig` and `SimulationResult`. The model they describe,
and the engine that plays it, are in `simulation.py`, which re-exports
everything here.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from gac_jax.rollout.staleness import check_staleness_settings

MODES = ("sync", "async")
LENGTH_KINDS = ("constant", "lognormal", "pareto")


@dataclasses.dataclass(frozen=True)
class LengthDistribution:
    """Completion lengths in tokens, rounded up and clipped to [min_tokens, max_tokens].

    - "constant": every completion has `scale` tokens.
    - "lognormal": median `scale`, log-space standard deviation `shape`.
    - "pareto": P(length > x) = (scale / x) ** shape for x >= scale (tail index `shape`;
      the mean is infinite for shape <= 1 before clipping).

    Args:
      kind: one of `LENGTH_KINDS`.
      scale: the constant, the median, or the Pareto minimum (tokens, > 0).
      shape: lognormal sigma or Pareto tail index (> 0; unused for "constant").
      max_tokens: the clip, max_new_tokens.
      min_tokens: the smallest length (1: the EOS token alone).
    """

    kind: str = "lognormal"
    scale: float = 32.0
    shape: float = 1.0
    max_tokens: int = 256
    min_tokens: int = 1

    def __post_init__(self):
        if self.kind not in LENGTH_KINDS:
            raise ValueError(f"kind={self.kind!r} is not one of {LENGTH_KINDS}.")
        if not self.scale > 0:
            raise ValueError(f"scale={self.scale} must be > 0.")
        if self.kind != "constant" and not self.shape > 0:
            raise ValueError(f"shape={self.shape} must be > 0.")
        if not 1 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"need 1 <= min_tokens={self.min_tokens} <= max_tokens={self.max_tokens}."
            )

    def sample(self, rng: np.random.Generator, size) -> np.ndarray:
        """int64 lengths of the given shape."""
        if self.kind == "constant":
            raw = np.full(size, self.scale, np.float64)
        elif self.kind == "lognormal":
            raw = rng.lognormal(math.log(self.scale), self.shape, size)
        else:  # numpy's pareto is the Lomax distribution: 1 + it is Pareto with minimum 1.
            raw = self.scale * (1.0 + rng.pareto(self.shape, size))
        return np.clip(np.ceil(raw), self.min_tokens, self.max_tokens).astype(np.int64)

    def describe(self) -> str:
        if self.kind == "constant":
            body = f"{self.scale:g} tokens"
        elif self.kind == "lognormal":
            body = f"median {self.scale:g}, sigma {self.shape:g}"
        else:
            body = f"minimum {self.scale:g}, tail index {self.shape:g}"
        return f"{self.kind} ({body}) clipped to [{self.min_tokens}, {self.max_tokens}]"


@dataclasses.dataclass(frozen=True)
class SimulationConfig:
    """One simulated run. Times are in seconds.

    Args:
      mode: "sync" or "async".
      num_workers: W, generation workers.
      groups_per_batch: B, groups per learner step.
      group_size: G, completions per group (the group lasts as long as its longest).
      max_staleness: async only: the bound alpha, or None for none (drop policy only).
      stale_policy: async only: "block" or "drop", as `RolloutBuffer`.
      capacity: async only: buffer size in groups; None is `AsyncRollouts`' 2 * B.
      token_seconds: time to generate one token of every row of a group.
      group_overhead_seconds: fixed time per group (prefill, dispatch, scoring).
      train_seconds: time of one learner step.
      lengths: the completion length distribution.
      num_steps: learner steps to simulate.
      seed: seed of the length stream.
      tool_calls: multi-turn episodes: environment calls per row; each waits a latency
        drawn from a log-normal with median `tool_latency_seconds` and sigma
        `tool_latency_sigma`. A row then takes `token_seconds` x its length plus its
        calls' latencies (its slot waits while the other rows decode), and the group lasts
        as long as its slowest row, plus `group_overhead_seconds`.
    """

    mode: str = "async"
    num_workers: int = 1
    groups_per_batch: int = 8
    group_size: int = 8
    max_staleness: int | None = 1
    stale_policy: str = "block"
    capacity: int | None = None
    token_seconds: float = 1e-3
    group_overhead_seconds: float = 0.0
    train_seconds: float = 0.1
    lengths: LengthDistribution = LengthDistribution()
    num_steps: int = 200
    seed: int = 0
    tool_calls: int = 0
    tool_latency_seconds: float = 0.0
    tool_latency_sigma: float = 1.0

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r} is not one of {MODES}.")
        for name in ("num_workers", "groups_per_batch", "group_size", "num_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1.")
        # The stale policy is unused in sync mode, so it needs no bound there.
        check_staleness_settings(
            self.max_staleness, self.stale_policy, block_needs_bound=self.mode == "async"
        )
        if self.buffer_capacity < self.groups_per_batch:
            raise ValueError(
                f"capacity={self.capacity} must be >= groups_per_batch={self.groups_per_batch}."
            )
        if isinstance(self.tool_calls, bool) or not isinstance(self.tool_calls, int):
            raise ValueError(f"tool_calls={self.tool_calls!r} must be an int >= 0.")
        for name in (
            "token_seconds",
            "group_overhead_seconds",
            "train_seconds",
            "tool_calls",
            "tool_latency_seconds",
            "tool_latency_sigma",
        ):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0.")
        if not self.group_overhead_seconds + self.token_seconds * self.lengths.min_tokens > 0:
            # Zero-time groups would let the event loop spin forever at one instant.
            raise ValueError("a group must take some time: raise token_seconds or the overhead.")

    @property
    def buffer_capacity(self) -> int:
        return 2 * self.groups_per_batch if self.capacity is None else self.capacity


@dataclasses.dataclass(frozen=True)
class SimulationResult:
    """What a simulated run measured.

    Attributes:
      config: the run's configuration.
      steps: learner steps completed (`num_steps` unless the run deadlocked).
      seconds: simulated time when the last completed step ended.
      step_end_times: when each step ended (its version + 1 was published).
      produced: groups put into the buffer (sync: generated).
      consumed: groups trained on.
      dropped: groups discarded as too stale.
      depth: groups left in the buffer at the end.
      staleness_histogram: learner version - group version -> groups trained on.
      worker_busy_seconds: generation time summed over workers, up to `seconds`.
      dropped_busy_seconds: the part of it spent on groups that were dropped.
      deadlocked: the learner waits for a batch that can never come.
      trace: with `record_trace`, every buffer call in order: ("reserve", version, ok),
        ("put", group_id, version, ok), ("take", learner_version, group ids or None).
    """

    config: SimulationConfig
    steps: int
    seconds: float
    step_end_times: tuple[float, ...]
    produced: int
    consumed: int
    dropped: int
    depth: int
    staleness_histogram: dict[int, int]
    worker_busy_seconds: float
    dropped_busy_seconds: float
    deadlocked: bool
    trace: tuple[tuple, ...] | None = None

    @property
    def steps_per_second(self) -> float:
        return self.steps / self.seconds if self.seconds > 0 else math.inf

    @property
    def groups_per_second(self) -> float:
        """Groups trained on per second."""
        return self.consumed / self.seconds if self.seconds > 0 else math.inf

    @property
    def mean_staleness(self) -> float:
        total = sum(self.staleness_histogram.values())
        return sum(k * n for k, n in self.staleness_histogram.items()) / max(total, 1)

    @property
    def max_staleness(self) -> int:
        return max(self.staleness_histogram, default=0)

    @property
    def worker_utilisation(self) -> float:
        """Fraction of worker time spent generating (dropped groups included)."""
        return self.worker_busy_seconds / (self.config.num_workers * self.seconds)

    @property
    def learner_idle_fraction(self) -> float:
        """Fraction of the run the learner spent waiting for a batch."""
        return 1.0 - self.steps * self.config.train_seconds / self.seconds

    def summary(self) -> dict[str, float]:
        return {
            "steps_per_second": self.steps_per_second,
            "groups_per_second": self.groups_per_second,
            "mean_staleness": self.mean_staleness,
            "max_staleness": float(self.max_staleness),
            "worker_utilisation": self.worker_utilisation,
            "learner_idle_fraction": self.learner_idle_fraction,
            "dropped": float(self.dropped),
            "deadlocked": float(self.deadlocked),
        }
