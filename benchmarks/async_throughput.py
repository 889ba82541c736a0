"""Sync vs async rollouts end to end through the training loop, and the split layout predicted.

    python benchmarks/async_throughput.py [--quick] [--rounds 3] [--steps 8]

One run config (`arithmetic/add2`, random `tiny` model, the sampler with no slot limit, 6
groups of 8 completions per step so that the split learner's 6 devices divide the batch,
buffer staleness bound 2), four rollout settings on 8 fake CPU devices:

  sync             rollout.mode=sync: generate the step's batch, then train on it.
  async shared     rollout.mode=async, placement.devices=0: a worker thread samples on the
                   learner's devices.
  async split      rollout.mode=async, placement.devices=2: the worker samples on its own 2
                   devices, the learner trains on the other 6.
  async in-flight  async split plus rollout.inflight_updates=true,
                   rollout.inflight_chunk_steps=8: the worker swaps to a newly published
                   version between decode chunks.

A random model's completions are not heavy-tailed, so, as `benchmarks/sampler.py` does,
every row of every sampler call gets its own length limit (`max_new_tokens`), drawn from a
clipped log-normal (`LengthDistribution`); the random model's EOS can end a row sooner.

Each setting is built with `gac_jax.train.run.build_run` and stepped with the loop's own
step, `Run.step` (publish, take the batch, update: what `train` runs per step; no
evaluation, no checkpoints). One warm-up step compiles; while it does, an async worker
fills the buffer, so 2 x `--steps` more untimed steps let that head start drain. Then
`--rounds` rounds of `--steps` steps are timed back to back. Per round: trained tokens/s =
completion tokens of the batches trained on / wall time; generated tokens/s = tokens of
the sampler calls that ended in the round / wall time (async workers also make groups that
wait in the buffer); the learner's wait for its batch, the buffer depth after each take
and the mean policy-version gap of the batches (staleness) are averaged over the round's
steps. The medians over rounds are printed.

Then the simulation (`gac_jax.rollout.simulation`) predicts the split layout on
accelerators, where the sampler and the learner each have their own devices: the learner
step's cost (the sync setting's, nothing else running) and the sampler's cost per group
(calls of one group through the sync run's `TaskGroupGenerator`, fitted as a fixed part
plus a part per decode step) go in, with the same heavy-tailed lengths.
"""

from __future__ import annotations

import os

os.environ["JAX_PLATFORMS"] = "cpu"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()

# ruff: noqa: E402  (JAX must see the flags above before it is imported)
import argparse
import dataclasses
import statistics
import textwrap
import threading
import time

import jax
import numpy as np

from gac_jax.rollout import GroupRequest
from gac_jax.rollout.simulation import (
    LengthDistribution,
    SimulationConfig,
    compare_async_to_sync,
    format_comparison,
)
from gac_jax.train.config import TrainConfig
from gac_jax.train.config_io import apply_overrides
from gac_jax.train.run import build_run

GROUP_SIZE, GROUPS_PER_BATCH, MAX_NEW, STALENESS = 8, 6, 128, 2
LENGTHS = LengthDistribution("lognormal", scale=16, shape=1.0, max_tokens=MAX_NEW)
BASE = [
    "task=arithmetic/add2",
    "init=random",
    "model=tiny",
    "eval_every=0",
    "checkpoint_every=0",
    f"generation.group_size={GROUP_SIZE}",
    f"generation.max_new_tokens={MAX_NEW}",
    f"rollout.groups_per_batch={GROUPS_PER_BATCH}",
    f"buffer.max_staleness={STALENESS}",
]
SPLIT = ["rollout.mode=async", "placement.devices=2"]
INFLIGHT = ["rollout.inflight_updates=true", "rollout.inflight_chunk_steps=8"]
VARIANTS = {
    "sync": ["rollout.mode=sync"],
    "async shared": ["rollout.mode=async", "placement.devices=0"],
    "async split": SPLIT,
    "async in-flight": SPLIT + INFLIGHT,
}


@dataclasses.dataclass(frozen=True)
class Call:
    end: float  # time.perf_counter() when the call's outputs were ready.
    seconds: float
    decode_steps: int  # The call's longest completion.
    tokens: int


class HeavyTailedLengths:
    """Wraps a run's sampler: every row of a call gets its own length limit drawn from
    `lengths`, and every call is logged (`calls`)."""

    def __init__(self, sampler, lengths: LengthDistribution, seed: int = 0):
        self._sampler = sampler
        self._lengths = lengths
        self._rng = np.random.default_rng(seed)
        self._lock = threading.Lock()
        self.calls: list[Call] = []

    def __getattr__(self, name):  # max_new_tokens, slots, ...: the wrapped sampler's.
        return getattr(self._sampler, name)

    def __call__(self, graphdef, params, tokens, mask, key, **kwargs):
        return self._logged(self._sampler, graphdef, params, tokens, mask, key, **kwargs)

    def sample_inflight(self, graphdef, params_fn, tokens, mask, key, **kwargs):
        inflight = self._sampler.sample_inflight
        return self._logged(inflight, graphdef, params_fn, tokens, mask, key, **kwargs)

    def _logged(self, fn, graphdef, params, tokens, mask, key, **kwargs):
        with self._lock:
            limits = self._lengths.sample(self._rng, tokens.shape[0]).astype(np.int32)
        start = time.perf_counter()
        out = fn(graphdef, params, tokens, mask, key, max_new_tokens=limits, **kwargs)
        lengths = np.asarray(jax.device_get(out.lengths))  # Waits for the whole call.
        end = time.perf_counter()
        with self._lock:
            self.calls.append(Call(end, end - start, int(lengths.max()), int(lengths.sum())))
        return out


@dataclasses.dataclass
class Measured:
    compile_seconds: float
    rounds: list[dict[str, float]]
    learner_seconds: list[float]  # learner.step per timed step.
    sampler_fit: tuple[float, float] | None = None  # (per decode step, fixed) seconds.

    def median(self, key: str) -> float:
        return statistics.median(r[key] for r in self.rounds)


def build(overrides: list[str], steps: int):
    config = apply_overrides(TrainConfig(steps=steps), BASE + overrides)
    config.validate()
    run = build_run(config)
    sampler = HeavyTailedLengths(run.generator.sampler, LENGTHS, seed=config.seed)
    run.generator.sampler = sampler
    return run, sampler


def time_round(run, sampler, first_step: int, steps: int) -> tuple[dict, list]:
    start = time.perf_counter()
    metrics = [run.step(s)[0] for s in range(first_step, first_step + steps)]
    end = time.perf_counter()
    wall = end - start
    trained = sum(m["generated_tokens"] for m in metrics)
    generated = sum(c.tokens for c in list(sampler.calls) if start < c.end <= end)
    row = {
        "step_seconds": wall / steps,
        "trained_per_s": trained / wall,
        "generated_per_s": generated / wall,
        "wait_seconds": statistics.mean(m["wait_seconds"] for m in metrics),
        "depth": statistics.mean(m["buffer_depth"] for m in metrics),
        "staleness": statistics.mean(m["version_gap_mean"] for m in metrics),
    }
    learner = [m["generated_tokens"] / m["train_tokens_per_s"] for m in metrics]
    return row, learner


def fit_sampler(run, sampler: HeavyTailedLengths, calls: int) -> tuple[float, float]:
    """(seconds per decode step, fixed seconds) of one group, as an async worker calls the
    generator (sampling and scoring), fitted over `calls` calls; nothing else runs in this
    process."""
    params, version = run.store.latest()
    seconds, steps = [], []
    for i in range(calls + 2):  # The first two compile the one-group shapes.
        start = time.perf_counter()
        run.generator(params, version, [GroupRequest(i, 10**6 + i)], jax.random.key(i))
        if i >= 2:
            seconds.append(time.perf_counter() - start)
            steps.append(sampler.calls[-1].decode_steps)
    # Theil-Sen: the median of the pairwise slopes, so a call slowed by another process on
    # the shared cores moves the fit little.
    x, y = np.asarray(steps, float), np.asarray(seconds)
    i, j = np.triu_indices(len(x), k=1)
    distinct = x[i] != x[j]
    slope = float(np.median((y[j] - y[i])[distinct] / (x[j] - x[i])[distinct]))
    intercept = float(np.median(y - slope * x))
    return max(slope, 1e-9), max(intercept, 0.0)


def measure(name: str, run, sampler: HeavyTailedLengths, args) -> Measured:
    run.start()
    try:
        start = time.perf_counter()
        run.step(0)
        measured = Measured(time.perf_counter() - start, [], [])
        settle = 2 * args.steps
        for step in range(1, 1 + settle):
            run.step(step)
        print(
            f"  {name}: compile + first step {measured.compile_seconds:.1f} s, "
            f"then {settle} untimed steps",
            flush=True,
        )
        for r in range(args.rounds):
            first = 1 + settle + r * args.steps
            row, learner = time_round(run, sampler, first, args.steps)
            measured.rounds.append(row)
            measured.learner_seconds.extend(learner)
            print(
                f"    round {r}: {row['step_seconds']:.3f} s/step, trained "
                f"{row['trained_per_s']:.0f} tok/s, generated {row['generated_per_s']:.0f} "
                f"tok/s, wait {row['wait_seconds']:.3f} s/step, depth {row['depth']:.1f}, "
                f"staleness {row['staleness']:.2f}",
                flush=True,
            )
    finally:
        run.close()
    if name == "sync":
        measured.sampler_fit = fit_sampler(run, sampler, args.fit_calls)
    return measured


def print_table(results: dict[str, Measured]) -> None:
    header = ["setting", "s/step", "trained tok/s", "generated tok/s", "vs sync", "wait s/step"]
    header += ["depth", "staleness"]
    sync = results["sync"]
    rows = []
    for name, m in results.items():
        ratio = m.median("trained_per_s") / sync.median("trained_per_s")
        rows.append(
            [
                name,
                f"{m.median('step_seconds'):.3f}",
                f"{m.median('trained_per_s'):.0f}",
                f"{m.median('generated_per_s'):.0f}",
                f"{ratio:.2f}x",
                f"{m.median('wait_seconds'):.3f}",
                f"{m.median('depth'):.1f}",
                f"{m.median('staleness'):.2f}",
            ]
        )
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        print("  ".join(s.ljust(n) for s, n in zip(r, widths, strict=True)).rstrip())


def predict(sync: Measured, sim_steps: int) -> None:
    token_seconds, overhead = sync.sampler_fit
    train = statistics.median(sync.learner_seconds)
    base = SimulationConfig(
        groups_per_batch=GROUPS_PER_BATCH,
        group_size=GROUP_SIZE,
        token_seconds=token_seconds,
        group_overhead_seconds=overhead,
        train_seconds=train,
        lengths=LENGTHS,
        num_steps=sim_steps,
    )
    longest = LENGTHS.sample(np.random.default_rng(0), (10_000, GROUP_SIZE)).max(axis=1)
    generate = GROUPS_PER_BATCH * (overhead + token_seconds * longest.mean())
    print("\nPrediction for the split layout on accelerators (gac_jax.rollout.simulation)")
    print(
        f"  measured: one group (sample + score) {1e3 * overhead:.2f} ms + "
        f"{1e3 * token_seconds:.3f} ms per decode step; learner step {1e3 * train:.1f} ms"
    )
    print(
        f"  lengths: {LENGTHS.describe()}; one step's {GROUPS_PER_BATCH} groups take "
        f"{1e3 * generate:.1f} ms on average, {generate / train:.2f}x the learner step"
    )
    table = compare_async_to_sync(base, (1, STALENESS), (1, 2))
    simulated_sync = 1 / table[(1, STALENESS)].sync.steps_per_second
    print(
        f"  check: simulated sync step {1e3 * simulated_sync:.0f} ms, measured "
        f"{1e3 * sync.median('step_seconds'):.0f} ms (measured sync samples its batch in one call)"
    )
    print(f"  {sim_steps} simulated steps; cell = async / sync steps per second (mean staleness)")
    print(textwrap.indent(format_comparison(table, "block policy, as RolloutBuffer"), "  "))
    speedup = table[(1, STALENESS)].speedup
    verdict = "meets" if speedup >= 1.6 else "misses"
    print(
        f"  async (split) / sync, one sampler, staleness <= {STALENESS}: {speedup:.2f}x "
        f"({verdict} the issue's goal of >= 1.6x; with one sampler the bound is "
        f"(generate + train) / max(generate, train) = "
        f"{(generate + train) / max(generate, train):.2f}x)"
    )
    print(
        "  assumptions: each worker and the learner have their own devices, so neither slows\n"
        "  the other; the costs are the ones measured above (a group takes the fixed part plus\n"
        "  the per-step part times its longest completion; a learner step takes a constant\n"
        "  time), so what decides the speedup is the ratio of a step's generation to its\n"
        "  training, that of the tiny model on this CPU; sync samples its groups one at a time\n"
        "  on the same workers (the real SyncRollouts samples the batch in one call); a group\n"
        "  keeps the version it started with. Not modelled: moving the weights to the sampler\n"
        "  (publishing is free), host work between steps, contention, in-flight updates."
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 round of 3 steps (smoke run)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 3)")
    parser.add_argument("--steps", type=int, default=None, help="steps per round (default 8)")
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.steps = args.steps or (3 if args.quick else 8)
    args.fit_calls = 12 if args.quick else 40
    sim_steps = 300 if args.quick else 2_000
    started = time.perf_counter()
    print(
        f"backend {jax.default_backend()}, {jax.device_count()} devices; "
        f"{' '.join(BASE)}; lengths {LENGTHS.describe()}; "
        f"{args.rounds} round(s) of {args.steps} steps after 1 + {2 * args.steps} untimed",
        flush=True,
    )
    results = {}
    for name, overrides in VARIANTS.items():
        run, sampler = build(overrides, steps=1 + (args.rounds + 2) * args.steps)
        results[name] = measure(name, run, sampler, args)
    print(f"\nMedians over {args.rounds} round(s) of {args.steps} steps:")
    print_table(results)
    print(
        "Caveat: the 8 fake CPU devices share this machine's cores, so split devices cannot\n"
        "show real overlap here: sampler and learner still take turns on the same cores."
    )
    predict(results["sync"], sim_steps)
    print(f"\nbenchmark wall time {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
