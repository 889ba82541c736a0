"""Tables and plots of the experiment sweeps, from the runs on disk.

Reads experiments/runs/lagged (diagnosis.py, cures.py, gac_defaults.py, controls.py) and
experiments/runs/async (real_async.py); writes experiments/results/*.png and *.csv, and
rewrites the generated blocks (between ``<!-- BEGIN name -->`` and ``<!-- END name -->``)
of experiments/RESULTS.md.
Runs that have not finished are left out; a table lists how many seeds it holds. A table
refuses runs made by two code versions unless --allow-mixed (then a note under it says so).

    python experiments/report.py
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from pathlib import Path

import numpy as np

from gac_jax.train.config import SWEEP_LEARNING_RATE
from gac_jax.train.metrics import read_metrics
from gac_jax.train.plots import plot_distributions, plot_grouped_bars, plot_seed_curves
from gac_jax.train.sweeps import (
    METHODS,
    aggregate,
    cosine_samples,
    load_summaries,
    markdown_table,
)

LAGS = (0, 1, 2, 4, 8, 16)
CURE_LAGS = (8, 16)
ALLOW_MIXED = False  # --allow-mixed: tables may mix runs of two code versions.


def _runs(root: Path, label: str) -> list[list[dict]]:
    """The metric records of each finished seed of `label`."""
    return [read_metrics(p.parent) for p in sorted((root / label).glob("seed*/summary.json"))]


def _select(summaries, labels):
    by_label = {label: [s for s in summaries if s["label"] == label] for label in labels}
    return [s for label in labels for s in by_label[label]]


def _write_csv(summaries, path: Path) -> None:
    if not summaries:
        return
    keys = list(dict.fromkeys(k for s in summaries for k in s if k != "overrides"))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(summaries)


# Column headers of every table, by summary key.
HEADERS = {
    "label": "run",
    "seeds": "seeds",
    "final_accuracy": "final pass@1",
    "best_accuracy": "best pass@1",
    "lagged_k8": "lagged k=8 final pass@1",
    "reward_last": "batch reward, last 25",
    "collapsed": "collapsed",
    "c_t_median": "median c_t",
    "c_t_q25": "q25 c_t",
    "c_t_q75": "q75 c_t",
    "c_after_median": "median c_t after control",
    "ess_ratio_median": "median ESS/B",
    "grad_norm_median": "median grad norm",
    "staleness_mean": "mean staleness",
    "staleness_max": "max staleness",
    "project_fraction": "steps projected",
    "skip_fraction": "steps skipped",
    "wall_seconds": "wall s",
}


def _rows(chosen, keys) -> list[dict]:
    """Mean ± std over seeds of `keys` per label, and how many seeds collapsed (and when)."""
    rows = aggregate(chosen, keys, allow_mixed=ALLOW_MIXED)
    for row in rows:
        row["collapsed"] = _collapses(chosen, row["label"])
    return rows


def _table(rows, columns) -> str:
    columns = {key: HEADERS[key] for key in ["label", "seeds", *columns]}
    return markdown_table(rows, columns, allow_mixed=ALLOW_MIXED)


def _collapses(summaries, label) -> str:
    steps = [s["collapse_step"] for s in summaries if s["label"] == label and s["collapsed"]]
    return f"{len(steps)}" + (f" (at {', '.join(map(str, steps))})" if steps else "")


def diagnosis(summaries, root: Path, out: Path) -> dict[str, str]:
    labels = [f"naive/k{k}" for k in LAGS] + ["gac/k8"]
    chosen = _select(summaries, labels)
    _write_csv(chosen, out / "diagnosis.csv")
    keys = [
        "c_t_median",
        "c_t_q25",
        "c_t_q75",
        "c_after_median",
        "ess_ratio_median",
        "grad_norm_median",
        "reward_last",
        "final_accuracy",
    ]
    rows = _rows(chosen, keys)
    table = _table(rows, [*keys, "collapsed"])
    pooled = {}
    for label in labels:
        runs = _runs(root, label)
        if runs:
            pooled[label.replace("naive/", "").replace("/", " ")] = np.concatenate(
                [cosine_samples(r) for r in runs]
            )
    if pooled:
        plot_distributions(
            pooled,
            out / "diagnosis_cosine.png",
            ylabel="c_t (per step, seeds pooled)",
            title="Consecutive-gradient cosine against staleness k (lagged naive GRPO)",
        )
    curves = {}
    for label, name, key in (
        ("naive/k0", "sync (k=0)", "gac_cosine"),
        ("naive/k8", "k=8", "gac_cosine"),
        ("gac/k8", "k=8 + GAC, raw gradients", "gac_cosine"),
        ("gac/k8", "k=8 + GAC, emitted update", "gac_cosine_after"),
    ):
        runs = _runs(root, label)
        if runs:
            curves[name] = [[r.get(key, np.nan) for r in run[1:]] for run in runs]
    if curves:
        plot_seed_curves(
            curves,
            out / "cosine_vs_step.png",
            ylabel="c_t, 20-step mean",
            smooth=20,
            title="c_t against step: sync, async k=8, async k=8 with GAC",
        )
    return {"diagnosis": table}


def cures(summaries, root: Path, out: Path) -> dict[str, str]:
    tables = {}
    keys = [
        "final_accuracy",
        "best_accuracy",
        "reward_last",
        "c_t_median",
        "c_after_median",
        "ess_ratio_median",
        "wall_seconds",
    ]
    sync = _select(summaries, ["naive/k0"])
    bars = {}
    for k in CURE_LAGS:
        labels = [f"{m}/k{k}" for m in METHODS]
        chosen = _select(summaries, labels)
        _write_csv(chosen, out / f"cures_k{k}.csv")
        rows = _rows(sync + chosen, keys)
        for row in rows:
            row["label"] = "sync (k=0)" if row["label"] == "naive/k0" else row["label"]
        tables[f"cures_k{k}"] = _table(
            rows,
            [
                "final_accuracy",
                "best_accuracy",
                "reward_last",
                "collapsed",
                "c_t_median",
                "c_after_median",
                "ess_ratio_median",
                "wall_seconds",
            ],
        )
        bars[f"k={k}"] = {
            row["label"].split("/")[0]: (row["final_accuracy"], row["final_accuracy_std"])
            for row in rows
            if row["label"] != "sync (k=0)"
        }
        curves = {}
        for name, label in [("sync (k=0)", "naive/k0")] + [(m, f"{m}/k{k}") for m in METHODS]:
            runs = _runs(root, label)
            if runs:
                curves[name] = [[r["reward"] for r in run] for run in runs]
        if curves:
            plot_seed_curves(
                curves,
                out / f"cures_reward_k{k}.png",
                ylabel="batch reward, 25-step mean",
                smooth=25,
                title=f"Batch reward at staleness k={k} (mean over seeds, range shaded)",
            )
    if any(bars.values()):
        sync_row = aggregate(sync, keys, allow_mixed=ALLOW_MIXED)[0] if sync else None
        plot_grouped_bars(
            bars,
            out / "cures_accuracy.png",
            ylabel="final held-out pass@1",
            reference=("sync (k=0)", sync_row["final_accuracy"]) if sync_row else None,
            title="Final held-out accuracy per method (mean ± std over seeds)",
        )
    return tables


def gac_defaults(summaries, out: Path) -> dict[str, str]:
    sys.path.insert(0, str(Path(__file__).parent))  # The sweep's own definitions.
    from gac_defaults import LAG, VARIANTS

    labels = [f"naive/k{LAG}", f"gac/k{LAG}"] + [f"{name}/k{LAG}" for name in VARIANTS]
    chosen = _select(summaries, labels)
    _write_csv(chosen, out / "gac_defaults.csv")
    rows = _rows(
        chosen,
        [
            "final_accuracy",
            "best_accuracy",
            "reward_last",
            "c_t_median",
            "c_after_median",
            "project_fraction",
            "skip_fraction",
        ],
    )
    table = _table(
        rows,
        [
            "final_accuracy",
            "best_accuracy",
            "reward_last",
            "collapsed",
            "c_t_median",
            "c_after_median",
            "project_fraction",
            "skip_fraction",
        ],
    )
    return {"gac_defaults": table}


def controls(summaries, out: Path) -> dict[str, str]:
    sys.path.insert(0, str(Path(__file__).parent))  # The sweep's own definitions.
    from controls import SMALLER_LR

    small = f"naive_lr{SMALLER_LR:g}"
    labels = ["naive/k0", "m2po/k0", "seq_tis/k0", "m2po/k8", "seq_tis/k8"]
    labels += [f"{name}/k{k}" for k in (0, 8, 16) for name in ("naive", small, "vcpo")]
    labels = list(dict.fromkeys(labels))
    chosen = _select(summaries, labels)
    _write_csv(chosen, out / "controls.csv")
    rows = _rows(chosen, ["final_accuracy", "best_accuracy", "reward_last", "ess_ratio_median"])
    table = _table(
        rows, ["final_accuracy", "best_accuracy", "reward_last", "collapsed", "ess_ratio_median"]
    )
    return {"controls": table}


def smaller_lr(summaries, out: Path) -> dict[str, str]:
    """Every method at learning rate 4e-4 (experiments/smaller_lr.py), beside the 6e-4 runs."""
    sys.path.insert(0, str(Path(__file__).parent))  # The sweep's own definitions.
    from smaller_lr import CONTROL_LAG, CONTROL_LEARNING_RATE, LAGS, LEARNING_RATE, label

    keys = ["final_accuracy", "best_accuracy", "reward_last", "ess_ratio_median"]
    labels = [label("naive", 0)] + [label(m, k) for k in LAGS for m in METHODS]
    labels.append(label("naive", CONTROL_LAG, CONTROL_LEARNING_RATE))
    chosen = _select(summaries, labels)
    if not chosen:
        return {}
    _write_csv(chosen, out / "smaller_lr.csv")
    rows = _rows(chosen, keys)
    table = _table(
        rows, ["final_accuracy", "best_accuracy", "reward_last", "collapsed", "ess_ratio_median"]
    )
    # The 6e-4 runs of the same methods, for the bars beside the 4e-4 ones.
    base_labels = [f"{m}/k{k}" for k in LAGS for m in METHODS]
    by_label = {
        r["label"]: r
        for r in rows + aggregate(_select(summaries, base_labels), keys, allow_mixed=ALLOW_MIXED)
    }
    bars = {
        f"k={k}, lr {lr:g}": {
            m: (by_label[x]["final_accuracy"], by_label[x]["final_accuracy_std"])
            for m in METHODS
            if (x := label_of(m, k)) in by_label
        }
        for k in LAGS
        for lr, label_of in (
            (LEARNING_RATE, label),
            (SWEEP_LEARNING_RATE, lambda m, k: f"{m}/k{k}"),
        )
    }
    sync = by_label.get(label("naive", 0))
    plot_grouped_bars(
        {group: values for group, values in bars.items() if values},
        out / "smaller_lr_accuracy.png",
        ylabel="final held-out pass@1",
        reference=(f"sync (k=0), lr {LEARNING_RATE:g}", sync["final_accuracy"]) if sync else None,
        title="Final held-out pass@1, two learning rates (mean ± std over seeds)",
    )
    return {"smaller_lr": table}


def real_async(summaries, lagged, root: Path, out: Path) -> dict[str, str]:
    labels = [f"{m}/async" for m in METHODS]
    chosen = _select(summaries, labels)
    _write_csv(chosen, out / "async.csv")
    rows = _rows(
        chosen,
        [
            "final_accuracy",
            "best_accuracy",
            "staleness_mean",
            "staleness_max",
            "c_t_median",
            "ess_ratio_median",
            "wall_seconds",
        ],
    )
    for row in rows:
        method = row["label"].split("/")[0]
        match = aggregate(
            _select(lagged, [f"{method}/k8"]), ["final_accuracy"], allow_mixed=ALLOW_MIXED
        )
        row["lagged_k8"] = match[0]["final_accuracy"] if match else float("nan")
    table = _table(
        rows,
        [
            "final_accuracy",
            "best_accuracy",
            "lagged_k8",
            "collapsed",
            "staleness_mean",
            "staleness_max",
            "c_t_median",
            "ess_ratio_median",
            "wall_seconds",
        ],
    )
    gaps = {}
    for label in labels:
        runs = _runs(root, label)
        if runs:
            gaps[label.split("/")[0]] = np.concatenate(
                [[r["version_gap_mean"] for r in run] for run in runs]
            )
    if gaps:
        plot_distributions(
            gaps,
            out / "async_staleness.png",
            ylabel="mean staleness of a batch (versions)",
            title="Measured staleness under real asynchrony (max_staleness 8)",
        )
    return {"async": table}


def warm_start_row(out: Path, seeds=(0, 1, 2)) -> dict[str, str]:
    """Held-out pass@1 of the warm start itself, by the runs' own evaluation (same problems,
    same sampler), one evaluation key per seed; cached in results/warm_start_eval.json."""
    import json

    import jax

    from gac_jax.train import build_run, get_preset
    from gac_jax.train.loop import config_hash, evaluate_run

    config = get_preset("countdown_sweep")
    cache = out / "warm_start_eval.json"
    digest = config_hash(config)
    cached = json.loads(cache.read_text()) if cache.exists() else {}
    if cached.get("config_hash") != digest or cached.get("seeds") != list(seeds):
        run = build_run(config)
        scores = [evaluate_run(run, jax.random.key(seed + 1)) for seed in seeds]
        cached = {"config_hash": digest, "seeds": list(seeds), "scores": scores}
        cache.write_text(json.dumps(cached, indent=2))
    pass1 = np.array([s["eval/pass@1"] for s in cached["scores"]])
    greedy = cached["scores"][0]["eval/greedy_accuracy"]
    text = (
        f"Warm start on the same {config.eval_size} test problems, by the same evaluation: "
        f"pass@1 {pass1.mean():.3f} ± {pass1.std(ddof=1):.3f} over {len(seeds)} sampling "
        f"keys, greedy {greedy:.3f}."
    )
    return {"warm_start": text}


def rewrite_blocks(path: Path, blocks: dict[str, str]) -> None:
    """Replaces each ``<!-- BEGIN name -->...<!-- END name -->`` block of `path`."""
    text = path.read_text()
    for name, body in blocks.items():
        pattern = re.compile(
            rf"(<!-- BEGIN {re.escape(name)} -->\n).*?(<!-- END {re.escape(name)} -->)", re.S
        )
        if not pattern.search(text):
            raise ValueError(f"{path} has no block named {name!r}.")
        text = pattern.sub(lambda m, body=body: m.group(1) + body + "\n" + m.group(2), text)
    path.write_text(text)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lagged", default="experiments/runs/lagged", type=Path)
    parser.add_argument("--async-root", default="experiments/runs/async", type=Path)
    parser.add_argument("--out", default="experiments/results", type=Path)
    parser.add_argument(
        "--results-md",
        default="experiments/RESULTS.md",
        help="the Markdown file whose generated blocks are rewritten; 'none' to skip",
    )
    parser.add_argument(
        "--allow-mixed",
        action="store_true",
        help="let a table hold runs of two code versions (a note under it names them)",
    )
    args = parser.parse_args()
    global ALLOW_MIXED
    ALLOW_MIXED = args.allow_mixed
    args.out.mkdir(parents=True, exist_ok=True)
    lagged = load_summaries(args.lagged) if args.lagged.exists() else []
    asynchronous = load_summaries(args.async_root) if args.async_root.exists() else []
    try:
        blocks = warm_start_row(args.out)
        blocks.update(diagnosis(lagged, args.lagged, args.out))
        blocks.update(cures(lagged, args.lagged, args.out))
        blocks.update(gac_defaults(lagged, args.out))
        blocks.update(controls(lagged, args.out))
        blocks.update(smaller_lr(lagged, args.out))
        blocks.update(real_async(asynchronous, lagged, args.async_root, args.out))
    except ValueError as error:  # Runs of two code versions in one table, without --allow-mixed.
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    for name, table in blocks.items():
        print(f"## {name}\n{table}\n")
    if args.results_md != "none":
        rewrite_blocks(Path(args.results_md), blocks)


if __name__ == "__main__":
    main()
