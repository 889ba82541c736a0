"""Generation and training side by side on this machine's two real cores, against
synchronous training on the same two cores.

    python benchmarks/pinned_split.py --layout {sync,split,split-inflight}
        [--workload {arithmetic,tools}] [--rounds 3] [--steps 8] [--smoke] [--json PATH]

One layout per process (`async_throughput.py` and `tool_episodes.py` start one process per
layout), on one JAX CPU device (no fake devices). Workloads: `arithmetic`, that of
`async_workload.py` (tiny random model, `arithmetic/add2`, 6 groups of 8, heavy-tailed
lengths drawn per row, staleness bound 2); `tools`, the multi-turn episodes of
`tool_episodes.py` (the `calculator` preset, its 16 groups of 8 episodes sampled in one
call, the slow calculator of `slow_tools.py`: log-normal latency, median 50 ms), staleness
bound 2. Layouts:

  sync            rollout.mode=sync in one process that may use both cores: generate the
                  step's batch, then train on it, XLA's thread pool over both cores.
  split           rollout.mode=async, rollout.backend=ray, one rollout actor: this process
                  (the learner) pinned to core 0 before JAX starts, the actor pinned to
                  core 1 before it builds its generator. Ray's own processes (started
                  first) may run on either core.
  split-inflight  split with rollout.inflight_updates (the actor swaps to a newly
                  published version between decode chunks of 16 steps, the default).

Steps are the loop's own (`Run.step`). One compiling step, 2 x `--steps` untimed steps,
then `--rounds` rounds of `--steps` timed steps. Per round: trained tokens/s (completion
tokens trained on / wall time), steps/s, the learner's wait for its batch, the overlap
(the fraction of the round's wall time in which the learner was updating and the sampler
was generating at once, from each side's own timestamps on the shared wall clock), each
side's busy fraction, mean staleness. Over all timed steps: the staleness histogram
(learner step - group version, per group trained on), the weight transfer per version
(the learner's host copy and `ray.put`; the actor's fetch and placement), and the costs
the simulation needs: the learner step (median) and a group's generation, fitted as a
fixed part plus a part per decode step of its longest completion (Theil-Sen over the
groups trained on). Printed, and written as JSON with `--json`.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# ruff: noqa: E402  (the layout's JAX flags and cores are set before JAX starts)
import async_workload as workload

LAYOUTS = {
    "sync": ["rollout.mode=sync"],
    "split": ["rollout.mode=async", "rollout.backend=ray", "rollout.num_workers=1"],
    "split-inflight": [
        "rollout.mode=async",
        "rollout.backend=ray",
        "rollout.num_workers=1",
        "rollout.inflight_updates=true",
        "rollout.inflight_chunk_steps=16",
    ],
}
LEARNER_CORE, ACTOR_CORE = 0, 1
BENCHMARKS = Path(__file__).resolve().parent
TOOLS = [  # Over the calculator preset; rollout.groups_per_call is set to the batch's groups.
    "env=slow_tools:SlowCalculator",
    "eval_every=0",
    "checkpoint_every=0",
    "samples_every=0",
    "buffer.max_staleness=2",
]
TOOLS_SMOKE = [
    "rollout.groups_per_batch=2",
    "generation.group_size=2",
    "init=random",
    "generation.max_new_tokens=16",
]


@dataclasses.dataclass(frozen=True)
class PinnedActor:
    """The Ray actor's factory: pins the actor process to `cores`, then builds the run's
    generator (`ActorGenerator`) with heavy-tailed lengths. Picklable."""

    inner: object  # gac_jax.train.build.ActorGenerator
    cores: tuple[int, ...]
    lengths: object
    seed: int

    def __call__(self):
        workload.pin(self.cores)
        generator, place = self.inner()
        if self.lengths is not None:
            sampler = workload.HeavyTailedLengths(generator.sampler, self.lengths, self.seed)
            generator.sampler = sampler
        return generator, place


class TimedCalls:
    """Replaces `owner.<name>` (a method) by itself and records each call's wall-clock
    span: the learner's updates, the sync layout's episode sampling."""

    def __init__(self, owner, name: str):
        self._call = getattr(owner, name)
        self.spans: list[tuple[float, float]] = []
        setattr(owner, name, self)

    def __call__(self, *args, **kwargs):
        start = time.time()
        out = self._call(*args, **kwargs)  # Returns host values: the work has finished.
        self.spans.append((start, time.time()))
        return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=sorted(LAYOUTS), required=True)
    parser.add_argument("--workload", choices=("arithmetic", "tools"), default="arithmetic")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--smoke", action="store_true", help="8-token completions, any sizes")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--set", nargs="*", default=[], help="more config overrides")
    args = parser.parse_args(argv)
    if len(os.sched_getaffinity(0)) < 2:
        sys.exit("pinned_split: needs 2 cores this process may use, got 1.")

    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = " ".join(
        f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f
    )
    split = args.layout != "sync"
    cluster = None
    if args.workload == "tools":  # The actor imports the slow calculator by its path.
        path = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join([str(BENCHMARKS), *([path] if path else [])])
    if split:  # Ray's processes first, unpinned; then this process onto the learner's core.
        from gac_jax.rollout.ray_cluster import LocalRayCluster

        cluster = LocalRayCluster(num_cpus=2).start()
        cluster.connect(log_to_driver=False)
        import ray

        ray.cloudpickle.register_pickle_by_value(workload)
        workload.pin({LEARNER_CORE})
    try:
        return _measure(args, split)
    finally:
        if cluster is not None:
            import ray

            ray.shutdown()
            cluster.stop()


def _measure(args, split: bool) -> dict:
    import jax

    from gac_jax.train.build import ActorGenerator
    from gac_jax.train.config import TrainConfig, get_preset
    from gac_jax.train.config_io import apply_overrides
    from gac_jax.train.run import build_run

    settle = 2 * args.steps
    steps = f"steps={1 + settle + args.rounds * args.steps}"
    if args.workload == "tools":
        lengths, base = None, get_preset("calculator")
        overrides = TOOLS + LAYOUTS[args.layout] + (TOOLS_SMOKE if args.smoke else [])
        groups = apply_overrides(base, [*overrides, *args.set]).rollout.groups_per_batch
        overrides.append(f"rollout.groups_per_call={groups}")
    else:
        lengths, base = workload.SMOKE_LENGTHS if args.smoke else workload.LENGTHS, TrainConfig()
        overrides = workload.BASE + LAYOUTS[args.layout] + (workload.SMOKE if args.smoke else [])
    config = apply_overrides(base, [*overrides, *args.set, steps])
    config.validate()
    run = build_run(config)
    learner = TimedCalls(run.learner, "step")
    factory, sampling = None, None
    if split:
        factory = PinnedActor(ActorGenerator(config), (ACTOR_CORE,), lengths, config.seed)
    elif lengths is None:  # Episodes: time the runner's calls.
        sampling = TimedCalls(run.generator.runner, "sample")
    else:
        run.generator.sampler = workload.HeavyTailedLengths(
            run.generator.sampler, lengths, config.seed
        )
        sampling = run.generator.sampler
    episodes_per_step = config.rollout.groups_per_batch * config.generation.group_size
    print(
        f"[{args.layout}, {args.workload}] cores {sorted(os.sched_getaffinity(0))}, "
        f"{jax.device_count()} {jax.default_backend()} device(s), lengths "
        f"{'the policy' + chr(39) + 's own' if lengths is None else lengths.describe()}",
        flush=True,
    )
    run.start(actor_factory=factory)
    rounds, staleness, groups = [], collections.Counter(), []
    try:
        start = time.perf_counter()
        run.step(0)
        compile_seconds = time.perf_counter() - start
        for step in range(1, 1 + settle):
            run.step(step)
        print(f"  compile + first step {compile_seconds:.1f} s, then {settle} untimed", flush=True)
        for r in range(args.rounds):
            first = 1 + settle + r * args.steps
            t0 = time.time()
            metrics = []
            for step in range(first, first + args.steps):
                m, rollouts = run.step(step)
                metrics.append(m)
                for rollout in rollouts:
                    staleness[step - rollout.policy_version] += 1
                    longest = int(rollout.completion_mask.sum(axis=1).max())
                    groups.append((longest, rollout.generate_seconds))
            t1 = time.time()
            busy = {
                "learner": workload.union_seconds(learner.spans, t0, t1),
                "sampler": workload.union_seconds(_sampler_spans(run, sampling), t0, t1),
            }
            wall = t1 - t0
            row = {
                "trained_per_s": sum(m["generated_tokens"] for m in metrics) / wall,
                "episodes_per_s": args.steps * episodes_per_step / wall,
                "steps_per_s": args.steps / wall,
                "wait_seconds": statistics.mean(m["wait_seconds"] for m in metrics),
                "staleness": statistics.mean(m["version_gap_mean"] for m in metrics),
                "overlap": workload.overlap_seconds(busy["learner"], busy["sampler"]) / wall,
                "learner_busy": sum(b - a for a, b in busy["learner"]) / wall,
                "sampler_busy": sum(b - a for a, b in busy["sampler"]) / wall,
                "tokens_per_step": statistics.mean(m["generated_tokens"] for m in metrics),
            }
            rounds.append(row)
            print(
                f"  round {r}: trained {row['trained_per_s']:.0f} tok/s "
                f"({row['episodes_per_s']:.1f} episodes/s), "
                f"{row['steps_per_s']:.2f} steps/s, wait {row['wait_seconds']:.3f} s/step, "
                f"overlap {row['overlap']:.2f}, busy learner {row['learner_busy']:.2f} "
                f"sampler {row['sampler_busy']:.2f}, staleness {row['staleness']:.2f}",
                flush=True,
            )
        transfer = _transfer(run) if split else None
    finally:
        run.close()
    timed = learner.spans[-args.rounds * args.steps :]
    token_seconds, overhead = workload.fit_line(*zip(*groups, strict=True))
    result = {
        "layout": args.layout,
        "compile_seconds": compile_seconds,
        "rounds": rounds,
        "medians": {k: statistics.median(r[k] for r in rounds) for k in rounds[0]},
        "staleness_histogram": {str(k): v for k, v in sorted(staleness.items())},
        "learner_step_seconds": statistics.median(b - a for a, b in timed),
        "group_fit": {"per_decode_step": token_seconds, "fixed": overhead},
        "transfer": transfer,
        "lengths": None if lengths is None else dataclasses.asdict(lengths),
        "workload": args.workload,
    }
    print(f"  staleness histogram (gap: groups) {result['staleness_histogram']}")
    if transfer:
        print(
            f"  weight transfer per version: put {1e3 * transfer['put_seconds']:.1f} ms "
            f"(learner), fetch + place {1e3 * transfer['fetch_place_seconds']:.1f} ms (actor), "
            f"over {transfer['versions']} versions"
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


def run_layouts(workload_name: str, rounds: int, steps: int, smoke: bool) -> dict[str, dict]:
    """Each layout in its own process (this script), one after the other; their JSON
    results. Only the layouts' own lines are printed (not Ray's or XLA's chatter)."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for layout in LAYOUTS:
            path = Path(tmp) / f"{layout}.json"
            command = [sys.executable, __file__, "--layout", layout, "--json", str(path)]
            command += ["--workload", workload_name, "--rounds", str(rounds)]
            command += ["--steps", str(steps), *(["--smoke"] if smoke else [])]
            done = subprocess.run(
                command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
            lines = [
                line
                for line in done.stdout.splitlines()
                if line.startswith(("[", "  ")) or done.returncode
            ]
            print("\n".join(lines), flush=True)
            if done.returncode:
                raise SystemExit(f"pinned_split.py --layout {layout} failed ({done.returncode})")
            out[layout] = json.loads(path.read_text())
    return out


def print_layouts(results: dict[str, dict], *, episodes: bool = False) -> None:
    """The layouts' medians as a table, against sync by trained tokens/s (or by episodes/s
    with `episodes`), then each layout's staleness histogram and weight transfer."""
    key = "episodes_per_s" if episodes else "trained_per_s"
    sync = results["sync"]["medians"][key]
    header = ["layout", *(["episodes/s"] if episodes else []), "trained tok/s", "vs sync"]
    header += ["steps/s", "wait s/step", "overlap", "busy learner", "busy sampler", "staleness"]
    rows = []
    for name, r in results.items():
        m = r["medians"]
        rows.append(
            [
                name,
                *([f"{m['episodes_per_s']:.1f}"] if episodes else []),
                f"{m['trained_per_s']:.0f}",
                f"{m[key] / sync:.2f}x",
                f"{m['steps_per_s']:.2f}",
                f"{m['wait_seconds']:.3f}",
                f"{m['overlap']:.2f}",
                f"{m['learner_busy']:.2f}",
                f"{m['sampler_busy']:.2f}",
                f"{m['staleness']:.2f}",
            ]
        )
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        print("  ".join(s.ljust(n) for s, n in zip(r, widths, strict=True)).rstrip())
    for name, r in results.items():
        line = f"  {name}: staleness histogram (gap: groups) {r['staleness_histogram']}"
        if r["transfer"]:
            t = r["transfer"]
            line += (
                f"; weights per version: put {1e3 * t['put_seconds']:.1f} ms, "
                f"fetch + place {1e3 * t['fetch_place_seconds']:.1f} ms"
            )
        print(line)


def _sampler_spans(run, sampling) -> list[tuple[float, float]]:
    """The sampler's busy spans: the actor's calls (Ray), or the sampler's own (sync)."""
    if run.rollout_pool is not None:
        return [span for spans in run.rollout_pool.call_intervals() for span in spans]
    if isinstance(sampling, TimedCalls):
        return sampling.spans
    return [(c.start, c.end) for c in sampling.calls]


def _transfer(run) -> dict:
    """Median seconds per version to copy and put the params (learner) and to fetch and
    place them (actor)."""
    puts = list(run.rollout_pool.put_seconds().values())
    fetched = [s for per_actor in run.rollout_pool.transfer_seconds() for _, s in per_actor]
    return {
        "put_seconds": statistics.median(puts),
        "fetch_place_seconds": statistics.median(fetched),
        "versions": len(puts),
    }


if __name__ == "__main__":
    main()
