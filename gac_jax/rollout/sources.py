"""The three ways to feed the learner, behind one call: `source.next_batch(step)`.

- `SyncRollouts`: staleness 0, generate with the params of `step`, then train.
- `LaggedRollouts`: step t trains on groups made by version max(0, t - lag); generated in
  the calling thread with keys and prompts fixed by (seed, step), so runs are
  bit-reproducible. The laboratory for experiments and tests.
- `AsyncRollouts`: `RolloutWorker` threads generate with whatever version was published
  last; the buffer enforces `max_staleness`. With `version_choice="oldest_allowed"`, one
  worker and the block policy, each group's version is fixed by its place in the
  consumption order, so the run is reproducible and resumes exactly.

All three pass the same `Rollout` records through a `RolloutBuffer`, taken out with the
learner's version, so staleness is measured (and bounded) the same way in each. The
learner publishes version `step` before asking for that step's batch.

Each source's `state()` (JSON; a checkpoint stores it) is what `resume_from` continues:
the buffer's counters and, in async mode, the group numbering. Groups waiting or in
flight are generated again on resume (same group ids and prompts, fresh samples).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from gac_jax._validation import check_bool, check_choice, check_int
from gac_jax.rollout.buffer import BufferConfig, BufferStats, RolloutBuffer, buffer_capacity
from gac_jax.rollout.param_store import ParamStore
from gac_jax.rollout.record import Rollout
from gac_jax.rollout.sampling import SampleSettings
from gac_jax.rollout.worker import (
    GenerateGroups,
    GroupNumbering,
    GroupRequest,
    PromptOrder,
    RolloutWorker,
    check_version_choice,
    group_key,
)

ROLLOUT_MODES = ("sync", "lagged", "async")
ROLLOUT_BACKENDS = ("threads", "ray")


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Which rollout source feeds the learner, and how much it generates.

    Attributes:
      mode: "sync", "lagged" or "async" (see the module docstring).
      lag: lagged mode: step t trains on version max(0, t - lag).
      groups_per_batch: prompts per learner step.
      num_workers: async mode: worker threads.
      groups_per_call: async mode: groups each worker generates in one sampler call.
      version_choice: async mode: "latest" (the newest version) or "oldest_allowed" (the
        oldest the staleness bound allows: reproducible with one worker, resumable exactly
        when groups_per_call divides groups_per_batch; block policy). See `RolloutWorker`.
      backend: async mode: "threads" samples in this process (`PlacementConfig`); "ray" in
        `num_workers` Ray actor processes (`RayRolloutPool`, set by `RayConfig`).
      inflight_updates: async mode: a worker swaps to a newly published version between
        decode chunks (PipelineRL); every token records its version, and the staleness
        bound applies to a group's oldest token.
      inflight_chunk_steps: decode steps between two looks at the newest version.
      dynamic_sampling: drop groups whose completions all got one reward (no GRPO
        gradient) and draw replacements (DAPO's dynamic sampling, verl's ``filter_groups``).
      max_draws: with dynamic sampling, a batch draws at most this many times
        groups_per_batch groups; past that, groups without signal are kept.
    """

    mode: str = "lagged"
    lag: int = 0
    groups_per_batch: int = 8
    num_workers: int = 1
    groups_per_call: int = 1
    version_choice: str = "latest"
    backend: str = "threads"
    inflight_updates: bool = False
    inflight_chunk_steps: int = SampleSettings.chunk_steps
    dynamic_sampling: bool = False
    max_draws: int = 4

    def validate(self) -> None:
        """Raises ValueError naming a bad field."""
        check_choice("mode", self.mode, ROLLOUT_MODES)
        check_choice("backend", self.backend, ROLLOUT_BACKENDS)
        check_int("lag", self.lag, 0)
        for name in ("groups_per_batch", "num_workers", "groups_per_call", "inflight_chunk_steps"):
            check_int(name, getattr(self, name), 1)
        check_int("max_draws", self.max_draws, 1)
        check_version_choice(self.version_choice)
        check_bool("dynamic_sampling", self.dynamic_sampling)
        for name in ("backend", "inflight_updates"):
            if getattr(self, name) != getattr(RolloutConfig, name) and self.mode != "async":
                raise ValueError(
                    f"{name}={getattr(self, name)!r} needs mode='async', got mode={self.mode!r}."
                )


def store_history(config: RolloutConfig, buffer: BufferConfig) -> int:
    """Versions the `ParamStore` must keep for `config`'s mode: lag + 1 in lagged mode,
    max_staleness + 1 for async workers that sample the oldest allowed version, else 1."""
    if config.mode == "lagged":
        return config.lag + 1
    if config.mode == "async" and config.version_choice == "oldest_allowed":
        return (buffer.max_staleness or 0) + 1
    return 1


@dataclasses.dataclass(frozen=True)
class Partition:
    """This learner process among all: each makes an equal share of a batch's groups,
    with group ids (and so prompts and keys) no other process uses."""

    process_index: int = 0
    num_processes: int = 1

    def local_groups(self, groups_per_batch: int) -> int:
        """This process's share of `groups_per_batch`; ValueError if it does not divide."""
        if groups_per_batch % self.num_processes:
            raise ValueError(
                f"rollout.groups_per_batch={groups_per_batch} must be a multiple of the "
                f"{self.num_processes} learner processes (each makes an equal share of the "
                "batch)."
            )
        return groups_per_batch // self.num_processes


def make_source(
    config: RolloutConfig,
    buffer: BufferConfig,
    generate_groups: GenerateGroups,
    store: ParamStore,
    prompts: PromptOrder,
    *,
    seed: int = 0,
    resume_from: Mapping[str, Any] | None = None,
    partition: Partition = Partition(),
):
    """The rollout source of `config.mode` (the buffer's settings apply to async mode).

    `resume_from` is a previous source's `state()`, to continue a checkpointed run. With
    several learner processes (`partition`), each source makes `groups_per_batch /
    num_processes` groups per step, with group ids no other process uses.
    """
    args = (generate_groups, store, prompts, config)
    kwargs = dict(seed=seed, resume_from=resume_from, partition=partition)
    if config.mode == "async":
        return AsyncRollouts(*args, buffer, **kwargs)
    return (SyncRollouts if config.mode == "sync" else LaggedRollouts)(*args, **kwargs)


class _Source:
    """What every source is built from, and the `RolloutBuffer` it hands batches through.

    Args:
      generate_groups, store, prompts: as for `RolloutWorker`.
      config: the rollout settings (the class, not `config.mode`, is the mode).
      buffer: the buffer's staleness bound, policy, capacity and take timeout.
      seed: sampling seed.
      resume_from: a previous `state()`: the buffer's counters continue.
      partition: this learner process among all.
    """

    def __init__(
        self,
        generate_groups: GenerateGroups,
        store: ParamStore,
        prompts: PromptOrder,
        config: RolloutConfig,
        buffer: BufferConfig,
        *,
        seed: int = 0,
        resume_from: Mapping[str, Any] | None = None,
        partition: Partition = Partition(),
    ):
        self._generate, self._store, self._prompts = generate_groups, store, prompts
        self._seed, self._partition = seed, partition
        n = partition.local_groups(config.groups_per_batch)
        max_filtered = (config.max_draws - 1) * n if config.dynamic_sampling else None
        self.buffer = RolloutBuffer(
            buffer_capacity(buffer.capacity, n),
            n,
            buffer.max_staleness,
            buffer.stale_policy,
            max_filtered=max_filtered,
        )
        if resume_from is not None:
            self.buffer.restore(resume_from["buffer"])

    def stats(self) -> BufferStats:
        return self.buffer.stats()

    def close(self) -> None:
        self.buffer.close()


class _InlineRollouts(_Source):
    """Generates each step's groups in the calling thread from version max(0, step - lag)
    (`config.lag`); the buffer drops older groups."""

    def __init__(self, generate_groups, store, prompts, config: RolloutConfig, **kwargs):
        self.lag = lag = config.lag
        check_int("lag", lag, 0)
        if store.history < lag + 1:
            raise ValueError(
                f"a lag of {lag} needs a ParamStore history of at least {lag + 1}, got "
                f"{store.history}."
            )
        buffer = BufferConfig(max_staleness=lag, stale_policy="drop")
        super().__init__(generate_groups, store, prompts, config, buffer, **kwargs)
        # Step t's groups are ids [t n, (t + 1) n) of the global batch of n = P x local
        # groups; this process makes its own contiguous share of them.
        # With dynamic sampling (`max_filtered`), each step may draw up to `self._draws`
        # rounds of groups, round r of step t taking ids [(t D + r) n, (t D + r + 1) n).
        n, max_filtered = self.buffer.groups_per_batch, self.buffer.max_filtered
        self._first_id = self._partition.process_index * n
        self._global_groups = self._partition.num_processes * n
        self._draws = 1 if max_filtered is None else 1 + -(-max_filtered // n)

    def behaviour_version(self, step: int) -> int:
        return max(0, step - self.lag)

    def next_batch(self, step: int) -> list[Rollout]:
        version = self.behaviour_version(step)
        n = self.buffer.groups_per_batch
        for draw in range(self._draws):  # One round unless dynamic sampling discards.
            first = (step * self._draws + draw) * self._global_groups + self._first_id
            requests = [
                GroupRequest(self._prompts.prompt_id(g), g) for g in range(first, first + n)
            ]
            key = group_key(self._seed, requests[0].group_id)
            for rollout in self._generate(self._store.get(version), version, requests, key):
                if self.buffer.stats().depth == n:
                    break  # The batch is full: the round's other groups go unused.
                self.buffer.put(rollout)
            if self.buffer.stats().depth == n:
                break
        return self.buffer.take(learner_version=step)

    def state(self) -> dict[str, Any]:
        """The buffer's counters (prompts and keys are functions of the step)."""
        return {"buffer": self.buffer.state()}


class SyncRollouts(_InlineRollouts):
    """On-policy: every step's groups come from the params being trained."""

    def __init__(self, generate_groups, store, prompts, config, **kwargs):
        config = dataclasses.replace(config, lag=0)
        super().__init__(generate_groups, store, prompts, config, **kwargs)


class LaggedRollouts(_InlineRollouts):
    """Deterministic asynchrony: step t trains on groups sampled by version max(0, t - lag)."""


class AsyncRollouts(_Source):
    """Real concurrency: worker threads (`RolloutWorker`: `config.num_workers`,
    `groups_per_call`, `version_choice`), a bounded buffer, a staleness bound. With several
    learner processes, this one's group ids are those congruent to `process_index` mod
    `num_processes`; a resumed source (`resume_from`) generates exactly the groups the run
    had not handed to the learner (see `state`). Arguments: see `_Source`.
    """

    def __init__(self, generate, store, prompts, config, buffer, *, resume_from=None, **kw):
        super().__init__(generate, store, prompts, config, buffer, resume_from=resume_from, **kw)
        self._stride = self._partition.num_processes
        first, skip = self._partition.process_index, ()
        if resume_from is not None:
            first, skip = int(resume_from["next_group_id"]), resume_from["skip_group_ids"]
        self._take_timeout = buffer.take_timeout
        self.worker = RolloutWorker(
            generate,
            store,
            self.buffer,
            prompts,
            num_threads=config.num_workers,
            groups_per_call=config.groups_per_call,
            numbering=GroupNumbering(first, skip, stride=self._stride, seed=self._seed),
            version_choice=config.version_choice,
        ).start()

    def next_batch(self, step: int) -> list[Rollout]:
        return self.buffer.take(learner_version=step, timeout=self._take_timeout)

    def state(self) -> dict[str, Any]:
        """What a resumed source continues from (the module docstring says what is carried);
        call it between steps (or after `close`).

        `next_group_id` is the oldest group waiting or in flight (claimed by a worker, not
        yet put), or the worker's next id, and `skip_group_ids` lists the ids after it that
        were already handed out (consumed or dropped), so no group is trained on twice and
        none is skipped.
        """
        # The worker first: a group put meanwhile is then in its pending ids, the buffer's,
        # or both, never in neither (groups leave the buffer only in this thread's `take`).
        worker = self.worker.state()
        pending = set(worker["pending_group_ids"]) | set(self.buffer.waiting_group_ids())
        claimed = worker["next_group_id"]
        first = min(pending, default=claimed)
        handed_out = [g for g in range(first, claimed, self._stride) if g not in pending]
        return {
            "buffer": self.buffer.state(),
            "next_group_id": first,
            "skip_group_ids": handed_out + worker["skip_group_ids"],
        }

    def close(self) -> None:
        """Closes the buffer (waking every producer) and joins the worker threads."""
        super().close()
        self.worker.stop()
