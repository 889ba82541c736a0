"""Seeded sweeps of GRPO runs: the named methods, resumable execution, per-run summaries.

A sweep is a list of `RunSpec`s (a label, config overrides, a seed). `run_spec` trains one
into ``root/<label>/seed<seed>`` and writes ``summary.json`` there (`summarize_run`'s
numbers and the code version that made it); a run whose summary exists for the same config
is skipped and an interrupted one resumes from its newest checkpoint, so a sweep is
restarted by running it again. experiments/report*.py make the tables.

    specs = [RunSpec(f"{m}/k8", ("rollout.lag=8", *o), seed)
             for m, o in METHODS.items() for seed in (0, 1, 2)]
    summaries = [run_spec(spec, get_preset("countdown_sweep"), "runs/cures") for spec in specs]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

# Re-exported, a sweep's vocabulary: StaleRunError (what it raises), collapse_step, ...
from gac_jax.lab.provenance import StaleRunError, code_version, settle_stale  # noqa: F401
from gac_jax.lab.summary import CollapseRule, collapse_step, cosine_samples, summarize_run  # noqa: F401
from gac_jax.train import train
from gac_jax.train.build import warm_start_directory
from gac_jax.train.config import TrainConfig
from gac_jax.train.config_io import apply_overrides, load_config, run_hash
from gac_jax.train.metrics import read_metrics
from gac_jax.train.warm_start import weights_digest

SUMMARY_FILE = "summary.json"
DEFAULT_RULE = CollapseRule()

# The methods compared under staleness, as config overrides on a base config whose
# objective is PPO-clip against the behaviour policy with GRPO advantages.
METHODS: Mapping[str, tuple[str, ...]] = {
    # Asynchronous GRPO with nothing added (the cosine is still monitored).
    "naive": (),
    # Gradient Alignment Control with the config's thresholds, and with thresholds that
    # follow the run's own cosine statistics.
    "gac": ("gac.monitor_only=false",),
    "gac_adaptive": ("gac.monitor_only=false", "gac.thresholds=adaptive"),
    # VCPO: ESS step scaling (its defaults) and the off-policy minimum-variance baseline.
    "vcpo": ("ess={}", "loss.advantage=vcpo"),
    # M2PO's second-moment token mask.
    "m2po": ("loss.policy_loss=m2po",),
    # BAPO's clip bounds, adapted per batch to balance the positive and negative terms.
    "bapo": ("loss.policy_loss=bapo",),
    # AReaL's decoupled PPO: clip against the proximal policy (the params before the
    # update), importance weight to the behaviour policy.
    "decoupled_ppo": ("loss.policy_loss=decoupled_ppo",),
    "seq_tis": (
        "loss.policy_loss=reinforce",
        "loss.correction=tis",
        "loss.correction_kwargs.level=sequence",
        "loss.correction_kwargs.cap=2.0",
    ),
    "gac_vcpo": ("gac.monitor_only=false", "ess={}", "loss.advantage=vcpo"),
}


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One run of a sweep: `label` names its directory and its row in the tables."""

    label: str
    overrides: tuple[str, ...]
    seed: int

    def config(self, base: TrainConfig) -> TrainConfig:
        return apply_overrides(base, [*self.overrides, f"seed={self.seed}"])

    def directory(self, root: str | os.PathLike) -> Path:
        return Path(root) / self.label / f"seed{self.seed}"


def run_spec(
    spec: RunSpec,
    base: TrainConfig,
    root: str | os.PathLike,
    *,
    rule: CollapseRule = DEFAULT_RULE,
    train_fn: Callable[..., Any] = train,
    stale: str = "refuse",
) -> dict[str, Any]:
    """Trains `spec` (unless its summary already exists) and returns its summary.

    An existing summary of a different config is an error (the directory belongs to
    another experiment); one written by other code (`provenance.same_code`) is settled as
    `stale` says (`provenance.settle_stale`).
    """
    config = spec.config(base)
    out = spec.directory(root)
    path = out / SUMMARY_FILE
    digest = run_hash(config)
    if path.exists():
        summary = json.loads(path.read_text())
        if summary.get("config_hash") != digest or summary.get("config_steps") != config.steps:
            raise ValueError(
                f"{path} was written by another config (hash {summary.get('config_hash')}, "
                f"{summary.get('config_steps')} steps; this one is {digest}, {config.steps} "
                "steps): remove the directory or change the sweep's root."
            )
    settle_stale([path], root, stale=stale)
    if path.exists():
        return json.loads(path.read_text())
    resumed = (out / "metrics.jsonl").exists()
    started = time.monotonic()
    train_fn(config, out, resume=True)
    summary = {
        "label": spec.label,
        "seed": spec.seed,
        "overrides": list(spec.overrides),
        "config_hash": digest,
        "config_steps": config.steps,
        "code": code_version(),
        "init_weights": initial_weights(config),
        "wall_seconds": time.monotonic() - started,
        "resumed": resumed,
        "collapse_rule": rule.describe(),
        **summarize_run(read_metrics(out), rule),
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(summary, indent=2, allow_nan=True))
    tmp.replace(path)  # Written last and atomically: its presence means the run finished.
    return summary


def initial_weights(config: TrainConfig) -> dict[str, str] | None:
    """The starting policy of a warm-started run: its checkpoint directory's name and the
    SHA-256 of its parameters (`weights_digest`), so runs on two machines can be seen to
    start from the same weights. None for other inits."""
    if config.init != "warm_start":
        return None
    directory = warm_start_directory(config)
    return {"warm_start": directory.name, "sha256": weights_digest(directory)}


def shard(specs: Sequence[RunSpec], index: int, count: int) -> list[RunSpec]:
    """Every `count`-th spec starting at `index` (`0 <= index < count`)."""
    if not 0 <= index < count:
        raise ValueError(f"shard index {index} must be in [0, {count}).")
    return list(specs[index::count])


def run_shards_in_processes(argv: Sequence[str], jobs: int) -> None:
    """Runs ``python argv... --shard i/jobs`` for each i in parallel, each process on one
    CPU thread (XLA's intra-op pool of 1) and with this process's other `XLA_FLAGS`, and
    raises if any fails."""
    env = dict(os.environ)
    one_thread = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {one_thread}".strip()
    procs = [
        subprocess.Popen([sys.executable, *argv, "--shard", f"{i}/{jobs}"], env=env)
        for i in range(jobs)
    ]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise RuntimeError(f"sweep shards exited with codes {codes}.")


def load_summaries(root: str | os.PathLike) -> list[dict[str, Any]]:
    """The summaries of every finished run under `root`, ordered by label then seed."""
    found = [json.loads(p.read_text()) for p in Path(root).glob(f"**/{SUMMARY_FILE}")]
    return sorted(found, key=lambda s: (s["label"], s["seed"]))


@dataclasses.dataclass(frozen=True)
class SweepProcesses:
    """The child processes a sweep's parent starts (`run_sweep`): ``python script argv...
    --shard i/jobs`` for each i < `jobs` (fewer when fewer runs are left); `argv` None
    passes this process's own arguments (``sys.argv[1:]``)."""

    script: str
    jobs: int = 1
    argv: Sequence[str] | None = None


def run_sweep(
    specs: Sequence[RunSpec],
    base: TrainConfig,
    root: str | os.PathLike,
    *,
    processes: SweepProcesses,
    shard_arg: str | None = None,
    rule: CollapseRule = DEFAULT_RULE,
    stale: str = "refuse",
) -> list[dict[str, Any]]:
    """Runs the specs not yet finished under `root` and returns the summaries of `specs`.

    The specs without a summary when the process starts are split over `processes` (each
    with XLA on one CPU thread, so a run's numbers do not depend on how many ran side by
    side); a child (`shard_arg` "i/n") runs every n-th of them from i. The parent settles
    the finished runs made by other code as `stale` says (`run_spec`) before it starts the
    children.
    """

    def pending():
        return [s for s in specs if not (s.directory(root) / SUMMARY_FILE).exists()]

    if shard_arg is None:
        settle_stale([s.directory(root) / SUMMARY_FILE for s in specs], root, stale=stale)
        todo = pending()
        if todo:
            args = sys.argv[1:] if processes.argv is None else list(processes.argv)
            jobs = max(1, min(processes.jobs, len(todo)))
            run_shards_in_processes([processes.script, *args], jobs)
        # The children's runs belong to this sweep even if the code changed while they ran
        # (a table of them then refuses to mix the versions).
        return [run_spec(spec, base, root, rule=rule, stale="reuse") for spec in specs]
    mine = shard(pending(), *_parse_shard(shard_arg))
    for i, spec in enumerate(mine):
        print(f"[{i + 1}/{len(mine)}] {spec.label} seed {spec.seed}", flush=True)
        run_spec(spec, base, root, rule=rule, stale=stale)
    return [run_spec(spec, base, root, rule=rule, stale=stale) for spec in mine]


def _parse_shard(text: str) -> tuple[int, int]:
    try:
        index, count = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard {text!r} must look like 'i/n', e.g. 0/2.") from None
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"--shard {text!r} needs n >= 1 and 0 <= i < n.")
    return index, count


def add_sweep_arguments(parser, *, default_root: str, default_seeds: Sequence[int]) -> None:
    """The command-line options every experiment script shares (`base_config` reads the
    base config they describe)."""
    parser.add_argument("--root", default=default_root, help="where the runs are written")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(default_seeds))
    parser.add_argument(
        "--jobs", type=int, default=2, help="parallel single-threaded processes (default 2)"
    )
    parser.add_argument(
        "--config",
        default="countdown_sweep",
        help="base config: a preset or a YAML/JSON file (default: countdown_sweep)",
    )
    parser.add_argument("--shard", default=None, help=argparse.SUPPRESS)  # Set for children.
    stale = parser.add_mutually_exclusive_group()
    stale.add_argument(
        "--rerun-stale",
        action="store_true",
        help="retrain from scratch the finished runs made by another code version",
    )
    stale.add_argument(
        "--allow-stale",
        action="store_true",
        help="reuse the finished runs made by another code version (default: refuse)",
    )
    parser.add_argument(
        "--set",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="override fields of the base config (e.g. steps=20 for a smoke run)",
    )


def stale_setting(args) -> str:
    """The `stale` setting (`provenance.STALE_RUNS`) of parsed `add_sweep_arguments`
    options: "rerun" for ``--rerun-stale``, "reuse" for ``--allow-stale``, else "refuse"."""
    return "rerun" if args.rerun_stale else "reuse" if args.allow_stale else "refuse"


def base_config(args) -> TrainConfig:
    """The base config of parsed `add_sweep_arguments` options: `--config`, then `--set`."""
    return apply_overrides(load_config(args.config), args.set)
