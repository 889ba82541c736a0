"""The tool task's table and figure (issue #35), from the runs of `lab.py --only tools`.

    python experiments/report_tools.py [--root experiments/runs/lab/tools]
        [--out experiments/results] [--results-md experiments/RESULTS.md]

Block ``tools_cell`` of RESULTS.md: for each method (the `calculator` preset's episodes in
laboratory v3's regime at k=16, and the preset as it is), held-out pass@1 before training
and after each evaluation (mean of the seeds, 95% Student-t interval), the gain from the
first evaluation to the last paired by seed (mean and 95% interval), runs collapsed (the
lab's rule), the median over steps of turns per episode, tool calls per episode and the
ESS ratio, and whether the final pass@1 separates from synchronous training's and from
naive asynchrony's (the intervals do not overlap). Figure: ``tools_cell.png``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
# ruff: noqa: E402  (experiments/ is importable first)
from report import by_label, publish
from report_tables import ci_cell, eval_curves_figure, values_of
from report_v3 import _evals_at, _separation

from gac_jax.lab.sweeps import load_summaries
from gac_jax.train.metrics import markdown_table, read_metrics

# Table order; labels tools/<method>/...
METHODS = ("preset", "sync", "naive", "naive_lr0.00025", "vcpo", "gac")


def _method(label: str) -> str:
    return label.split("/")[1]


def _name(label: str) -> str:
    """``tools/preset/sync`` -> the preset's row name; ``tools/naive/k16`` -> its regime's."""
    method, last = label.split("/")[1:]
    if method == "preset":
        return "preset (PPO-clip, lr 2e-4), sync"
    return "v3 regime, sync" if method == "sync" else f"v3 regime, {method} {last[0]}={last[1:]}"


def _median_per_run(root: Path, label: str, seeds: list[dict], key: str) -> list[float]:
    """Each run's median over steps of metric `key`."""
    out = []
    for s in seeds:
        values = [r[key] for r in read_metrics(root / label / f"seed{s['seed']}") if key in r]
        if values:
            out.append(float(np.median(values)))
    return out


def tools_cell(runs: dict, root: Path, out: Path) -> dict[str, str]:
    labels = sorted(
        (label for label in runs if label.startswith("tools/") and _method(label) in METHODS),
        key=lambda label: METHODS.index(_method(label)),
    )
    if not labels:
        return {"tools_cell": "No run of the tool task has finished yet."}
    evals = {label: _evals_at(root, label, runs[label]) for label in labels}
    steps = sorted({s for e in evals.values() for s in e})
    final = {label: values_of(runs[label], "final_accuracy") for label in labels}
    rows = []
    for label in labels:
        seeds = runs[label]
        turns = _median_per_run(root, label, seeds, "episode/turns_mean")
        calls = _median_per_run(root, label, seeds, "tools/calls")
        episodes = [float(np.median(_episodes(root, label, s))) for s in seeds]
        ess = _median_per_run(root, label, seeds, "ess_ratio")
        versus = {
            method: _separation(final[label], final[ref])
            if (ref := _label_of(labels, method)) and ref != label
            else "-"
            for method in ("sync", "naive")
        }
        start, end = evals[label].get(steps[0], []), evals[label].get(steps[-1], [])
        gain = [b - a for a, b in zip(start, end, strict=True)] if len(start) == len(end) else []
        rows.append(
            (
                _name(label),
                len(seeds),
                *(ci_cell(evals[label][s]) if evals[label].get(s) else "-" for s in steps),
                ci_cell(gain) if gain else "-",
                sum(bool(s["collapsed"]) for s in seeds),
                f"{np.mean(turns):.2f}" if turns else "-",
                f"{np.mean(calls) / np.mean(episodes):.2f}" if calls else "-",
                f"{np.mean(ess):.3g}" if ess else "-",
                versus["sync"],
                versus["naive"],
            )
        )
    header = (
        "method",
        "seeds",
        *(f"pass@1 after {s}" for s in steps),
        "gain (paired)",
        "collapsed",
        "turns / episode",
        "tool calls / episode",
        "ESS ratio",
        "final vs v3 sync",
        "final vs naive",
    )
    curves = {_name(label): evals[label] for label in labels}
    eval_curves_figure(curves, out / "tools_cell.png", "Calculator")
    return {"tools_cell": markdown_table(header, rows, escape=False)}


def _label_of(labels: list[str], method: str) -> str | None:
    return next((label for label in labels if _method(label) == method), None)


def _episodes(root: Path, label: str, seed: dict) -> list[float]:
    """Episodes per step of a run (from its config: groups x group size)."""
    import json

    config = json.loads((root / label / f"seed{seed['seed']}" / "config.json").read_text())
    return [config["rollout"]["groups_per_batch"] * config["generation"]["group_size"]]


def main(argv=None) -> dict[str, str]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", default="experiments/runs/lab/tools", type=Path)
    parser.add_argument("--out", default="experiments/results", type=Path)
    parser.add_argument("--results-md", default="experiments/RESULTS.md")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    runs = by_label(load_summaries(args.root)) if args.root.exists() else {}
    blocks = tools_cell(runs, args.root, args.out)
    publish(blocks, args.results_md)
    return blocks


if __name__ == "__main__":
    main()
