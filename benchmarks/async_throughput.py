"""Sync vs async rollouts end to end through the training loop: on the shared fake devices,
on two real cores (pinned split), and as the simulation predicts each.

    python benchmarks/async_throughput.py [--quick | --smoke] [--rounds 3] [--steps 8]
        [--only fake-devices|pinned]

The workload (`async_workload.py`): `arithmetic/add2`, random `tiny` model, 6 groups of 8
completions per step, staleness bound 2, one sequence decoding at a time
(`generation.slots=1`), and every row of every sampler call with its own length limit
drawn from a clipped log-normal (median 32, sigma 1, at most 128 tokens), the heavy tail
of RL completions (the random model's EOS can end a row sooner). On this CPU it makes a
step's generation take about as long as its update.

Part 1, shared cores: four rollout settings on 8 fake CPU devices in this process:

  sync             rollout.mode=sync: generate the step's batch, then train on it.
  async shared     rollout.mode=async, placement.devices=0: a worker thread samples on the
                   learner's devices.
  async split      rollout.mode=async, placement.devices=2: the worker samples on its own 2
                   devices, the learner trains on the other 6.
  async in-flight  async split plus rollout.inflight_updates=true,
                   rollout.inflight_chunk_steps=16: the worker swaps to a newly published
                   version between decode chunks.

The 8 fake devices share the machine's two cores, so nothing overlaps: these say what the
code costs, not what asynchrony buys. Each setting is built with `build_run` and stepped
with the loop's own step, `Run.step`. One warm-up step compiles; 2 x `--steps` untimed steps
let an async worker's head start drain; then `--rounds` rounds of `--steps` steps are timed.
Per round: trained tokens/s = completion tokens trained on / wall time; generated tokens/s
= tokens of the sampler calls that ended in the round / wall time; the learner's wait, the
buffer depth and the staleness are averaged over the round's steps. Medians over rounds.
Then the simulation (`simulation.py`) is fed the costs measured here (the sync
learner step; a group's sampling, fitted as a fixed part plus a part per decode step) and
predicts the split layout where sampler and learner each have their own devices.

Part 2, two real cores (`pinned_split.py`, one process per layout): sync on both cores
against the learner pinned to core 0 and one Ray rollout actor pinned to core 1, without
and with in-flight updates; trained tokens/s, the overlap achieved (both sides busy at
once, from their own timestamps), the staleness histogram, the weight transfer per version.
Then the simulation is fed the costs measured in the pinned split, and its prediction is
printed beside the measured split.

`--smoke` runs every path once (1 round of 1 step, completions of at most 8 tokens); a test
runs it, so the benchmark cannot rot unseen.
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
import sys
import textwrap
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pinned_split
from async_workload import (
    BASE,
    GROUP_SIZE,
    GROUPS_PER_BATCH,
    LENGTHS,
    SMOKE,
    SMOKE_LENGTHS,
    STALENESS,
    HeavyTailedLengths,
    fit_line,
)
from simulation import (
    LengthDistribution,
    SimulationConfig,
    compare_async_to_sync,
    format_comparison,
)

from gac_jax.rollout import GroupRequest
from gac_jax.train.config import TrainConfig
from gac_jax.train.config_io import apply_overrides
from gac_jax.train.run import build_run

SPLIT = ["rollout.mode=async", "placement.devices=2"]
INFLIGHT = ["rollout.inflight_updates=true", "rollout.inflight_chunk_steps=16"]
VARIANTS = {
    "sync": ["rollout.mode=sync"],
    "async shared": ["rollout.mode=async", "placement.devices=0"],
    "async split": SPLIT,
    "async in-flight": SPLIT + INFLIGHT,
}


@dataclasses.dataclass
class Measured:
    compile_seconds: float
    rounds: list[dict[str, float]]
    learner_seconds: list[float]  # learner.step per timed step.
    sampler_fit: tuple[float, float] | None = None  # (per decode step, fixed) seconds.

    def median(self, key: str) -> float:
        return statistics.median(r[key] for r in self.rounds)


def build(overrides: list[str], steps: int, smoke: bool):
    config = apply_overrides(TrainConfig(steps=steps), BASE + overrides + (SMOKE if smoke else []))
    config.validate()
    run = build_run(config)
    lengths = SMOKE_LENGTHS if smoke else LENGTHS
    sampler = HeavyTailedLengths(run.generator.sampler, lengths, seed=config.seed)
    run.generator.sampler = sampler
    return run, sampler


def time_round(run, sampler, first_step: int, steps: int) -> tuple[dict, list]:
    start = time.time()  # The sampler logs its calls on the wall clock.
    metrics = [run.step(s)[0] for s in range(first_step, first_step + steps)]
    end = time.time()
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
    return fit_line(steps, seconds)


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


def simulate_split(token_seconds, overhead, train, lengths, sim_steps):
    """The simulation's sync and async (one sampler, staleness <= STALENESS) runs for these
    costs; also one step's mean generation time."""
    base = SimulationConfig(
        groups_per_batch=GROUPS_PER_BATCH,
        group_size=GROUP_SIZE,
        token_seconds=token_seconds,
        group_overhead_seconds=overhead,
        train_seconds=train,
        lengths=lengths,
        num_steps=sim_steps,
    )
    longest = lengths.sample(np.random.default_rng(0), (10_000, GROUP_SIZE)).max(axis=1)
    generate = GROUPS_PER_BATCH * (overhead + token_seconds * longest.mean())
    return compare_async_to_sync(base, (1, STALENESS), (1, 2)), generate


def predict(sync: Measured, sim_steps: int, lengths: LengthDistribution) -> None:
    token_seconds, overhead = sync.sampler_fit
    train = statistics.median(sync.learner_seconds)
    table, generate = simulate_split(token_seconds, overhead, train, lengths, sim_steps)
    print("\nSimulated: the split layout fed the costs measured on the shared fake devices")
    print(
        f"  measured: one group (sample + score) {1e3 * overhead:.2f} ms + "
        f"{1e3 * token_seconds:.3f} ms per decode step; learner step {1e3 * train:.1f} ms"
    )
    print(
        f"  lengths: {lengths.describe()}; one step's {GROUPS_PER_BATCH} groups take "
        f"{1e3 * generate:.1f} ms on average, {generate / train:.2f}x the learner step"
    )
    simulated_sync = 1 / table[(1, STALENESS)].sync.steps_per_second
    print(
        f"  check: simulated sync step {1e3 * simulated_sync:.0f} ms, measured "
        f"{1e3 * sync.median('step_seconds'):.0f} ms (measured sync samples its batch in one call)"
    )
    print(f"  {sim_steps} simulated steps; cell = async / sync steps per second (mean staleness)")
    print(textwrap.indent(format_comparison(table, "block policy, as RolloutBuffer"), "  "))
    speedup = table[(1, STALENESS)].speedup
    print(
        f"  async (split) / sync, one sampler, staleness <= {STALENESS}: {speedup:.2f}x "
        f"(with one sampler the bound is (generate + train) / max(generate, train) = "
        f"{(generate + train) / max(generate, train):.2f}x)"
    )
    print(
        "  assumptions: each worker and the learner have their own devices, so neither slows\n"
        "  the other; a group takes the fixed part plus the per-step part times its longest\n"
        "  completion, a learner step a constant time; sync samples its groups one at a time\n"
        "  on the same workers (the real SyncRollouts samples the batch in one call); a group\n"
        "  keeps the version it started with. Not modelled: moving the weights to the sampler\n"
        "  (publishing is free), host work between steps, contention, in-flight updates."
    )


def print_pinned(results: dict[str, dict], sim_steps: int) -> None:
    sync = results["sync"]["medians"]["trained_per_s"]
    pinned_split.print_layouts(results)

    split = results["split"]
    fit = split["group_fit"]
    lengths = LengthDistribution(**split["lengths"])
    train = split["learner_step_seconds"]
    table, generate = simulate_split(
        fit["per_decode_step"], fit["fixed"], train, lengths, sim_steps
    )
    cell = table[(1, STALENESS)]
    tokens = split["medians"]["tokens_per_step"]
    measured = split["medians"]["trained_per_s"]
    print("\nSimulated: the split layout fed the costs measured in the pinned split")
    print(
        f"  measured there: one group {1e3 * fit['fixed']:.2f} ms + "
        f"{1e3 * fit['per_decode_step']:.3f} ms per decode step (actor, one core); learner "
        f"step {1e3 * train:.1f} ms (one core); a step's groups {1e3 * generate:.1f} ms, "
        f"{generate / train:.2f}x the learner step"
    )
    print(
        f"  predicted async / sync (both at one-core costs): {cell.speedup:.2f}x; measured "
        f"split / sync on two cores: {measured / sync:.2f}x"
    )
    print(
        f"  predicted split trained tok/s {cell.async_.steps_per_second * tokens:.0f} "
        f"(simulated steps/s x the {tokens:.0f} tokens a measured step trained), measured "
        f"{measured:.0f}; predicted mean staleness {cell.async_.mean_staleness:.2f}, measured "
        f"{split['medians']['staleness']:.2f}"
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 round of 3 steps")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="every path once: 1 round of 1 step, 8-token completions",
    )
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 3)")
    parser.add_argument("--steps", type=int, default=None, help="steps per round (default 8)")
    parser.add_argument(
        "--only", choices=("fake-devices", "pinned"), default=None, help="run one of the two parts"
    )
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (1 if args.quick or args.smoke else 3)
    args.steps = args.steps or (1 if args.smoke else 3 if args.quick else 8)
    args.fit_calls = 4 if args.smoke else 12 if args.quick else 40
    sim_steps = 50 if args.smoke else 300 if args.quick else 2_000
    lengths = SMOKE_LENGTHS if args.smoke else LENGTHS
    started = time.perf_counter()
    print(
        f"backend {jax.default_backend()}, {jax.device_count()} devices; "
        f"{' '.join(BASE + (SMOKE if args.smoke else []))}; lengths {lengths.describe()}; "
        f"{args.rounds} round(s) of {args.steps} steps after 1 + {2 * args.steps} untimed",
        flush=True,
    )
    if args.only != "pinned":
        results = {}
        for name, overrides in VARIANTS.items():
            run, sampler = build(overrides, 1 + (args.rounds + 2) * args.steps, args.smoke)
            results[name] = measure(name, run, sampler, args)
        print(
            f"\nShared cores, 8 fake devices: medians over {args.rounds} round(s) of "
            f"{args.steps} steps"
        )
        print_table(results)
        print(
            "Caveat: the 8 fake CPU devices share this machine's cores, so split devices cannot\n"
            "show real overlap here: sampler and learner still take turns on the same cores."
        )
        predict(results["sync"], sim_steps, lengths)
    if args.only != "fake-devices":
        print(
            "\nReal split on two cores (benchmarks/pinned_split.py, one process per layout)",
            flush=True,
        )
        pinned = pinned_split.run_layouts("arithmetic", args.rounds, args.steps, args.smoke)
        print(f"\nTwo cores: medians over {args.rounds} round(s) of {args.steps} steps")
        print_pinned(pinned, sim_steps)
    print(f"\nbenchmark wall time {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
