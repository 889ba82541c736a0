"""Tables and plots of the laboratory (experiments/lab.py), from the runs on disk.

Reads ROOT/lagged and ROOT/async (``--root``, experiments/runs/lab by default); writes
PNG and CSV files to ``--out`` and rewrites the generated blocks (between
``<!-- BEGIN name -->`` and ``<!-- END name -->``) of ``--results-md``. Every number comes
from the runs' summaries and metrics: runs that have not finished are left out, and each
table says how many seeds it holds. Intervals are 95% Student-t intervals of the mean over
seeds. A table refuses runs of two code versions unless --allow-mixed (then a note under it
names them).

    python experiments/report.py
"""

from __future__ import annotations

import argparse
import csv
import math
import re
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lab  # noqa: E402  (experiments/lab.py: the sweeps' labels and settings)
import report_v3  # noqa: E402  (laboratory v3's blocks)
from report_tables import ci_cell, figure, interval, median_cell, values_of  # noqa: E402

from gac_jax.lab.provenance import check_one_version, runs_by_version  # noqa: E402
from gac_jax.lab.sweeps import load_summaries  # noqa: E402
from gac_jax.train.metrics import markdown_table, read_metrics  # noqa: E402

ALLOW_MIXED = False  # --allow-mixed: tables may mix runs of two code versions.
# The only keys of a run's metrics records read here (the rest comes from its summary);
# experiments/keep_runs.py keeps these.
RECORD_KEYS = (
    "step",
    "eval_start/pass@1",
    "eval_start/greedy_accuracy",
    "eval/pass@1",
    "eval/greedy_accuracy",
    "version_gap_mean",
    # Laboratory v3's figures (report_v3.py).
    "reward",
    "grad_norm",
    "ess_ratio",
    "gac_cosine",
    "gac_cosine_after",
    "gac_regime",
    "groups_filtered",
    # Laboratory v4 (report_v4.py).
    "gac_update_cosine",
    "gac_update_regime",
    "gac_removed_fraction",
    "gac_update_removed_fraction",
    "gac_skipped",
    "policy_change/kl",
    # The tool task (report_tools.py).
    "episode/turns_mean",
    "tools/calls",
)


def by_label(summaries) -> dict[str, list[dict]]:
    """Finished runs by label; refuses two code versions in one table (`ALLOW_MIXED`)."""
    check_one_version(runs_by_version(summaries), ALLOW_MIXED)
    found: dict[str, list[dict]] = {}
    for s in summaries:
        found.setdefault(s["label"], []).append(s)
    return found


def _write_csv(runs: Sequence[dict], path: Path) -> None:
    keys = list(dict.fromkeys(k for s in runs for k in s if k not in ("overrides", "code")))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(runs)


# ---------------------------------------------------------------------------------- sync


def _evaluations(records) -> list[tuple[int, float, float]]:
    """(step, pass@1, greedy accuracy) of a run's evaluation before training (step 0) and
    of each later one (after step `r["step"] + 1` updates)."""
    out = [
        (0, r["eval_start/pass@1"], r["eval_start/greedy_accuracy"])
        for r in records
        if "eval_start/pass@1" in r
    ][:1]
    return out + [
        (r["step"] + 1, r["eval/pass@1"], r["eval/greedy_accuracy"])
        for r in records
        if "eval/pass@1" in r
    ]


def sync(runs: dict, root: Path, out: Path) -> dict[str, str]:
    seeds = runs.get(lab.SYNC_LABEL, [])
    if not seeds:
        return {"sync": "No synchronous run has finished yet."}
    # Each seed's evaluations: (step, pass@1, greedy), the one before training first.
    evals = [_evaluations(read_metrics(root / lab.SYNC_LABEL / f"seed{s['seed']}")) for s in seeds]
    table, points = [], []
    for i, (step, _, _) in enumerate(evals[0]):
        values, greedy = [e[i][1] for e in evals], [e[i][2] for e in evals]
        table.append((step, ci_cell(values), ci_cell(greedy)))
        points.append((step, values))
    gains = values_of(seeds, "gain")
    text = markdown_table(("step", "held-out pass@1", "greedy accuracy"), table, escape=False)
    text += (
        f"\n\nGain of held-out pass@1 over the warm start (last evaluation less the one "
        f"before the first update), {len(seeds)} seeds: **{ci_cell(gains)}**."
    )
    thirds = [s["b_simple_thirds"] for s in seeds if "b_simple_thirds" in s]
    if thirds and np.all(np.isfinite(thirds)):
        text += (
            f"\n\nGradient noise scale B_simple by third of the run (mean of the seeds): "
            f"{' / '.join(f'{x:.0f}' for x in np.mean(thirds, axis=0))} tokens, for a batch "
            f"of B = {np.mean(values_of(seeds, 'noise_batch_size')):.0f} tokens."
        )
    fig, (ax,) = figure(1)
    for step, values in points:
        ax.plot([step] * len(values), values, "o", color="0.6", markersize=3)
    ax.plot([p[0] for p in points], [np.mean(p[1]) for p in points], "-o", label="mean")
    ax.set(xlabel="step", ylabel="held-out pass@1", title="Synchronous GRPO (one dot a seed)")
    ax.legend()
    fig.savefig(out / "sync_curve.png", dpi=100)
    return {"sync": text}


# ----------------------------------------------------------------------------- staleness

STALENESS_KEYS = (
    ("final_accuracy", "final pass@1"),
    ("gain", "gain"),
    ("policy_kl_median", "per-step KL"),
    ("ess_ratio_median", "ESS ratio"),
    ("grad_norm_median", "grad norm"),
    ("clip_fraction_median", "clip fraction"),
    ("c_t_median", "c_t"),
)


def _lag_rows(runs: dict, lr: float) -> list[tuple[int, list[dict]]]:
    labels = {k: lab.staleness_label(lr, k) for k in lab.LAGS}
    return [(k, runs[label]) for k, label in labels.items() if label in runs]


def staleness(runs: dict, out: Path) -> dict[str, str]:
    rows, warnings = [], []
    fig, axes = figure(4)
    for lr in (lab.LAB_LEARNING_RATE, lab.SMALL_LR):
        lags = _lag_rows(runs, lr)
        for k, seeds in lags:
            cells = [
                ci_cell(values_of(seeds, key))
                if key in ("final_accuracy", "gain")
                else median_cell(seeds, key)
                for key, _ in STALENESS_KEYS
            ]
            collapsed = sum(bool(s["collapsed"]) for s in seeds)
            rows.append((f"{lr:g}", k, len(seeds), *cells, collapsed))
            for s in seeds:
                if s["collapsed"]:
                    warnings.append(
                        f"lr {lr:g} k={k} seed {s['seed']}: collapse at step "
                        f"{s['collapse_step']}, first ESS ratio < 0.5 at "
                        f"{s['ess_drop_step']}, first gradient-norm spike (> 3x the early "
                        f"median) at {s['grad_spike_step']}"
                    )
        for ax, key in zip(
            axes,
            ("final_accuracy", "ess_ratio_median", "policy_kl_median", "c_t_median"),
            strict=True,
        ):
            xs = [max(k, 1) for k, _ in lags]
            ax.plot(xs, [np.mean(values_of(s, key)) for _, s in lags], "-o", label=f"lr {lr:g}")
            ax.set(xscale="log", ylabel=dict(STALENESS_KEYS).get(key, key))
    if not rows:
        return {"staleness": "No staleness run has finished yet."}
    axes[0].legend()
    axes[2].set_yscale("log")
    axes[-1].set_xlabel("staleness k (k=0 drawn at 1)")
    fig.savefig(out / "staleness.png", dpi=100)
    header = ("lr", "k", "seeds", *(h for _, h in STALENESS_KEYS), "collapsed")
    text = markdown_table(header, rows, escape=False)
    text += "\n\n" + ("\n".join(f"- {w}" for w in warnings) or "No run collapsed.")
    return {"staleness": text}


# ----------------------------------------------------------------------------- alignment


def alignment(runs: dict, out: Path) -> dict[str, str]:
    rows, points = [], {}
    for g in sorted({*lab.ALIGN_GROUPS, *lab.QUICK["groups"]}):
        for k in lab.ALIGN_LAGS:
            seeds = runs.get(f"align_g{g}/k{k}")
            if not seeds:
                continue
            b = float(np.mean(values_of(seeds, "noise_batch_size")))
            b_simple = float(np.mean(values_of(seeds, "b_simple")))
            c_t = float(np.mean(values_of(seeds, "c_t_median")))
            ratio = b / b_simple
            thirds = np.mean([s["b_simple_thirds"] for s in seeds], axis=0)
            predicted = f"{1 / (1 + 1 / ratio):.3f}" if k == 0 else "-"
            rows.append(
                (
                    g,
                    k,
                    f"{b:.0f}",
                    f"{b_simple:.0f}",
                    " / ".join(f"{x:.0f}" for x in thirds),
                    f"{ratio:.2g}",
                    f"{c_t:.3f}",
                    predicted,
                )
            )
            points.setdefault(k, []).append((ratio, c_t))
    if not rows:
        return {"alignment": "No alignment run has finished yet."}
    fig, (ax, ax2) = figure(2)
    for k, pts in sorted(points.items()):
        pts.sort()
        ax.plot(*zip(*pts, strict=True), "o-", label=f"k={k} (measured median c_t)")
    grid = np.geomspace(
        min(p[0] for v in points.values() for p in v) / 2,
        max(p[0] for v in points.values() for p in v) * 2,
        100,
    )
    ax.plot(grid, 1 / (1 + 1 / grid), "k--", label="theory, sync: 1 / (1 + B_simple / B)")
    ax.set(xscale="log", xlabel="B / B_simple", ylabel="c_t", title="When do gradients align?")
    ax.legend(fontsize="small")
    for lr in (lab.LAB_LEARNING_RATE, lab.SMALL_LR):
        lags = [(k, s) for k, s in _lag_rows(runs, lr) if k > 0]
        if lags:
            xs = [k * lr for k, _ in lags]
            ax2.plot(
                xs, [np.mean(values_of(s, "c_t_median")) for _, s in lags], "o-", label=f"lr {lr:g}"
            )
    ax2.set(xscale="log", xlabel="k x lr", ylabel="median c_t")
    if ax2.lines:
        ax2.legend(fontsize="small")
    fig.savefig(out / "alignment.png", dpi=100)
    header = (
        "prompts",
        "k",
        "B (tokens)",
        "B_simple",
        "B_simple by third of the run",
        "B / B_simple",
        "median c_t",
        "predicted c_t (sync)",
    )
    return {"alignment": markdown_table(header, rows, escape=False)}


# --------------------------------------------------------------------------------- cures


def _sync_at(runs: dict, root: Path, step: int) -> list[float]:
    """Held-out pass@1 of each synchronous seed after `step` updates (none if not evaluated)."""
    values = []
    for s in runs.get(lab.SYNC_LABEL, []):
        evals = _evaluations(read_metrics(root / lab.SYNC_LABEL / f"seed{s['seed']}"))
        values += [acc for at, acc, _ in evals if at == step]
    return values


def cures(runs: dict, root: Path, out: Path) -> dict[str, str]:
    k = next((k for k in (lab.CURE_LAG, lab.QUICK["cure_lag"]) if f"naive/k{k}" in runs), None)
    if k is None:
        return {"cures": "No cure run has finished yet."}
    labels = [f"{m}/k{k}" for m in lab.METHODS] + [f"{lab.lr_label(lab.CONTROL_LR)}/k{k}"]
    naive = interval(values_of(runs[f"naive/k{k}"], "final_accuracy"))
    steps = runs[f"naive/k{k}"][0]["steps"]
    reference = _sync_at(runs, root, steps)
    rows, bars = [], []
    for label in labels:
        seeds = runs.get(label)
        if not seeds:
            continue
        mean, half = interval(values_of(seeds, "final_accuracy"))
        low, high = mean - half, mean + half
        if label.startswith("naive/") or math.isnan(half) or math.isnan(naive[1]):
            verdict = "-"
        elif low > naive[0] + naive[1]:
            verdict = "better"
        elif high < naive[0] - naive[1]:
            verdict = "worse"
        else:
            verdict = "overlaps"
        rows.append(
            (
                label.split("/")[0],
                len(seeds),
                ci_cell(values_of(seeds, "final_accuracy")),
                ci_cell(values_of(seeds, "gain")),
                sum(bool(s["collapsed"]) for s in seeds),
                median_cell(seeds, "c_t_median"),
                median_cell(seeds, "ess_ratio_median"),
                verdict,
            )
        )
        bars.append((label.split("/")[0], mean, 0.0 if math.isnan(half) else half))
    fig, (ax,) = figure(1, width=8.0)
    ax.bar(range(len(bars)), [b[1] for b in bars], yerr=[b[2] for b in bars], capsize=3)
    ax.set_xticks(range(len(bars)), [b[0] for b in bars], rotation=30, ha="right")
    ax.set(ylabel="final held-out pass@1", title=f"Cures at k={k} (95% intervals)")
    fig.savefig(out / "cures.png", dpi=100)
    text = f"Staleness k={k}, {steps} steps.\n\n"
    if reference:
        text += (
            f"Synchronous GRPO (the sync sweep's runs) after the same {steps} steps: held-out "
            f"pass@1 **{ci_cell(reference)}** ({len(reference)} seeds); naive GRPO at k={k}: "
            f"**{ci_cell(values_of(runs[f'naive/k{k}'], 'final_accuracy'))}**.\n\n"
        )
    header = (
        "method",
        "seeds",
        "final pass@1",
        "gain",
        "collapsed",
        "median c_t",
        "median ESS ratio",
        "vs naive (intervals)",
    )
    return {"cures": text + markdown_table(header, rows, escape=False)}


# --------------------------------------------------------------------------------- async


def real_async(runs: dict, lagged: dict, root: Path, lagged_root: Path, out: Path) -> dict:
    gaps, rows = {}, []
    for label, seeds in sorted(runs.items()):
        for s in seeds:
            records = read_metrics(root / label / f"seed{s['seed']}")
            gaps[f"{label} seed {s['seed']}"] = [r["version_gap_mean"] for r in records]
        rows.append(
            (
                label,
                len(seeds),
                median_cell(seeds, "staleness_mean"),
                median_cell(seeds, "staleness_max"),
                ci_cell(values_of(seeds, "final_accuracy")),
                median_cell(seeds, "c_t_median"),
            )
        )
    if not rows:
        return {"async": "No asynchronous run has finished yet."}
    for k in (lab.CURE_LAG, lab.QUICK["cure_lag"]):
        if f"naive/k{k}" in lagged:
            s = lagged[f"naive/k{k}"][0]
            records = read_metrics(lagged_root / f"naive/k{k}" / f"seed{s['seed']}")
            gaps[f"lagged k={k} seed {s['seed']}"] = [r["version_gap_mean"] for r in records]
            break
    fig, (ax,) = figure(1)
    top = max(max(v) for v in gaps.values())
    bins = np.arange(-0.5, top + 1.5, max(1, math.ceil(top / 40)))
    # Widths and dashes that stay visible where the histograms coincide.
    styles = [("-", 3.5), ("--", 2.0), (":", 1.5)]
    for i, (name, values) in enumerate(gaps.items()):
        dash, width = styles[i % len(styles)]
        ax.hist(values, bins=bins, histtype="step", label=name, density=True, ls=dash, lw=width)
    ax.set(
        xlabel="mean version gap of a batch",
        ylabel="fraction of steps",
        title="Staleness: real rollout threads vs lagged mode",
    )
    ax.legend(fontsize="small")
    fig.savefig(out / "async_gaps.png", dpi=100)
    header = ("run", "seeds", "mean staleness", "max staleness", "final pass@1", "median c_t")
    return {"async": markdown_table(header, rows, escape=False)}


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


def publish(blocks: dict[str, str], results_md: str) -> None:
    """Prints each block and writes it into `results_md` (unless it is ``"none"``)."""
    for name, table in blocks.items():
        print(f"## {name}\n{table}\n")
    if results_md != "none":
        rewrite_blocks(Path(results_md), blocks)


def main(argv: Sequence[str] | None = None) -> dict[str, str]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", default="experiments/runs/lab", type=Path)
    parser.add_argument(
        "--v3-root",
        default=None,
        type=Path,
        help="laboratory v3's runs (lab.py --only cell), if not under --root",
    )
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
    args = parser.parse_args(argv)
    global ALLOW_MIXED
    ALLOW_MIXED = args.allow_mixed
    args.out.mkdir(parents=True, exist_ok=True)
    lagged_root, async_root = args.root / "lagged", args.root / "async"
    try:
        lagged_runs = load_summaries(lagged_root) if lagged_root.exists() else []
        async_runs = load_summaries(async_root) if async_root.exists() else []
        lagged, asynchronous = by_label(lagged_runs), by_label(async_runs)
    except ValueError as error:  # Runs of two code versions, without --allow-mixed.
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    _write_csv(lagged_runs + async_runs, args.out / "runs.csv")
    blocks = sync(lagged, lagged_root, args.out)
    blocks.update(staleness(lagged, args.out))
    blocks.update(alignment(lagged, args.out))
    blocks.update(cures(lagged, lagged_root, args.out))
    blocks.update(real_async(asynchronous, lagged, async_root, lagged_root, args.out))
    v3_root, v3 = lagged_root, lagged
    if args.v3_root is not None:
        v3_root = args.v3_root / "lagged"
        try:
            v3 = by_label(load_summaries(v3_root)) if v3_root.exists() else {}
        except ValueError as error:
            parser.exit(2, f"{parser.prog}: error: {error}\n")
    blocks.update(report_v3.blocks(v3, v3_root, args.out))
    publish(blocks, args.results_md)
    return blocks


if __name__ == "__main__":
    main()
