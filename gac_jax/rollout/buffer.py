"""`RolloutBuffer`: bounded, version-aware hand-off of rollout groups to the learner."""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from gac_jax._validation import check_int
from gac_jax.rollout.record import Rollout
from gac_jax.rollout.staleness import (
    STALE_POLICIES,
    check_staleness_settings,
    held_after_drop,
    reservation_allowed,
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


BATCHES_HELD = 2  # The buffer's capacity when none is configured, in batches.


def buffer_capacity(capacity: int | None, groups_per_batch: int) -> int:
    """The groups a buffer holds: `capacity`, or `BATCHES_HELD` batches when None."""
    return capacity or BATCHES_HELD * groups_per_batch


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
        check_int("max_staleness", self.max_staleness, allow_none=True)
        check_staleness_settings(self.max_staleness, self.stale_policy)
        check_int("capacity", self.capacity, 1, allow_none=True)
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
    filtered: int  # Groups discarded by dynamic sampling (every reward the same).
    depth: int  # Groups waiting now.
    reserved: int  # Generation slots granted (block policy bookkeeping).
    staleness_histogram: dict[int, int]  # Learner version - group version, at consumption.


class RolloutBuffer:
    """A bounded FIFO of `Rollout` groups with a staleness bound (ROLL Flash's alpha).

    Groups are atomic. `take` never returns a group whose staleness exceeds
    `max_staleness`: it drops (and counts) the older ones. Under the "block" policy,
    producers also `reserve` a slot before generating, granted only while a group started
    now cannot be consumed too late (AReaL's rule; the rules are the pure functions of
    `gac_jax.rollout.staleness`). A reservation is held until its group is put, or given
    back with `release()`; one never given back keeps its place in the consumption order
    for good (at max_staleness 0 the pipeline can stall).

    `close()` wakes every waiter (they raise `RolloutBufferClosed`); `fail(exc)` does the
    same with `RolloutWorkerError`, so a worker's crash reaches the learner at once.

    Dynamic sampling (DAPO, arXiv 2503.14476): with `max_filtered`, `put` discards (and
    counts) a group whose rewards are all equal (no GRPO gradient) while fewer than
    `max_filtered` were discarded since the last batch was taken; past that every group is
    kept, so a collapsed policy still trains. A discarded group gives its reservation back.

    `capacity` (>= groups_per_batch) bounds the groups held (`put` blocks when full);
    `max_staleness` None: no bound; `max_filtered` None: no dynamic sampling.
    """

    def __init__(
        self,
        capacity: int,
        groups_per_batch: int,
        max_staleness: int | None = None,
        stale_policy: str = "drop",
        max_filtered: int | None = None,
    ):
        check_int("max_filtered", max_filtered, 0, allow_none=True)
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
        self.max_filtered = max_filtered
        self._filtered = self._filtered_since_take = 0
        self._queue: collections.deque[Rollout] = collections.deque()
        self._lock = threading.Condition()
        self._closed = False
        self._error: BaseException | None = None
        self._produced = self._consumed = self._dropped = self._reserved = 0
        self._histogram: collections.Counter[int] = collections.Counter()

    def reserve(
        self, version: int | Callable[[], int | None], timeout: float | None = None
    ) -> bool:
        """Whether a slot was granted by `reserve_slot` before `timeout`."""
        return self.reserve_slot(version, timeout) is not None

    def reserve_slot(
        self, version: int | Callable[[], int | None], timeout: float | None = None
    ) -> int | None:
        """Waits for a generation slot for params of `version` (block policy; free
        otherwise); returns its place in the consumption order (0-based), or None on
        timeout; raises `RolloutBufferClosed` once closed.

        `version` may be a function returning the latest published version (None: nothing
        yet), read again each time a waiter wakes (`wake()`, on each publish), so a slot
        that opens with a new version is granted at once. The group of slot j may be
        sampled by any version from `staleness.oldest_allowed_version(j, ...)` on.
        """

        def granted() -> bool:
            latest = version() if callable(version) else version
            return latest is not None and reservation_allowed(
                self._reserved,
                latest,
                max_staleness=self.max_staleness,
                groups_per_batch=self.groups_per_batch,
                stale_policy=self.stale_policy,
            )

        with self._lock:
            ok = self._lock.wait_for(lambda: self._closed or granted(), timeout)
            self._check_open()
            if not ok:
                return None
            self._reserved += 1
            return self._reserved - 1

    def release(self, count: int = 1) -> None:
        """Gives back `count` reservations whose groups will never be put."""
        with self._lock:
            if not 0 <= count <= self._reserved:
                raise ValueError(f"count={count} must lie in [0, {self._reserved} reserved].")
            self._reserved -= count
            self._lock.notify_all()

    def wake(self) -> None:
        """Makes every waiter check its condition again (a new version was published)."""
        with self._lock:
            self._lock.notify_all()

    def put(self, rollout: Rollout, timeout: float | None = None) -> bool:
        """Adds a group, waiting while the buffer is full. False on timeout. A group that
        dynamic sampling discards counts as put (True): its producer is done with it."""
        with self._lock:
            if self._discards(rollout):
                self._check_open()
                self._filtered += 1
                self._filtered_since_take += 1
                self._reserved = held_after_drop(self._reserved, 1, self.stale_policy)
                self._lock.notify_all()
                return True
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

    def _discards(self, rollout: Rollout) -> bool:
        """Whether dynamic sampling discards `rollout` (see the class docstring)."""
        if self.max_filtered is None or self._filtered_since_take >= self.max_filtered:
            return False
        rewards = np.asarray(rollout.rewards)
        return bool(np.all(rewards == rewards[0]))

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
                    self._histogram.update(r.staleness(learner_version) for r in outcome.batch)
                    self._consumed += num_groups
                    self._filtered_since_take = 0
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
            self.close()

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
                filtered=self._filtered,
                depth=len(self._queue),
                reserved=self._reserved,
                staleness_histogram=dict(sorted(self._histogram.items())),
            )

    def waiting_group_ids(self) -> list[int]:
        """Group ids of the groups waiting now, oldest first."""
        with self._lock:
            return [rollout.group_id for rollout in self._queue]

    def state(self) -> dict[str, Any]:
        """The counters a resumed buffer continues from (plain ints, JSON-serialisable).

        The groups waiting and the reservations in flight are not carried (a resumed
        buffer's producers generate them again), so the counters read as if those had never
        been produced: produced = consumed + dropped, and the reservations are the consumed
        groups' (block policy) or every produced group's (drop policy), at most those held
        now. The next group reserved is then consumed at step `consumed // groups_per_batch`
        at the earliest, as before.
        """
        with self._lock:
            produced = self._consumed + self._dropped
            return {
                "produced": produced,
                "consumed": self._consumed,
                "dropped": self._dropped,
                "filtered": self._filtered,
                "reserved": min(  # Never more than held: a producer may put unreserved.
                    self._reserved, held_after_drop(produced, self._dropped, self.stale_policy)
                ),
                "staleness_histogram": {int(k): int(v) for k, v in sorted(self._histogram.items())},
            }

    def restore(self, state: Mapping[str, Any]) -> RolloutBuffer:
        """Continues the counters of `state()` on this fresh buffer; returns the buffer.

        Histogram keys may be strings (as a JSON round trip leaves them); a state without
        ``filtered`` (saved before dynamic sampling existed) counts none.
        """
        names = ("produced", "consumed", "dropped", "reserved")
        missing = sorted({*names, "staleness_histogram"} - set(state))
        if missing:
            raise ValueError(f"buffer state lacks {missing}.")
        counts = {name: int(state[name]) for name in names}
        if min(counts.values()) < 0 or counts["produced"] != counts["consumed"] + counts["dropped"]:
            raise ValueError(f"buffer state {counts} must have produced = consumed + dropped >= 0.")
        with self._lock:
            if self._produced or self._reserved or self._queue or self._histogram:
                raise RuntimeError("restore() needs a fresh buffer; this one has been used.")
            self._produced, self._consumed = counts["produced"], counts["consumed"]
            self._dropped, self._reserved = counts["dropped"], counts["reserved"]
            self._filtered = int(state.get("filtered", 0))
            self._histogram = collections.Counter(
                {int(k): int(v) for k, v in state["staleness_histogram"].items()}
            )
        return self
