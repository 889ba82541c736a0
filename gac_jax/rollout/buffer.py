"""`RolloutBuffer`: bounded, version-aware hand-off of rollout groups to the learner."""

from __future__ import annotations

import collections
import dataclasses
import threading
import time

from gac_jax.rollout.record import Rollout
from gac_jax.rollout.staleness import (
    STALE_POLICIES,
    check_staleness_settings,
    held_after_drop,
    reservation_allowed,
    staleness,
    take_fresh,
)

__all__ = [
    "STALE_POLICIES",
    "BufferConfig",
    "BufferStats",
    "RolloutBuffer",
    "RolloutBufferClosed",
    "RolloutWorkerError",
]


@dataclasses.dataclass(frozen=True)
class BufferConfig:
    """The asynchronous mode's buffer (lagged and sync modes bound staleness by their lag).

    Attributes:
      max_staleness: ROLL Flash's alpha, the largest version gap trained on; None for no
        bound (drop policy only).
      stale_policy: "block" (producers wait for a slot that cannot go stale, AReaL's rule)
        or "drop" (stale groups are discarded when a batch is taken).
      capacity: groups the buffer holds; None for two batches.
      take_timeout: seconds the learner waits for a batch before the run fails; None waits
        forever.
    """

    max_staleness: int | None = 1
    stale_policy: str = "block"
    capacity: int | None = None
    take_timeout: float | None = 600.0

    def validate(self) -> None:
        """Raises ValueError naming a bad field."""
        if self.max_staleness is not None and (
            isinstance(self.max_staleness, bool) or not isinstance(self.max_staleness, int)
        ):
            raise ValueError(f"max_staleness={self.max_staleness!r} must be an int or None.")
        check_staleness_settings(self.max_staleness, self.stale_policy)
        if self.capacity is not None and (
            isinstance(self.capacity, bool)
            or not isinstance(self.capacity, int)
            or self.capacity < 1
        ):
            raise ValueError(f"capacity={self.capacity!r} must be an int >= 1 or None.")
        if self.take_timeout is not None and not self.take_timeout > 0:
            raise ValueError(f"take_timeout={self.take_timeout!r} must be > 0 or None.")


class RolloutBufferClosed(RuntimeError):
    """The buffer was closed: no more groups will come (or be accepted)."""


class RolloutWorkerError(RuntimeError):
    """A rollout worker failed; the original exception is the `__cause__`."""


@dataclasses.dataclass(frozen=True)
class BufferStats:
    """A snapshot of the buffer's counters."""

    produced: int  # Groups put.
    consumed: int  # Groups handed to the learner.
    dropped: int  # Groups discarded as too stale.
    depth: int  # Groups waiting now.
    reserved: int  # Generation slots granted (block policy bookkeeping).
    staleness_histogram: dict[int, int]  # Learner version - group version, at consumption.


class RolloutBuffer:
    """A bounded FIFO of `Rollout` groups with a staleness bound (ROLL Flash's alpha).

    Groups are atomic: a batch holds whole groups. `take` never returns a group whose
    staleness (learner version - group's oldest policy version) exceeds `max_staleness`;
    what happens to older groups is the `stale_policy` (the rules are the pure functions of
    `gac_jax.rollout.staleness`, which the pipeline simulation shares):

    - "drop": they are discarded when a batch is taken, and counted.
    - "block": producers call `reserve(version)` before generating and wait until a group
      started now cannot be consumed too late, AReaL's rule: the j-th reserved group (0-based)
      is consumed at learner step j // groups_per_batch at the earliest, so it may start with
      version v only if j < (v + max_staleness + 1) * groups_per_batch. Groups finished out
      of order can still end up stale; `take` drops (and counts) those too.

    `close()` wakes every waiter (they raise `RolloutBufferClosed`); `fail(exc)` does the
    same with `RolloutWorkerError` so a worker's crash reaches the learner at once.

    Args:
      capacity: most groups held at once (>= groups_per_batch); `put` blocks when full.
      groups_per_batch: groups per learner step.
      max_staleness: largest allowed version gap, or None for no bound.
      stale_policy: "drop" or "block".
    """

    def __init__(
        self,
        capacity: int,
        groups_per_batch: int,
        max_staleness: int | None = None,
        stale_policy: str = "drop",
    ):
        if groups_per_batch < 1:
            raise ValueError(f"groups_per_batch={groups_per_batch} must be >= 1.")
        if capacity < groups_per_batch:
            raise ValueError(
                f"capacity={capacity} must be >= groups_per_batch={groups_per_batch}, or a "
                "batch could never be assembled."
            )
        check_staleness_settings(max_staleness, stale_policy)
        self.capacity = capacity
        self.groups_per_batch = groups_per_batch
        self.max_staleness = max_staleness
        self.stale_policy = stale_policy
        self._queue: collections.deque[Rollout] = collections.deque()
        self._lock = threading.Condition()
        self._closed = False
        self._error: BaseException | None = None
        self._produced = self._consumed = self._dropped = self._reserved = 0
        self._histogram: collections.Counter[int] = collections.Counter()

    # ----------------------------------------------------------------------------- producers

    def reserve(self, version: int, timeout: float | None = None) -> bool:
        """Waits for a generation slot for params of `version` (block policy; free otherwise).

        Returns False on timeout; raises `RolloutBufferClosed` once closed.
        """

        def granted() -> bool:
            return reservation_allowed(
                self._reserved,
                version,
                max_staleness=self.max_staleness,
                groups_per_batch=self.groups_per_batch,
                stale_policy=self.stale_policy,
            )

        with self._lock:
            ok = self._lock.wait_for(lambda: self._closed or granted(), timeout)
            self._check_open()
            if not ok:
                return False
            self._reserved += 1
            return True

    def put(self, rollout: Rollout, timeout: float | None = None) -> bool:
        """Adds a group, waiting while the buffer is full. False on timeout."""
        with self._lock:
            ok = self._lock.wait_for(
                lambda: self._closed or len(self._queue) < self.capacity, timeout
            )
            self._check_open()
            if not ok:
                return False
            self._queue.append(rollout)
            self._produced += 1
            self._lock.notify_all()
            return True

    # ----------------------------------------------------------------------------- consumer

    def take(
        self, learner_version: int, num_groups: int | None = None, timeout: float | None = None
    ) -> list[Rollout]:
        """The next `num_groups` (default `groups_per_batch`) groups fresh enough to train on.

        Blocks until they are there. Raises `TimeoutError`, `RolloutBufferClosed` when the
        buffer is closed before enough groups arrive, or `RolloutWorkerError` when a worker
        failed.
        """
        num_groups = self.groups_per_batch if num_groups is None else num_groups
        if not 1 <= num_groups <= self.capacity:
            raise ValueError(f"num_groups={num_groups} must lie in [1, capacity={self.capacity}].")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while True:
                if self._error is not None:  # A crash surfaces at once, not after draining.
                    self._check_open()
                outcome = take_fresh(
                    self._queue,
                    learner_version,
                    num_groups,
                    self.max_staleness,
                    lambda r: r.policy_version,
                )
                self._queue = collections.deque(outcome.kept)
                self._discard(len(outcome.dropped))
                if outcome.batch is not None:
                    for rollout in outcome.batch:
                        self._histogram[staleness(learner_version, rollout.policy_version)] += 1
                    self._consumed += num_groups
                    self._lock.notify_all()
                    return list(outcome.batch)
                self._check_open()
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(
                        f"{len(self._queue)} of {num_groups} groups after {timeout} s."
                    )
                self._lock.wait(remaining)

    def _discard(self, dropped: int) -> None:
        """Counts `dropped` stale groups, already removed, and gives their slots back."""
        if dropped:
            self._dropped += dropped
            self._reserved = held_after_drop(self._reserved, dropped, self.stale_policy)
            self._lock.notify_all()

    # ----------------------------------------------------------------------------- lifecycle

    def close(self) -> None:
        """Stops the buffer: every waiter wakes and raises `RolloutBufferClosed`."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()

    def fail(self, error: BaseException) -> None:
        """Records a worker's failure and closes; waiters raise `RolloutWorkerError`."""
        with self._lock:
            if self._error is None:
                self._error = error
            self._closed = True
            self._lock.notify_all()

    @property
    def closed(self) -> bool:
        with self._lock:
            return self._closed

    def _check_open(self) -> None:
        if self._error is not None:
            raise RolloutWorkerError(f"a rollout worker failed: {self._error!r}") from self._error
        if self._closed:
            raise RolloutBufferClosed("the rollout buffer is closed")

    def stats(self) -> BufferStats:
        with self._lock:
            return BufferStats(
                produced=self._produced,
                consumed=self._consumed,
                dropped=self._dropped,
                depth=len(self._queue),
                reserved=self._reserved,
                staleness_histogram=dict(sorted(self._histogram.items())),
            )
