"""Seeded sweeps of GRPO runs: the named methods, resumable execution, per-run summaries.

A sweep is a list of `RunSpec`s (a label, config overrides, a seed). `run_spec` trains one
into ``root/<label>/seed<seed>`` and writes ``summary.json`` there; a run whose summary
exists for the same config is skipped and an interrupted one resumes from its newest
checkpoint, so a sweep is restarted by running it again. `summarize_run` turns a run's
metrics into the numbers the experiments report, `aggregate` gives their mean and std over
seeds, and `markdown_table` prints them.

A summary records the code that made it (`provenance.code_version`). A sweep refuses a
summary of other code unless told to retrain it (``--rerun-stale``) or reuse it
(``--allow-stale``), and a table refuses runs of two code versions unless ``allow_mixed``.

    specs = [RunSpec(f"{m}/k8", ("rollout.lag=8", *o), seed)
             for m, o in METHODS.items() for seed in (0, 1, 2)]
    summaries = [run_spec(spec, get_preset("countdown_sweep"), "runs/cures") for spec in specs]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gac_jax.train.config import TrainConfig
from gac_jax.train.config_io import apply_overrides, load_config
from gac_jax.train.metrics import read_metrics
from gac_jax.train.provenance import (
    StaleRunError,
    check_one_version,
    code_version,
    runs_by_version,
    settle_stale,
)

SUMMARY_FILE = "summary.json"

# The methods compared under staleness, as config overrides on a base config whose
# objective is PPO-clip against the behaviour policy with GRPO advantages.
METHODS: Mapping[str, tuple[str, ...]] = {
    # Asynchronous GRPO with nothing added (the cosine is still monitored).
    "naive": (),
    # Gradient Alignment Control with the config's thresholds.
    "gac": ("gac.monitor_only=false",),
    # VCPO: ESS step scaling (its defaults) and the off-policy minimum-variance baseline.
    "vcpo": ("ess={}", "loss.advantage=vcpo"),
    # M2PO's second-moment token mask.
    "m2po": ("loss.policy_loss=m2po",),
    # REINFORCE with sequence-level truncated importance sampling (cap 2).
    "seq_tis": (
        "loss.policy_loss=reinforce",
        "loss.correction=tis",
        "loss.correction_kwargs.level=sequence",
        "loss.correction_kwargs.cap=2.0",
    ),
    "gac_vcpo": ("gac.monitor_only=false", "ess={}", "loss.advantage=vcpo"),
}


@dataclasses.dataclass(frozen=True)
class CollapseRule:
    """A run collapsed at the first step where the batch reward's trailing `window`-step mean
    falls below `fraction` of its mean over the run's first `window` steps (checked from step
    `2 * window - 1` on), or where the loss or gradient norm is not finite."""

    window: int = 25
    fraction: float = 0.5

    def describe(self) -> str:
        return (
            f"the trailing {self.window}-step mean batch reward falls below "
            f"{self.fraction:g} x its mean over the first {self.window} steps, or the loss "
            "or gradient norm is not finite"
        )


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


def _series(records: Sequence[Mapping[str, Any]], key: str) -> np.ndarray:
    return np.array([float(r[key]) for r in records if key in r], dtype=np.float64)


def collapse_step(records: Sequence[Mapping[str, Any]], rule: CollapseRule) -> int | None:
    """The step at which `rule` says the run collapsed, or None."""
    for r in records:
        if not (math.isfinite(r.get("loss", 0.0)) and math.isfinite(r.get("grad_norm", 0.0))):
            return int(r["step"])
    reward = _series(records, "reward")
    w = rule.window
    if len(reward) < 2 * w:
        return None
    start = reward[:w].mean()
    trailing = np.convolve(reward, np.ones(w) / w, mode="valid")  # trailing[i]: steps i..i+w-1
    # trailing[w:] are the windows after the first one, ending at steps 2w - 1, 2w, ...
    below = np.nonzero(trailing[w:] < rule.fraction * start)[0]
    if len(below) == 0:
        return None
    return int(records[below[0] + 2 * w - 1]["step"])


def _quantiles(x: np.ndarray) -> tuple[float, float, float]:
    if len(x) == 0:
        return (math.nan, math.nan, math.nan)
    q25, q50, q75 = np.percentile(x, [25, 50, 75])
    return float(q25), float(q50), float(q75)


def cosine_samples(records: Sequence[Mapping[str, Any]], key: str = "gac_cosine") -> np.ndarray:
    """The per-step cosines `key` of the steps after the first whose gradient is non-zero
    (a batch whose groups all share one reward has no gradient and so no direction)."""
    return _series([r for r in records[1:] if r.get("grad_norm", 0.0) > 0.0], key)


def summarize_run(
    records: Sequence[Mapping[str, Any]], rule: CollapseRule = CollapseRule()
) -> dict[str, Any]:
    """The reported numbers of one run from its metric records.

    The cosine statistics use `cosine_samples`: ``c_t`` is the raw consecutive-gradient
    cosine, ``c_after`` the cosine of what the controller emitted.
    Held-out accuracy is the sampled pass@1 of the evaluations.
    """
    if not records:
        raise ValueError("summarize_run needs at least one metric record; got none.")
    c_t = cosine_samples(records)
    c_after = cosine_samples(records, "gac_cosine_after")
    with_grad = [r for r in records[1:] if r.get("grad_norm", 0.0) > 0.0]
    evals = [r for r in records if "eval/pass@1" in r]
    accuracy = [float(r["eval/pass@1"]) for r in evals]
    regimes = _series(records, "gac_regime")
    reward = _series(records, "reward")
    gap = _series(records, "version_gap_mean")
    summary = {
        "steps": len(records),
        "final_accuracy": accuracy[-1] if accuracy else math.nan,
        "best_accuracy": max(accuracy) if accuracy else math.nan,
        "final_greedy_accuracy": float(evals[-1]["eval/greedy_accuracy"]) if evals else math.nan,
        "final_pass_at_k": float(evals[-1].get("eval/pass@8", math.nan)) if evals else math.nan,
        "reward_first": float(reward[: rule.window].mean()),
        "reward_last": float(reward[-rule.window :].mean()),
        "collapse_step": collapse_step(records, rule),
        "c_t_q25": _quantiles(c_t)[0],
        "c_t_median": _quantiles(c_t)[1],
        "c_t_q75": _quantiles(c_t)[2],
        "c_after_median": _quantiles(c_after)[1],
        "zero_grad_fraction": 1.0 - len(with_grad) / max(len(records) - 1, 1),
        "ess_ratio_median": float(np.median(_series(records, "ess_ratio"))),
        "grad_norm_median": float(np.median(_series(records, "grad_norm"))),
        "staleness_mean": float(gap.mean()) if len(gap) else math.nan,
        "staleness_max": float(_series(records, "version_gap_max").max()) if len(gap) else math.nan,
        "project_fraction": float(np.mean(regimes == 1)) if len(regimes) else 0.0,
        "skip_fraction": float(np.mean(regimes == 2)) if len(regimes) else 0.0,
    }
    summary["collapsed"] = summary["collapse_step"] is not None
    return summary


def run_spec(
    spec: RunSpec,
    base: TrainConfig,
    root: str | os.PathLike,
    *,
    rule: CollapseRule = CollapseRule(),
    train_fn: Callable[..., Any] | None = None,
    rerun_stale: bool = False,
    allow_stale: bool = False,
) -> dict[str, Any]:
    """Trains `spec` (unless its summary already exists) and returns its summary.

    An existing summary written for a different config is an error: the run directory
    belongs to another experiment. One written by other code (`provenance.same_code`) is a
    `StaleRunError` unless `rerun_stale` (the run directory is deleted and the run trained
    again from scratch) or `allow_stale` (the summary is returned as it is). `train_fn`
    defaults to `gac_jax.train.train`.
    """
    from gac_jax.train.loop import config_hash, train

    config = spec.config(base)
    out = spec.directory(root)
    path = out / SUMMARY_FILE
    digest = config_hash(config)
    if path.exists():
        summary = json.loads(path.read_text())
        if summary.get("config_hash") != digest or summary.get("config_steps") != config.steps:
            raise ValueError(
                f"{path} was written by another config (hash {summary.get('config_hash')}, "
                f"{summary.get('config_steps')} steps; this one is {digest}, {config.steps} "
                "steps): remove the directory or change the sweep's root."
            )
    settle_stale([path], root, rerun_stale=rerun_stale, allow_stale=allow_stale)
    if path.exists():
        return json.loads(path.read_text())
    resumed = (out / "metrics.jsonl").exists()
    started = time.monotonic()
    (train_fn or train)(config, out, resume=True)
    wall = time.monotonic() - started
    summary = {
        "label": spec.label,
        "seed": spec.seed,
        "overrides": list(spec.overrides),
        "config_hash": digest,
        "config_steps": config.steps,
        "code": code_version(),
        "wall_seconds": wall,
        "resumed": resumed,
        "collapse_rule": rule.describe(),
        **summarize_run(read_metrics(out), rule),
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(summary, indent=2, allow_nan=True))
    tmp.replace(path)  # Written last and atomically: its presence means the run finished.
    return summary


def shard(specs: Sequence[RunSpec], index: int, count: int) -> list[RunSpec]:
    """Every `count`-th spec starting at `index` (`0 <= index < count`)."""
    if not 0 <= index < count:
        raise ValueError(f"shard index {index} must be in [0, {count}).")
    return list(specs[index::count])


def run_shards_in_processes(argv: Sequence[str], jobs: int) -> None:
    """Runs ``python argv... --shard i/jobs`` for each i in parallel, each process on one
    CPU thread (XLA's intra-op pool of 1), and raises if any fails."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
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


def aggregate(
    summaries: Sequence[Mapping[str, Any]], keys: Sequence[str], *, allow_mixed: bool = False
) -> list[dict]:
    """One row per label, in first-seen order: ``seeds``, ``collapsed`` (how many), and the
    mean and std (ddof 1; 0 for one seed) of each of `keys` as ``key`` and ``key_std``.

    ``code`` maps each code version of the row's runs to those runs. Summaries of more
    than one code version are an error unless `allow_mixed`.
    """
    check_one_version(runs_by_version(summaries), allow_mixed)
    labels: dict[str, list[Mapping[str, Any]]] = {}
    for s in summaries:
        labels.setdefault(s["label"], []).append(s)
    rows = []
    for label, group in labels.items():
        row: dict[str, Any] = {
            "label": label,
            "seeds": len(group),
            "collapsed": sum(bool(s["collapsed"]) for s in group),
            "code": runs_by_version(group),
        }
        for key in keys:
            values = np.array([float(s[key]) for s in group], dtype=np.float64)
            row[key] = float(values.mean())
            row[f"{key}_std"] = float(values.std(ddof=1)) if len(values) > 1 else 0.0
        rows.append(row)
    return rows


def markdown_table(
    rows: Sequence[Mapping[str, Any]],
    columns: Mapping[str, str],
    *,
    digits: int = 3,
    allow_mixed: bool = False,
) -> str:
    """A Markdown table of `rows`; `columns` maps a row key to its header. A key with a
    ``_std`` partner in the row is printed as ``mean ± std``.

    Rows of `aggregate` made by more than one code version (their ``code``) are an error
    unless `allow_mixed`; the table then ends with a note naming the versions and runs.
    """
    versions: dict[str, str] = {}
    for row in rows:
        for version, runs in row.get("code", {}).items():
            versions[version] = "; ".join(filter(None, [versions.get(version), runs]))
    check_one_version(versions, allow_mixed)
    header = "| " + " | ".join(columns.values()) + " |"
    lines = [header, "|" + "---|" * len(columns)]
    for row in rows:
        cells = []
        for key in columns:
            value = row[key]
            if isinstance(value, float):
                cell = f"{value:.{digits}f}"
                if f"{key}_std" in row:
                    cell += f" ± {row[f'{key}_std']:.{digits}f}"
            else:
                cell = str(value)
            cells.append(cell)
        lines.append("| " + " | ".join(cells) + " |")
    if len(versions) > 1:
        made_by = "; ".join(f"[{v}]: {runs}" for v, runs in versions.items())
        lines += ["", f"Mixed code versions (allowed by allow_mixed): {made_by}."]
    return "\n".join(lines)


def run_sweep(
    specs: Sequence[RunSpec],
    base: TrainConfig,
    root: str | os.PathLike,
    *,
    script: str,
    jobs: int = 1,
    shard_arg: str | None = None,
    rule: CollapseRule = CollapseRule(),
    rerun_stale: bool = False,
    allow_stale: bool = False,
) -> list[dict[str, Any]]:
    """Runs the specs not yet finished under `root` and returns the summaries of `specs`.

    The unfinished specs are split over `jobs` child processes of `script` (``--shard
    i/jobs``), each with XLA on one CPU thread, so the numbers of a run do not depend on
    how many ran side by side; a child (`shard_arg` "i/n") runs every n-th unfinished spec
    from i. Unfinished specs are those without a summary when the process starts, so the
    children, started together, agree on them. Finished runs made by other code are
    refused, retrained or reused as `run_spec` says; the parent settles them all (one error
    naming every stale run, or their deletion) before it starts the children.
    """
    stale = {"rerun_stale": rerun_stale, "allow_stale": allow_stale}

    def pending():
        return [s for s in specs if not (s.directory(root) / SUMMARY_FILE).exists()]

    if shard_arg is None:
        settle_stale([s.directory(root) / SUMMARY_FILE for s in specs], root, **stale)
        todo = pending()
        if todo:
            run_shards_in_processes([script, *sys.argv[1:]], max(1, min(jobs, len(todo))))
        # The children's runs belong to this sweep even if the code changed while they ran
        # (a table of them then refuses to mix the versions).
        return [run_spec(spec, base, root, rule=rule, allow_stale=True) for spec in specs]
    mine = shard(pending(), *_parse_shard(shard_arg))
    for i, spec in enumerate(mine):
        print(f"[{i + 1}/{len(mine)}] {spec.label} seed {spec.seed}", flush=True)
        run_spec(spec, base, root, rule=rule, **stale)
    return [run_spec(spec, base, root, rule=rule, **stale) for spec in mine]


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


def base_config(args) -> TrainConfig:
    """The base config of parsed `add_sweep_arguments` options: `--config`, then `--set`."""
    return apply_overrides(load_config(args.config), args.set)


def sweep_main(
    description: str,
    specs: Callable[[Sequence[int]], Sequence[RunSpec]],
    *,
    script: str,
    default_root: str,
    default_seeds: Sequence[int],
    default_jobs: int = 2,
) -> list[dict[str, Any]]:
    """The command line of an experiment script: parses the `add_sweep_arguments` options,
    builds the specs for `--seeds` and runs them with `run_sweep`."""
    parser = argparse.ArgumentParser(description=description)
    add_sweep_arguments(parser, default_root=default_root, default_seeds=default_seeds)
    parser.set_defaults(jobs=default_jobs)
    args = parser.parse_args()
    try:
        return run_sweep(
            specs(args.seeds),
            base_config(args),
            args.root,
            script=script,
            jobs=args.jobs,
            shard_arg=args.shard,
            rerun_stale=args.rerun_stale,
            allow_stale=args.allow_stale,
        )
    except StaleRunError as e:
        raise SystemExit(str(e)) from None
