"""The workload `async_throughput.py` and `pinned_split.py` share: one run config whose
generation and training take comparable time, heavy-tailed completion lengths, a sampler
wrapper that logs every call, the fit of a group's cost, and pinning to cores.

No JAX flags are set here: each script sets its own before JAX starts.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time

import numpy as np
from simulation import LengthDistribution

GROUP_SIZE, GROUPS_PER_BATCH, MAX_NEW, STALENESS = 8, 6, 128, 2
LENGTHS = LengthDistribution("lognormal", scale=32, shape=1.0, max_tokens=MAX_NEW)
BASE = [
    "task=arithmetic/add2",
    "init=random",
    "model=tiny",
    "eval_every=0",
    "checkpoint_every=0",
    f"generation.group_size={GROUP_SIZE}",
    f"generation.max_new_tokens={MAX_NEW}",
    # One sequence decoding at a time: on this CPU that makes a step's generation take about
    # as long as its update (measured by `pinned_split.py --layout sync`'s busy fractions),
    # the regime where a split layout can pay; with more slots the tiny model's decoding is
    # a small fraction of a step.
    "generation.slots=1",
    f"rollout.groups_per_batch={GROUPS_PER_BATCH}",
    f"buffer.max_staleness={STALENESS}",
]
#: The smoke form (`--smoke`): every path, tiny lengths.
SMOKE_LENGTHS = LengthDistribution("lognormal", scale=4, shape=1.0, max_tokens=8)
SMOKE = ["generation.max_new_tokens=8"]


@dataclasses.dataclass(frozen=True)
class Call:
    start: float  # time.time() when the call began (the wall clock: shared by processes).
    end: float  # time.time() when its outputs were ready.
    decode_steps: int  # The call's longest completion.
    tokens: int

    @property
    def seconds(self) -> float:
        return self.end - self.start


class HeavyTailedLengths:
    """Wraps a run's sampler: every row of a call gets its own length limit drawn from
    `lengths` (a random model's completions are not heavy-tailed by themselves; its EOS can
    still end a row sooner), and every call is logged (`calls`)."""

    def __init__(self, sampler, lengths: LengthDistribution, seed: int = 0):
        self._sampler = sampler
        self._lengths = lengths
        self._rng = np.random.default_rng(seed)
        self._lock = threading.Lock()
        self._inflight = threading.local()  # The start of this thread's call in flight.
        self.calls: list[Call] = []

    def __getattr__(self, name):  # max_new_tokens, slots, ...: the wrapped sampler's.
        return getattr(self._sampler, name)

    def __call__(self, graphdef, params, tokens, mask, key, **kwargs):
        return self._logged(self._sampler, graphdef, params, tokens, mask, key, **kwargs)

    # In flight, `EpisodeSampler.sample_inflight` drives the slot API: `prepare` draws the
    # call's limits and logs its start, `run_chunk` its end (the chunk after which no slot
    # is busy). A thread runs one call at a time.
    def prepare(self, tokens, mask, key, **kwargs):
        self._inflight.start = time.time()
        limits = self._limits(tokens.shape[0])
        return self._sampler.prepare(tokens, mask, key, max_new_tokens=limits, **kwargs)

    def run_chunk(self, *args, **kwargs):
        import jax

        slots, progress = self._sampler.run_chunk(*args, **kwargs)
        if int(jax.device_get(progress)[1]) == 0:  # No slot busy: the call's last chunk.
            lengths = np.asarray(jax.device_get(slots.mask_rn)).sum(axis=1)
            self._log(self._inflight.start, lengths)
        return slots, progress

    def _limits(self, rows: int) -> np.ndarray:
        with self._lock:
            return self._lengths.sample(self._rng, rows).astype(np.int32)

    def _log(self, start: float, lengths: np.ndarray) -> None:
        end = time.time()
        with self._lock:
            self.calls.append(Call(start, end, int(lengths.max()), int(lengths.sum())))

    def _logged(self, fn, graphdef, params, tokens, mask, key, **kwargs):
        import jax

        limits = self._limits(tokens.shape[0])
        start = time.time()
        out = fn(graphdef, params, tokens, mask, key, max_new_tokens=limits, **kwargs)
        self._log(start, np.asarray(jax.device_get(out.lengths)))  # Waits for the call.
        return out


def fit_line(x, y) -> tuple[float, float]:
    """(slope, intercept) of y against x by Theil-Sen (the median of pairwise slopes), so a
    call slowed by another process on the shared cores moves the fit little; both >= 0."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    i, j = np.triu_indices(len(x), k=1)
    distinct = x[i] != x[j]
    if not distinct.any():
        return 1e-9, max(float(np.median(y)), 0.0)
    slope = float(np.median((y[j] - y[i])[distinct] / (x[j] - x[i])[distinct]))
    intercept = float(np.median(y - slope * x))
    return max(slope, 1e-9), max(intercept, 0.0)


def pin(cpus) -> None:
    """Pins every thread of this process to `cpus` (threads started later inherit it).
    Call it before JAX starts its CPU client, whose thread pool is sized by the cores this
    process may use."""
    cpus = set(cpus)
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # The thread ended meanwhile.
            pass


def union_seconds(spans, lo: float, hi: float) -> list[tuple[float, float]]:
    """The union of `spans` clipped to [lo, hi], as sorted disjoint spans."""
    clipped = sorted((max(a, lo), min(b, hi)) for a, b in spans if b > lo and a < hi)
    merged: list[tuple[float, float]] = []
    for a, b in clipped:
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def overlap_seconds(first, second) -> float:
    """Seconds two sorted disjoint span lists have in common."""
    total, i, j = 0.0, 0, 0
    while i < len(first) and j < len(second):
        a = max(first[i][0], second[j][0])
        b = min(first[i][1], second[j][1])
        total += max(0.0, b - a)
        if first[i][1] < second[j][1]:
            i += 1
        else:
            j += 1
    return total
