"""The demo (`gac-jax demo`, `make demo`): stale rollouts break training, and a cure holds.

The `calculator` preset's tool episodes in laboratory v3's regime (REINFORCE with uncapped
sequence-level importance weights, lr 5e-4, lagged k=16), trained side by side naively and
with VCPO (ESS step scaling, the off-policy optimal baseline). In experiments/RESULTS.md
("The tool task") all 5 naive runs fell to held-out pass@1 0 and all 5 VCPO runs held; in
the demo's pilot (seeds 0, 1, 2) naive fell from 0.190, 0.200, 0.209 to 0.000 after 10
updates, VCPO rose to 0.240, 0.260, 0.276 after 40. The batch reward hides the fall for 16
steps: those batches still come from the old policy.

    result = run_demo("runs/demo")  # runs/demo/{naive,vcpo}/seed0, runs/demo/demo.png
    print(result.line)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NamedTuple, TextIO

from gac_jax.lab.sweeps import RunSpec, SweepProcesses, run_sweep
from gac_jax.train.config import get_preset
from gac_jax.train.config_io import load_config
from gac_jax.train.metrics import read_metrics
from gac_jax.train.plots import describe_config, plot_runs, series

BASE = "calculator"
REGIME = tuple(  # experiments/lab.py's V3_REGIME, lagged at its TOOL_LAG.
    "rollout.mode=lagged rollout.lag=16 optimizer.learning_rate=5e-4 loss.policy_loss=reinforce"
    " loss.correction=tis loss.correction_kwargs.level=sequence"
    " loss.correction_kwargs.cap=10000.0".split()
)
SIZE = ("steps=40", "eval_every=10", "checkpoint_every=0", "samples_every=0")
ARMS = {"naive": (), "VCPO": ("ess={}", "loss.advantage=vcpo")}  # Name -> overrides.
PLOT = "demo.png"
KEYS = ("eval/pass@1", "reward", "ess_ratio")
SMOOTHING = 0.8  # About 5 steps: the naive run's fall in batch reward stays steep.
# A finished arm is kept whatever code made it (`provenance.STALE_RUNS`): the demo shows
# a point, it is not a table that must not mix code versions.
REUSE = "reuse"


class DemoResult(NamedTuple):
    line: str  # The comparison, e.g. "held-out pass@1 ...: naive 0.19 -> 0.00; ...".
    plot: Path
    runs: dict[str, Path]  # Arm -> run directory.
    seconds: float


def demo_specs(seed: int = 0, overrides: Sequence[str] = ()) -> list[RunSpec]:
    """The arms as sweep runs (label: the arm's directory name), `overrides` last."""
    return [
        RunSpec(name.lower(), (*REGIME, *SIZE, *arm, *overrides), seed)
        for name, arm in ARMS.items()
    ]


def comparison(runs: Mapping[str, str | os.PathLike]) -> str:
    """One line: each run's held-out pass@1 before training and at its last evaluation."""
    config = load_config(str(Path(next(iter(runs.values()))) / "config.json"))
    steps, parts = 0, []
    for name, directory in runs.items():
        at, passes = series(read_metrics(directory), "eval/pass@1")
        if not passes:
            raise ValueError(f"{directory} has no held-out pass@1 (eval_every, eval_at_start).")
        steps = at[-1]
        parts.append(f"{name} {passes[0]:.2f} -> {passes[-1]:.2f}")
    stale = f"on rollouts {config.rollout.lag} updates old" if config.rollout.lag else "synchronous"
    return f"held-out pass@1 over {steps} updates {stale}: {'; '.join(parts)}"


def progress(runs: Mapping[str, str | os.PathLike], steps: int) -> str:
    """Where each run is: starting (building, compiling, the first evaluation), or steps
    done and its held-out pass@1 so far."""
    parts = []
    for name, directory in runs.items():
        path = Path(directory) / "metrics.jsonl"
        records = read_metrics(path) if path.is_file() else []
        if not records:
            parts.append(f"{name} starting (compiling, evaluating the start)")
            continue
        passes = " -> ".join(f"{p:.2f}" for p in series(records, "eval/pass@1")[1])
        parts.append(f"{name} step {records[-1]['step'] + 1}/{steps}, pass@1 {passes}")
    return "; ".join(parts)


@contextlib.contextmanager
def _reporting(runs, steps: int, stream: TextIO, every: float):
    """Prints `progress` every `every` seconds while the body runs."""
    stop = threading.Event()

    def report():
        while not stop.wait(every):
            print(f"  {progress(runs, steps)}", file=stream, flush=True)

    thread = threading.Thread(target=report, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def run_demo(
    out: str | os.PathLike = "runs/demo",
    *,
    seed: int = 0,
    jobs: int = 2,
    overrides: Sequence[str] = (),
    stream: TextIO = sys.stdout,
    every: float = 15.0,
) -> DemoResult:
    """Trains the arms into ``out/<arm>/seed<seed>`` (finished ones are kept), plots them
    into ``out/demo.png`` and returns the comparison. With `jobs` > 1 the arms train in
    child processes (`main`) while `progress` is printed to `stream` every `every` seconds.
    `overrides` (``--set`` syntax) apply to every arm after its own."""
    out, started = Path(out), time.monotonic()
    specs = demo_specs(seed, overrides)
    runs = {name: spec.directory(out) for name, spec in zip(ARMS, specs, strict=True)}
    config = specs[0].config(get_preset(BASE, validate=False))
    if jobs > 1:
        logs = f"logs in {out}/process*.log"
        print(f"Training {', '.join(runs)} side by side, {logs}", file=stream, flush=True)
        try:
            with _reporting(runs, config.steps, stream, every):
                _sweep(out, seed, overrides, jobs)
        except RuntimeError as error:
            raise RuntimeError(f"{error} See the {logs}.") from None
    else:
        _sweep(out, seed, overrides, shard="0/1")
    title = f"{config.task}: {describe_config(config)}"
    plot = plot_runs(runs, out / PLOT, KEYS, title=title, smoothing=SMOOTHING)
    return DemoResult(comparison(runs), plot, runs, time.monotonic() - started)


def _sweep(out, seed: int, overrides: Sequence[str], jobs: int = 1, shard=None) -> None:
    """`run_sweep` of the arms: in `jobs` children (``python -m gac_jax.lab.demo ...
    --shard i/jobs``, `main`), or only shard `shard` ("i/n") in this process."""
    argv = ["gac_jax.lab.demo", str(out), "--seed", str(seed), "--set", *overrides]
    processes = SweepProcesses("-m", jobs, argv)  # `-m` as the script: runs the module.
    base = get_preset(BASE, validate=False)
    specs = demo_specs(seed, overrides)
    run_sweep(specs, base, out, processes=processes, shard_arg=shard, stale=REUSE)


def main(argv: Sequence[str] | None = None) -> None:
    """A child of `run_demo`: trains its share (``--shard i/n``) of the arms, its output
    in ``OUT/process<i>.log``."""
    parser = argparse.ArgumentParser(description="One process of `gac-jax demo`.")
    parser.add_argument("out")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", nargs="*", default=[])
    parser.add_argument("--shard", required=True)
    args = parser.parse_args(argv)
    log = Path(args.out) / f"process{args.shard.split('/')[0]}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as file:  # Two progress bars on one terminal would be unreadable.
        os.dup2(file.fileno(), 1)
        os.dup2(file.fileno(), 2)
    _sweep(args.out, args.seed, args.set, shard=args.shard)


if __name__ == "__main__":
    main()
