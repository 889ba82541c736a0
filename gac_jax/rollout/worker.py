"""Rollout generation: prompt order, and the worker threads of asynchronous mode."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

import jax
import numpy as np

from gac_jax.rollout.buffer import RolloutBuffer, RolloutBufferClosed
from gac_jax.rollout.param_store import ParamStore
from gac_jax.rollout.record import Rollout

logger = logging.getLogger(__name__)

# How often blocked workers look up to see whether they were asked to stop.
_POLL_SECONDS = 0.05


class GenerateGroup(Protocol):
    """Samples and scores one GRPO group: the only model-facing call of the rollout system."""

    def __call__(
        self, params: Any, version: int, prompt_id: int, group_id: int, key: jax.Array
    ) -> Rollout: ...


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


class RolloutWorker:
    """Threads that keep the buffer full with groups sampled from the latest params.

    Each thread: take the next group id (a shared counter) and its prompt, reserve a slot
    (the buffer's block policy may make it wait), read the newest params, generate, put.
    An exception in `generate_group` fails the buffer, so the learner's next `take` raises
    it as `RolloutWorkerError` at once; `stop()` ends every thread within a poll interval
    (plus the group being generated).

    Args:
      generate_group: see `GenerateGroup`.
      store: where the learner publishes params.
      buffer: where groups go.
      prompts: the prompt order.
      num_threads: generation threads.
      seed: sampling seed (group keys are `group_key(seed, group_id)`).
      first_group_id: group ids continue from here (for resumed runs).
    """

    def __init__(
        self,
        generate_group: GenerateGroup | Callable[..., Rollout],
        store: ParamStore,
        buffer: RolloutBuffer,
        prompts: PromptOrder,
        *,
        num_threads: int = 1,
        seed: int = 0,
        first_group_id: int = 0,
    ):
        if num_threads < 1:
            raise ValueError(f"num_threads={num_threads} must be >= 1.")
        self._generate = generate_group
        self._store = store
        self._buffer = buffer
        self._prompts = prompts
        self._seed = seed
        self._next_group = first_group_id
        self._counter_lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, name=f"rollout-worker-{i}", daemon=True)
            for i in range(num_threads)
        ]

    def start(self) -> RolloutWorker:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Asks every thread to stop and waits for them (up to `timeout` seconds)."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout)

    @property
    def alive(self) -> bool:
        return any(thread.is_alive() for thread in self._threads)

    def _claim_group(self) -> int:
        with self._counter_lock:
            group_id = self._next_group
            self._next_group += 1
            return group_id

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._store.wait_for_version(0, timeout=_POLL_SECONDS):
                    continue
                if not self._buffer.reserve(self._store.latest_version, timeout=_POLL_SECONDS):
                    continue
                # Read after the reservation: a newer version is only fresher.
                params, version = self._store.latest()
                group_id = self._claim_group()
                prompt_id = self._prompts.prompt_id(group_id)
                rollout = self._generate(
                    params, version, prompt_id, group_id, group_key(self._seed, group_id)
                )
                while not self._stop.is_set():
                    if self._buffer.put(rollout, timeout=_POLL_SECONDS):
                        break
        except RolloutBufferClosed:
            return
        except BaseException as error:  # noqa: BLE001 - every failure must reach the learner
            logger.exception("rollout worker %s failed", threading.current_thread().name)
            self._buffer.fail(error)
