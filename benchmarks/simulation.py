"""A discrete-event simulation of the rollout pipeline: what does asynchrony buy?

`simulate(config)` plays the learner, the `RolloutBuffer` and W generation workers forward
in simulated time (an event heap, no threads, no sleeping) and reports throughput, the
staleness of the groups trained on, worker utilisation, learner idle time and dropped
groups. It is deterministic for a seed, and it runs thousands of learner steps in well
under a second, so it can answer "how much faster is async than sync for this staleness
bound and this many workers?" from a few measured costs.

The model, and the assumptions it makes:

- **Groups.** A group is G completions of one prompt, sampled in one call. Completion
  lengths come from a `LengthDistribution` (heavy-tailed, clipped to `max_tokens`, i.e.
  max_new_tokens); the call lasts `group_overhead_seconds + token_seconds * max length`,
  because the KV-cache sampler steps every row until the longest one ends. Group k's
  lengths are the k-th draw of one seeded stream, whatever the mode, so sync and async
  see the same groups in the same order.
- **Workers.** W identical workers, each generating one group at a time
  (`groups_per_call=1`), none slowing another or the learner: each has its own
  accelerator, the deployment asynchronous RL is for. (On a shared host, real threads
  contend; the simulation does not model that.) A group is tagged with the version
  published when it starts and never picks up a newer one mid-generation, as in
  `RolloutWorker`.
- **Learner.** Step t publishes version t, takes B groups, and trains for a fixed
  `train_seconds` (batches are padded to max_new_tokens, so a step's cost does not depend
  on the lengths); version t + 1 is published when the step ends. Version 0 is published
  at time 0. Copying params into the `ParamStore` and moving them to the workers is free.
- **Async mode** follows `RolloutWorker` and `RolloutBuffer` exactly, deciding with the
  same functions (`gac_jax.rollout.staleness`): a worker reserves a slot (block policy:
  the j-th reservation with latest version v is granted only if
  j < (v + max_staleness + 1) * B; drop policy: always), generates, puts the group
  (waiting while the buffer holds `capacity` groups), and loops. The learner's `take`
  discards groups with staleness > max_staleness (under both policies) and then pops the
  oldest B. Waiters are served first come, first served, and re-check the moment the state
  changes (the real worker polls every 50 ms; the learner is woken at once).
  `record_trace=True` keeps every buffer call and its outcome, so a test can replay the
  run against the real `RolloutBuffer`.
- **Sync mode** is `SyncRollouts` spread over W workers: the B groups of step t are
  generated with version t, each by the next free worker, then the learner trains; the
  workers idle while it does. (The real `SyncRollouts` samples all B groups in one call;
  giving both modes the same W workers and per-group costs isolates the scheduling.)

Under the block policy a group can still arrive too stale (it started long before groups
that finished first); `take` drops it and gives its reservation back, as `RolloutBuffer`
does, so the window of groups in flight stays (max_staleness + 1) * B beyond what was
consumed. (Should the learner ever wait for a batch nothing can produce any more, the run
ends with `deadlocked=True`.)
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
from collections.abc import Sequence

import numpy as np
from simulation_types import (
    LENGTH_KINDS,
    MODES,
    LengthDistribution,
    SimulationConfig,
    SimulationResult,
)

from gac_jax.rollout.staleness import (
    held_after_drop,
    reservation_allowed,
    staleness,
    take_fresh,
)

__all__ = [
    "LENGTH_KINDS",
    "MODES",
    "Comparison",
    "LengthDistribution",
    "SimulationConfig",
    "SimulationResult",
    "compare_async_to_sync",
    "format_comparison",
    "format_utilisation",
    "simulate",
]

# Event kinds; the heap orders (time, sequence number), so ties keep insertion order.
_FINISHED, _TRAINED = 0, 1
# Lengths are drawn this many groups at a time from one stream (any chunk size gives the
# same lengths for the same group ids only if it never changes, so it is fixed).
_CHUNK = 1024


class _GroupCosts:
    """Generation time of group k: the k-th draw of one seeded stream of lengths."""

    def __init__(self, config: SimulationConfig):
        self._config = config
        self._rng = np.random.default_rng(config.seed)
        self._seconds: list[float] = []

    def seconds(self, group_id: int) -> float:
        c = self._config
        while group_id >= len(self._seconds):
            rows = c.token_seconds * c.lengths.sample(self._rng, (_CHUNK, c.group_size))
            if c.tool_calls:  # Each row waits for its own tools while the others decode.
                latency = c.tool_latency_seconds * np.exp(
                    c.tool_latency_sigma
                    * self._rng.standard_normal((_CHUNK, c.group_size, c.tool_calls))
                )
                rows = rows + latency.sum(axis=2)
            self._seconds.extend((c.group_overhead_seconds + rows.max(axis=1)).tolist())
        return self._seconds[group_id]


def simulate(config: SimulationConfig, *, record_trace: bool = False) -> SimulationResult:
    """Runs the simulation described by `config` (see the module docstring)."""
    if config.mode == "sync":
        return _simulate_sync(config)
    return _AsyncPipeline(config, record_trace).run()


def _simulate_sync(c: SimulationConfig) -> SimulationResult:
    costs = _GroupCosts(c)
    now, busy, ends, group_id = 0.0, 0.0, [], 0
    for _ in range(c.num_steps):
        free = [(now, w) for w in range(c.num_workers)]  # (free at, worker): a heap.
        finished = now
        for _ in range(c.groups_per_batch):
            start, worker = heapq.heappop(free)
            end = start + costs.seconds(group_id)
            group_id += 1
            busy += end - start
            finished = max(finished, end)
            heapq.heappush(free, (end, worker))
        now = finished + c.train_seconds
        ends.append(now)
    groups = c.num_steps * c.groups_per_batch
    return SimulationResult(
        config=c,
        steps=c.num_steps,
        seconds=now,
        step_end_times=tuple(ends),
        produced=groups,
        consumed=groups,
        dropped=0,
        depth=0,
        staleness_histogram={0: groups},
        worker_busy_seconds=busy,
        dropped_busy_seconds=0.0,
        deadlocked=False,
    )


class _AsyncPipeline:
    """The event loop of async mode: workers, buffer and learner as plain state."""

    def __init__(self, config: SimulationConfig, record_trace: bool):
        self.c = config
        self.costs = _GroupCosts(config)
        self.trace: list[tuple] | None = [] if record_trace else None
        self.now = 0.0
        self.events: list[tuple] = []
        self.sequence = itertools.count()
        self.version = 0  # Latest published version == the learner's current step.
        self.steps = 0
        self.step_end_times: list[float] = []
        self.learner_waiting = True
        self.queue_changed = True  # Whether a waiting learner has something new to look at.
        self.queue: collections.deque[tuple[int, int]] = collections.deque()  # (id, version)
        # Reservations held, as `RolloutBuffer` counts them (dropped groups give theirs back).
        self.reserved = self.produced = self.consumed = self.dropped = 0
        self.histogram: collections.Counter[int] = collections.Counter()
        self.next_group = 0
        self.intervals: dict[int, tuple[float, float]] = {}  # group id -> generation time.
        self.dropped_ids: list[int] = []
        self.reserve_waiters: collections.deque[int] = collections.deque(range(config.num_workers))
        self.blocked_recorded: set[int] = set()
        self.put_waiters: collections.deque[tuple[int, int, int]] = collections.deque()

    def _record(self, *event) -> None:
        if self.trace is not None:
            self.trace.append(event)

    def _push(self, delay: float, kind: int, data) -> None:
        heapq.heappush(self.events, (self.now + delay, next(self.sequence), kind, data))

    # ------------------------------------------------------------------- buffer semantics

    def _slot_free(self) -> bool:
        return reservation_allowed(
            self.reserved,
            self.version,
            max_staleness=self.c.max_staleness,
            groups_per_batch=self.c.groups_per_batch,
            stale_policy=self.c.stale_policy,
        )

    def _start(self, worker: int) -> None:
        self.reserved += 1
        self._record("reserve", self.version, True)
        group_id, self.next_group = self.next_group, self.next_group + 1
        seconds = self.costs.seconds(group_id)
        self.intervals[group_id] = (self.now, self.now + seconds)
        self._push(seconds, _FINISHED, (worker, group_id, self.version))

    def _put(self, group_id: int, version: int) -> None:
        self.queue.append((group_id, version))
        self.produced += 1
        self.queue_changed = True
        self._record("put", group_id, version, True)

    def _try_take(self) -> bool:
        c, t = self.c, self.version
        self.queue_changed = False
        outcome = take_fresh(self.queue, t, c.groups_per_batch, c.max_staleness, lambda g: g[1])
        self.queue = collections.deque(outcome.kept)
        self.dropped_ids.extend(g[0] for g in outcome.dropped)
        self.dropped += len(outcome.dropped)
        self.reserved = held_after_drop(self.reserved, len(outcome.dropped), c.stale_policy)
        batch = outcome.batch
        if batch is None:
            self._record("take", t, None)
            return False
        for _, version in batch:
            self.histogram[staleness(t, version)] += 1
        self.consumed += len(batch)
        self._record("take", t, tuple(g[0] for g in batch))
        self.learner_waiting = False
        self._push(c.train_seconds, _TRAINED, None)
        return True

    def _settle(self) -> None:
        """Lets every waiter that can proceed at `now` do so, until nobody can."""
        capacity = self.c.buffer_capacity
        progress = True
        while progress:
            progress = False
            if self.learner_waiting and self.queue_changed:
                progress |= self._try_take()
            while self.put_waiters and len(self.queue) < capacity:
                worker, group_id, version = self.put_waiters.popleft()
                self._put(group_id, version)
                self.reserve_waiters.append(worker)
                progress = True
            while self.reserve_waiters and self._slot_free():
                worker = self.reserve_waiters.popleft()
                self.blocked_recorded.discard(worker)
                self._start(worker)
                progress = True
        for worker in self.reserve_waiters:
            if worker not in self.blocked_recorded:
                self.blocked_recorded.add(worker)
                self._record("reserve", self.version, False)

    # ------------------------------------------------------------------------ event loop

    def run(self) -> SimulationResult:
        c = self.c
        self._settle()
        deadlocked = False
        while self.steps < c.num_steps:
            if not self.events:
                deadlocked = True
                break
            self.now, _, kind, data = heapq.heappop(self.events)
            if kind == _FINISHED:
                worker, group_id, version = data
                if not self.put_waiters and len(self.queue) < c.buffer_capacity:
                    self._put(group_id, version)
                    self.reserve_waiters.append(worker)
                else:
                    self._record("put", group_id, version, False)
                    self.put_waiters.append(data)
            else:
                self.steps += 1
                self.step_end_times.append(self.now)
                self.version += 1
                self.learner_waiting = self.queue_changed = self.steps < c.num_steps
            self._settle()
        end = self.step_end_times[-1] if self.step_end_times else self.now
        busy = sum(max(0.0, min(stop, end) - start) for start, stop in self.intervals.values())
        wasted = sum(
            max(0.0, min(self.intervals[g][1], end) - self.intervals[g][0])
            for g in self.dropped_ids
        )
        return SimulationResult(
            config=c,
            steps=self.steps,
            seconds=end,
            step_end_times=tuple(self.step_end_times),
            produced=self.produced,
            consumed=self.consumed,
            dropped=self.dropped,
            depth=len(self.queue),
            staleness_histogram=dict(sorted(self.histogram.items())),
            worker_busy_seconds=busy,
            dropped_busy_seconds=wasted,
            deadlocked=deadlocked,
            trace=None if self.trace is None else tuple(self.trace),
        )


# ----------------------------------------------------------------------------- sweeps


@dataclasses.dataclass(frozen=True)
class Comparison:
    """Async and sync runs of one (workers, staleness bound) cell."""

    sync: SimulationResult
    async_: SimulationResult

    @property
    def speedup(self) -> float:
        """Async steps/s over sync steps/s (both over the steps they completed)."""
        return self.async_.steps_per_second / self.sync.steps_per_second


def compare_async_to_sync(
    base: SimulationConfig,
    staleness_bounds: Sequence[int],
    worker_counts: Sequence[int],
    **async_overrides,
) -> dict[tuple[int, int], Comparison]:
    """Sync and async runs for every (workers, bound); `async_overrides` set async fields.

    Returns {(workers, bound): Comparison}. The sync run of a worker count is shared.
    """
    out = {}
    for workers in worker_counts:
        sync = simulate(dataclasses.replace(base, mode="sync", num_workers=workers))
        for bound in staleness_bounds:
            config = dataclasses.replace(
                base, mode="async", num_workers=workers, max_staleness=bound, **async_overrides
            )
            out[(workers, bound)] = Comparison(sync, simulate(config))
    return out


def format_comparison(
    comparisons: dict[tuple[int, int], Comparison], title: str | None = None
) -> str:
    """A table: rows are worker counts, columns staleness bounds.

    A cell is "speedup (mean staleness)", then ", N dropped" when groups were dropped;
    a deadlocked run shows "deadlock @ step k" instead.
    """
    workers = sorted({w for w, _ in comparisons})
    bounds = sorted({b for _, b in comparisons})

    def cell(result: Comparison) -> str:
        a = result.async_
        if a.deadlocked:
            return f"deadlock @ step {a.steps}"
        text = f"{result.speedup:.2f}x ({a.mean_staleness:.2f})"
        return text + (f", {a.dropped} dropped" if a.dropped else "")

    header = ["workers", "sync steps/s"] + [f"alpha={b}" for b in bounds]
    rows = [
        [str(w), f"{comparisons[(w, bounds[0])].sync.steps_per_second:.3f}"]
        + [cell(comparisons[(w, b)]) for b in bounds]
        for w in workers
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [title] if title else []
    for r in [header, *rows]:
        lines.append("  ".join(s.ljust(n) for s, n in zip(r, widths, strict=True)).rstrip())
    return "\n".join(lines)


def format_utilisation(comparisons: dict[tuple[int, int], Comparison], bound: int) -> str:
    """Worker utilisation and learner idle fraction, sync vs async at one bound, per W."""
    header = ["workers", "sync util", "sync idle", f"async util (a={bound})", "async idle"]
    rows = []
    for workers in sorted({w for w, b in comparisons if b == bound}):
        cell = comparisons[(workers, bound)]
        rows.append(
            [str(workers)]
            + [
                f"{x:.2f}"
                for r in (cell.sync, cell.async_)
                for x in (r.worker_utilisation, r.learner_idle_fraction)
            ]
        )
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join(
        "  ".join(s.ljust(n) for s, n in zip(r, widths, strict=True)).rstrip()
        for r in [header, *rows]
    )
