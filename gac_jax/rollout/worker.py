"""Rollout generation: prompt order, and the worker threads of asynchronous mode."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import jax
import numpy as np

from gac_jax._validation import check_choice, check_int
from gac_jax.rollout.buffer import RolloutBuffer, RolloutBufferClosed
from gac_jax.rollout.param_store import ParamStore
from gac_jax.rollout.record import Rollout
from gac_jax.rollout.staleness import oldest_allowed_version

logger = logging.getLogger(__name__)

VERSION_CHOICES = ("latest", "oldest_allowed")


def check_version_choice(version_choice: str, stale_policy: str | None = None) -> None:
    """The one check of a `version_choice` (and, given the buffer's `stale_policy`, that
    "oldest_allowed" has the block policy it needs): ValueError in one line."""
    check_choice("version_choice", version_choice, VERSION_CHOICES)
    if stale_policy is not None and version_choice == "oldest_allowed" and stale_policy != "block":
        raise ValueError(
            "version_choice='oldest_allowed' needs the buffer's stale_policy='block', got "
            f"{stale_policy!r}."
        )


# How often blocked workers look up to see whether they were asked to stop (a newly
# published version wakes them at once: see `RolloutWorker._reserve`).
_POLL_SECONDS = 0.05


class GroupRequest(NamedTuple):
    """One group to generate: which prompt, and the group's unique id."""

    prompt_id: int
    group_id: int


class GenerateGroups(Protocol):
    """Samples and scores GRPO groups: the only model-facing call of the rollout system.

    Given params of `version`, returns one `Rollout` per request, in order. Several groups
    share one sampler call (one batch), so `key` is per call; callers derive it from the
    first group id, which keeps every mode reproducible.
    """

    def __call__(
        self, params: Any, version: int, requests: Sequence[GroupRequest], key: jax.Array
    ) -> list[Rollout]: ...


class PromptOrder:
    """Deterministic prompt order: epoch after epoch, each a fresh seeded permutation.

    `prompt_id(index)` is a pure function of (seed, index), so lagged mode reproduces the
    same prompts in every run and async mode walks the same sequence.
    """

    def __init__(self, num_prompts: int, seed: int = 0):
        if num_prompts < 1:
            raise ValueError(f"num_prompts={num_prompts} must be >= 1.")
        self.num_prompts = num_prompts
        self.seed = seed
        self._epoch: tuple[int, np.ndarray] | None = None
        self._lock = threading.Lock()

    def prompt_id(self, index: int) -> int:
        epoch, position = divmod(int(index), self.num_prompts)
        with self._lock:
            if self._epoch is None or self._epoch[0] != epoch:
                rng = np.random.default_rng((self.seed, epoch))
                self._epoch = (epoch, rng.permutation(self.num_prompts))
            return int(self._epoch[1][position])


def group_key(seed: int, group_id: int) -> jax.Array:
    """The sampling key of a group: a pure function of (seed, group id)."""
    return jax.random.fold_in(jax.random.key(seed), group_id)


@dataclasses.dataclass(frozen=True)
class GroupNumbering:
    """Which group ids a `RolloutWorker` hands out, in what order, and each one's key.

    Ids run `first_group_id`, `first_group_id + stride`, ... (with P learner processes
    each takes its own residue class mod P), leaving out `skip_group_ids`; a call's
    sampling key is `group_key(seed, first id of the call)`, so a group is a function of its
    id. A resumed run continues from `first_group_id` and skips the ids it handed out.
    """

    first_group_id: int = 0
    skip_group_ids: tuple[int, ...] = ()
    stride: int = 1
    seed: int = 0

    def __post_init__(self):
        # Any iterable of ids is accepted; a tuple keeps the frozen value hashable.
        object.__setattr__(self, "skip_group_ids", tuple(int(g) for g in self.skip_group_ids))
        if self.stride < 1:
            raise ValueError(f"group_id_stride={self.stride} must be >= 1.")

    def key(self, group_id: int) -> jax.Array:
        """The sampling key of a call whose first group is `group_id`."""
        return group_key(self.seed, group_id)


class RolloutWorker:
    """Threads that keep the buffer full with groups sampled from the latest params.

    Each thread: reserve `groups_per_call` slots (the block policy may make it wait; the
    store's publish wakes it), read the params (`version_choice`), claim the next group
    ids and their prompts, generate them in one call, put them. An exception in
    `generate_groups` fails the buffer, so the learner's next `take` raises it at once;
    `stop()` ends every thread within a poll interval (plus the call in progress).
    `state()` is what a resumed worker continues from (see `AsyncRollouts.state`).

    `groups_per_call` groups are one sampler batch; `numbering` hands out the group ids
    and their sampling keys (`GroupNumbering`). `version_choice`: "latest" samples with the
    newest published version (timing decides); "oldest_allowed" with the oldest one the
    block policy allows for the call's last slot (`staleness.oldest_allowed_version`), so
    one thread's run is a function of the seed (needs a store history of max_staleness + 1).
    """

    def __init__(
        self,
        generate_groups: GenerateGroups,
        store: ParamStore,
        buffer: RolloutBuffer,
        prompts: PromptOrder,
        *,
        num_threads: int = 1,
        groups_per_call: int = 1,
        numbering: GroupNumbering = GroupNumbering(),
        version_choice: str = "latest",
    ):
        check_version_choice(version_choice, buffer.stale_policy)
        check_int("num_threads", num_threads, 1)
        check_int("groups_per_call", groups_per_call, 1)
        self._stride = numbering.stride
        self._generate = generate_groups
        self._groups_per_call = groups_per_call
        self._store = store
        self._buffer = buffer
        self._prompts = prompts
        self._key = numbering.key
        self._version_choice = version_choice
        self._next_group = numbering.first_group_id
        self._skip = {g for g in numbering.skip_group_ids if g >= numbering.first_group_id}
        self._pending: set[int] = set()  # Claimed, not yet put.
        self._counter_lock = threading.Lock()
        self._unsubscribe = None
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, name=f"rollout-worker-{i}", daemon=True)
            for i in range(num_threads)
        ]

    def start(self) -> RolloutWorker:
        self._unsubscribe = self._store.subscribe(lambda version: self._buffer.wake())
        for thread in self._threads:
            thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Asks every thread to stop and waits for them (up to `timeout` seconds)."""
        self._stop.set()
        if self._unsubscribe is not None:
            self._unsubscribe()
        for thread in self._threads:
            thread.join(timeout)

    def state(self) -> dict:
        """Group numbering: the next id to claim, the ids claimed but not yet put (in flight
        or lost with a stopped thread), and the skipped ids not yet reached."""
        with self._counter_lock:
            return {
                "next_group_id": self._next_group,
                "pending_group_ids": sorted(self._pending),
                "skip_group_ids": sorted(g for g in self._skip if g >= self._next_group),
            }

    @property
    def alive(self) -> bool:
        return any(thread.is_alive() for thread in self._threads)

    def _claim_groups(self) -> list[GroupRequest]:
        ids = []
        with self._counter_lock:
            while len(ids) < self._groups_per_call:
                if self._next_group not in self._skip:
                    ids.append(self._next_group)
                self._skip.discard(self._next_group)
                self._next_group += self._stride
            self._pending.update(ids)
        return [GroupRequest(self._prompts.prompt_id(g), g) for g in ids]

    def _reserve(self) -> list[int] | None:
        """Reserves one slot per group of the next call; their places in the consumption
        order, or None if asked to stop first. The version is read inside the buffer's wait,
        which the store's publish wakes (`RolloutBuffer.reserve_slot`)."""
        slots: list[int] = []
        while len(slots) < self._groups_per_call:
            if self._stop.is_set():
                self._buffer.release(len(slots))  # Never to be put.
                return None
            slot = self._buffer.reserve_slot(
                lambda: self._store.latest_version, timeout=_POLL_SECONDS
            )
            if slot is not None:
                slots.append(slot)
        return slots

    def _params(self, slots: list[int]) -> tuple[Any, int]:
        """The params to sample the call with, and their version (see `version_choice`)."""
        if self._version_choice == "latest":
            # Read after the reservation: a newer version is only fresher.
            return self._store.latest()
        version = oldest_allowed_version(
            max(slots), self._buffer.max_staleness, self._buffer.groups_per_batch
        )
        return self._store.get(version), version

    def _run(self) -> None:
        try:
            while (slots := self._reserve()) is not None:
                params, version = self._params(slots)
                requests = self._claim_groups()
                key = self._key(requests[0].group_id)
                rollouts = self._generate(params, version, requests, key)
                for done, (request, rollout) in enumerate(zip(requests, rollouts, strict=True)):
                    while not self._buffer.put(rollout, timeout=_POLL_SECONDS):
                        if self._stop.is_set():
                            self._buffer.release(len(requests) - done)
                            return
                    with self._counter_lock:
                        self._pending.discard(request.group_id)
        except RolloutBufferClosed:
            return
        except BaseException as error:  # noqa: BLE001 - every failure must reach the learner
            logger.exception("rollout worker %s failed", threading.current_thread().name)
            self._buffer.fail(error)
