"""Multi-turn episodes with a slow tool: sync vs async episodes/s, measured and simulated.

    python benchmarks/tool_episodes.py [--rounds 3] [--steps 6] [--smoke] [--no-pinned]

The `calculator` preset (its warm start calls the calculator about twice an episode), with
the tool of `slow_tools.py`: each call waits a latency drawn from a log-normal (median
50 ms, sigma 1, at most 2 s). Two layouts, one after the other in this process:

  sync   rollout.mode=sync: sample the step's 16 groups of 8 episodes in one call (the
         tools of all 128 episodes overlap with each other and with decoding), then train.
  async-group  rollout.mode=async, one worker thread on the same devices, staleness <= 2,
         one group (8 episodes) a sampler call: tool waits overlap training, but only 8
         episodes wait for their tools at a time.
  async-batch  the same with the step's 16 groups in one sampler call
         (`rollout.groups_per_call=16`), as many episodes in flight as sync.

Steps are the loop's own (`Run.step`): one compiling step, `--steps` untimed, then
`--rounds` rounds of `--steps` timed steps. Per round: episodes trained per second and
policy tokens trained per second (observation tokens excluded), tool calls per episode and
the tools' mean latency. The medians over rounds are printed, with async / sync.

Shared cores above: worker and learner take turns on the same two cores, so only the tools'
waiting can overlap an update. Then the same episodes on the two real cores split
(`pinned_split.py --workload tools`, one process per layout): `sync` on both cores; `split`,
the learner pinned to core 0 and one Ray rollout actor on core 1 sampling the step's 16
groups in one call; `split-inflight`, the same with in-flight updates (a new version can
land between two turns of an episode). Skipped with `--no-pinned`.

Then the simulation (`simulation.py`, with `tool_calls`) is fed the costs
measured here: the learner step (median of the sync steps), a group's generation without
tool latency (calls of one group with the tool's wait turned off, fitted as a fixed part
plus a part per policy token of its longest episode), the episode lengths (a log-normal
fitted to the sync run's policy tokens per episode), the measured tool calls per episode
(rounded) and the tool's latency distribution. It predicts both granularities: a call of
one group (async-group), and a call of the whole batch as one group of 128 episodes (sync
and async-batch).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# ruff: noqa: E402  (the benchmarks' folder is importable first: the env lives there)
import jax
import numpy as np
import pinned_split
import slow_tools
from async_workload import fit_line
from simulation import LengthDistribution, SimulationConfig, compare_async_to_sync

from gac_jax.rollout import GroupRequest
from gac_jax.train.config import get_preset
from gac_jax.train.config_io import apply_overrides
from gac_jax.train.run import build_run

COMMON = ["env=slow_tools:SlowCalculator", "eval_every=0", "checkpoint_every=0", "samples_every=0"]
ASYNC = ["rollout.mode=async", "buffer.max_staleness=2", "rollout.num_workers=1"]
LAYOUTS = {  # "async-batch" also samples the step's groups in one call (see main).
    "sync": ["rollout.mode=sync"],
    "async-group": ASYNC,
    "async-batch": ASYNC,
}
STALENESS = 2
SMOKE = ["rollout.groups_per_batch=2", "generation.group_size=2", "init=random", "mesh.data=1"]


def measure(name: str, overrides: list[str], args) -> dict:
    steps = 1 + args.steps * (1 + args.rounds)
    config = apply_overrides(get_preset("calculator"), [*COMMON, *overrides, f"steps={steps}"])
    run = build_run(config)
    run.start()
    rounds, learner, lengths, turns = [], [], [], []
    try:
        start = time.perf_counter()
        for step in range(1 + args.steps):
            run.step(step)
        print(f"  {name}: first {1 + args.steps} steps {time.perf_counter() - start:.1f} s")
        for r in range(args.rounds):
            first = 1 + args.steps * (1 + r)
            start = time.perf_counter()
            records = [run.step(s) for s in range(first, first + args.steps)]
            wall = time.perf_counter() - start
            metrics = [m for m, _ in records]
            groups = [g for _, batch in records for g in batch]
            episodes = sum(g.group_size for g in groups)
            calls = sum(g.tool_calls for g in groups)
            row = {
                "episodes_per_s": episodes / wall,
                "policy_tokens_per_s": sum(m["generated_tokens"] for m in metrics) / wall,
                "calls_per_episode": calls / episodes,
                "tool_ms": 1e3 * sum(g.tool_seconds for g in groups) / max(calls, 1),
                "staleness": statistics.mean(m["version_gap_mean"] for m in metrics),
            }
            rounds.append(row)
            learner += [m["generated_tokens"] / m["train_tokens_per_s"] for m in metrics]
            lengths += [int(n) for g in groups for n in g.completion_mask.sum(axis=1)]
            turns += [int(t) for g in groups for t in g.turns]
            print(
                f"    round {r}: {row['episodes_per_s']:.1f} episodes/s, "
                f"{row['policy_tokens_per_s']:.0f} policy tokens/s, "
                f"{row['calls_per_episode']:.2f} tool calls an episode ({row['tool_ms']:.0f} ms "
                f"each), staleness {row['staleness']:.2f}",
                flush=True,
            )
    finally:
        run.close()
    medians = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    out = {"medians": medians, "learner": statistics.median(learner), "lengths": lengths}
    out["turns"] = turns
    if name == "sync":
        out["fit"] = calibrate(run, args.fit_calls)
    return out


def calibrate(run, calls: int) -> tuple[float, float]:
    """(seconds per policy token of the longest episode, fixed seconds) of one group's
    generation with the tool's wait off."""
    slow_tools.SlowCalculator.latency = False
    try:
        params, version = run.store.latest()
        seconds, longest = [], []
        for i in range(calls + 2):  # The first two compile the one-group shapes.
            start = time.perf_counter()
            [group] = run.generator(
                params, version, [GroupRequest(i, 10**6 + i)], jax.random.key(i)
            )
            if i >= 2:
                seconds.append(time.perf_counter() - start)
                longest.append(int(group.completion_mask.sum(axis=1).max()))
        return fit_line(longest, seconds)
    finally:
        slow_tools.SlowCalculator.latency = True


def simulate(sync: dict, config, sim_steps: int) -> None:
    per_token, fixed = sync["fit"]
    logs = np.log(np.maximum(sync["lengths"], 1))
    lengths = LengthDistribution(
        "lognormal",
        scale=float(np.exp(np.median(logs))),
        shape=max(float(np.std(logs)), 1e-3),
        max_tokens=config.generation.max_new_tokens,
    )
    calls = int(round(statistics.mean(sync["turns"])))
    groups, size = config.rollout.groups_per_batch, config.generation.group_size
    print(
        f"\nSimulated (simulation.py): a group {1e3 * fixed:.1f} ms + "
        f"{1e3 * per_token:.2f} ms per policy token of its longest episode, learner step "
        f"{1e3 * sync['learner']:.0f} ms, lengths {lengths.describe()}, {calls} tool calls "
        f"an episode of {1e3 * slow_tools.MEDIAN_SECONDS:.0f} ms median latency"
    )
    # A call of one group (async-group), and a call of the whole batch as one group of
    # groups x size episodes (sync and async-batch).
    for name, batch, group in (
        ("a group a call", groups, size),
        ("a batch a call", 1, groups * size),
    ):
        _predict(name, per_token, fixed, sync["learner"], lengths, calls, batch, group, sim_steps)


def _predict(name, per_token, fixed, train, lengths, calls, groups, size, sim_steps) -> None:
    base = SimulationConfig(
        groups_per_batch=groups,
        group_size=size,
        token_seconds=per_token,
        group_overhead_seconds=fixed,
        train_seconds=train,
        lengths=lengths,
        num_steps=sim_steps,
        tool_calls=calls,
        tool_latency_seconds=slow_tools.MEDIAN_SECONDS,
        tool_latency_sigma=slow_tools.SIGMA,
        capacity=2 * groups,
    )
    cell = compare_async_to_sync(base, (STALENESS,), (1,))[(1, STALENESS)]
    episodes = groups * size
    print(
        f"  predicted, {name}: sync {cell.sync.steps_per_second * episodes:.1f} episodes/s, "
        f"async {cell.async_.steps_per_second * episodes:.1f}, async / sync {cell.speedup:.2f}x"
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--smoke", action="store_true", help="every path once, tiny sizes")
    parser.add_argument("--no-pinned", action="store_true", help="skip the two-core split")
    args = parser.parse_args(argv)
    extra = SMOKE if args.smoke else []
    if args.smoke:
        args.rounds, args.steps = 1, 1
    args.fit_calls = 4 if args.smoke else 24
    started = time.perf_counter()
    print(
        f"calculator preset, tool latency log-normal median "
        f"{1e3 * slow_tools.MEDIAN_SECONDS:.0f} ms sigma {slow_tools.SIGMA} (at most "
        f"{slow_tools.MAX_SECONDS:g} s); {args.rounds} rounds of {args.steps} steps",
        flush=True,
    )
    config = apply_overrides(get_preset("calculator"), [*COMMON, *extra])
    batch = [f"rollout.groups_per_call={config.rollout.groups_per_batch}"]
    results = {
        name: measure(name, [*o, *extra, *(batch if name == "async-batch" else [])], args)
        for name, o in LAYOUTS.items()
    }
    print(f"\nMedians over {args.rounds} rounds of {args.steps} steps")
    sync = results["sync"]["medians"]
    for name, r in results.items():
        m = r["medians"]
        print(
            f"  {name:<11} {m['episodes_per_s']:6.1f} episodes/s  {m['policy_tokens_per_s']:6.0f} "
            f"policy tokens/s  {m['episodes_per_s'] / sync['episodes_per_s']:.2f}x sync  "
            f"tool calls/episode {m['calls_per_episode']:.2f}  staleness {m['staleness']:.2f}"
        )
    simulate(results["sync"], config, 50 if args.smoke else 2_000)
    if not args.no_pinned:
        print("\nTwo real cores (benchmarks/pinned_split.py --workload tools)", flush=True)
        pinned = pinned_split.run_layouts("tools", args.rounds, args.steps, args.smoke)
        print(f"\nTwo cores: medians over {args.rounds} round(s) of {args.steps} steps")
        pinned_split.print_layouts(pinned, episodes=True)
    print(f"\nbenchmark wall time {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
