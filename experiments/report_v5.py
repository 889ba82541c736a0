"""Laboratory v5's tables (issue #62), from the runs of `lab.py --only v5pilot v5 v5floor v5harsh`.

    python experiments/report_v5.py [--root experiments/runs/lab/lagged]
        [--results-md experiments/RESULTS.md]

Every number is read from the runs' own metrics (``metrics.jsonl``), paired by seed (the
same seed draws the same first batches in every arm):

- the **score** of a run: the mean of its held-out pass@1 after 100, 125 and 150 updates
  (one evaluation is noisy beyond its seed: v4's PPO k=16 seed 0 re-run moved 0.156 ->
  0.114 at 150 updates from rounding alone);
- **paired differences**: for arms A and B, the per-seed differences of their scores, with
  a 95% Student-t interval; "above" / "below" where the interval excludes 0, "within"
  otherwise;
- the **rounding floor**: PPO re-run with its step in two micro-batches (the same gradient in
  exact arithmetic, other roundings): how far rounding alone moves a score;
- per-step KL(behaviour-free policy change) over *applied* steps (a skipped step moves
  nothing and is not counted) and summed over the run; the skip fraction and the longest
  streak of skips.

Blocks written into RESULTS.md: ``v5_cell``, ``v5_harsh``, ``v5_floor``, ``v5_answers``.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
# ruff: noqa: E402  (experiments/ is importable first)
import lab
from report import by_label, publish
from report_tables import ci_cell, interval

from gac_jax.lab.sweeps import load_summaries
from gac_jax.train.metrics import markdown_table, read_metrics

SCORE_UPDATES = (100, 125, 150)
KL = "policy_change/kl"


def run_numbers(directory: Path) -> dict[str, float]:
    """One run's score, start, KL and skip figures, from its metrics."""
    records = read_metrics(directory)
    evals = {r["step"] + 1: r["eval/pass@1"] for r in records if "eval/pass@1" in r}
    start = next((r["eval_start/pass@1"] for r in records if "eval_start/pass@1" in r), math.nan)
    trained = [r for r in records if KL in r]
    skipped = np.array([r.get("gac_skipped", 0.0) > 0 for r in trained], dtype=bool)
    kl = np.array([r[KL] for r in trained], dtype=np.float64)
    streak = longest = 0
    for s in skipped:
        streak = streak + 1 if s else 0
        longest = max(longest, streak)
    missing = [u for u in SCORE_UPDATES if u not in evals]
    return {
        "score": math.nan if missing else float(np.mean([evals[u] for u in SCORE_UPDATES])),
        "start": start,
        "final": evals.get(max(SCORE_UPDATES), math.nan),
        "kl_applied": float(np.median(kl[~skipped])) if (~skipped).any() else math.nan,
        "kl_sum": float(kl.sum()),
        "skip_fraction": float(skipped.mean()) if len(skipped) else math.nan,
        "longest_streak": float(longest),
        **{f"eval{u}": v for u, v in evals.items()},
    }


def arms(runs: dict, root: Path, prefix: str) -> dict[str, dict[int, dict[str, float]]]:
    """``{arm: {seed: run_numbers}}`` for the labels under `prefix` (``v5/`` or ``v5_k64/``)."""
    out: dict[str, dict[int, dict[str, float]]] = {}
    for label, seeds in runs.items():
        if not label.startswith(prefix):
            continue
        name = label[len(prefix) :].split("/")[0]
        out[name] = {s["seed"]: run_numbers(root / label / f"seed{s['seed']}") for s in seeds}
    return out


def paired(a: dict[int, dict], b: dict[int, dict], key: str = "score") -> tuple[float, float, int]:
    """Mean and 95% half-width of the per-seed differences a - b over their shared seeds."""
    seeds = sorted(set(a) & set(b))
    diffs = [a[s][key] - b[s][key] for s in seeds]
    diffs = [d for d in diffs if math.isfinite(d)]
    if not diffs:
        return math.nan, math.nan, 0
    mean, half = interval(diffs)
    return mean, half, len(diffs)


def verdict(mean: float, half: float, seeds: int) -> str:
    """``+0.012 ± 0.020 within (5 seeds)``: the paired mean, its 95% half-width, and whether
    the interval lies above 0, below it, or holds it."""
    if math.isnan(mean):
        return "-"
    if math.isnan(half):
        return f"{mean:+.3f} (1 seed)"
    word = "above" if mean - half > 0 else "below" if mean + half < 0 else "within"
    return f"{mean:+.3f} ± {half:.3f} {word} ({seeds} seeds)"


def _cell(values: Sequence[float], digits: int = 3) -> str:
    finite = [v for v in values if math.isfinite(v)]
    return ci_cell(finite, digits) if finite else "-"


def cell_table(found: dict, baselines: Sequence[str]) -> str:
    """One row an arm: seeds, score, paired differences against each baseline, KL, skips."""
    rows = []
    for name, seeds in found.items():
        v = list(seeds.values())
        row = [name, str(len(v)), _cell([x["start"] for x in v]), _cell([x["score"] for x in v])]
        for base in baselines:
            row.append(
                "-" if name == base or base not in found else verdict(*paired(seeds, found[base]))
            )
        row += [
            f"{np.nanmedian([x['kl_applied'] for x in v]):.4f}",
            _cell([x["kl_sum"] for x in v], 2),
            _cell([x["skip_fraction"] for x in v], 2),
            f"{max(x['longest_streak'] for x in v):.0f}",
        ]
        rows.append(row)
    headers = ["arm", "seeds", "pass@1 at 0", "score (100-150)"]
    headers += [f"paired vs {b}" for b in baselines]
    headers += ["median KL / applied step", "summed KL", "skip fraction", "longest skip streak"]
    return markdown_table(headers, rows)


def floor_table(found: dict) -> tuple[str, float]:
    """PPO against its rounding-only re-run, seed by seed; returns the table and the largest
    score difference (the floor)."""
    ppo, floor = found.get("ppo", {}), found.get("ppo_floor", {})
    rows, diffs = [], []
    for seed in sorted(set(ppo) & set(floor)):
        a, b = ppo[seed], floor[seed]
        diffs.append(abs(a["score"] - b["score"]))
        rows.append([str(seed), f"{a['score']:.3f}", f"{b['score']:.3f}", f"{a['final']:.3f}",
                     f"{b['final']:.3f}", f"{diffs[-1]:.3f}"])  # fmt: skip
    headers = ["seed", "ppo score", "re-run score", "ppo at 150", "re-run at 150", "|score diff|"]
    return markdown_table(headers, rows), (max(diffs) if diffs else math.nan)


# The answers' comparisons, a line a topic: (topic, ((text, arm, baseline), ...)). A cell's
# line names only the comparisons whose two arms that cell runs (the harsher cell runs fewer).
QUESTIONS = (
    ("GAC on a clipped loss", (
        ("PPO + GAC on updates vs PPO", "ppo_gac_update", "ppo"),
        ("PPO + GAC on updates at the cell's own thresholds vs PPO", "ppo_gac_update_own", "ppo"),
        ("PPO + GAC on gradients vs PPO", "ppo_gac", "ppo"),
        ("PPO + GAC on updates vs PPO at half the step", "ppo_gac_update",
         f"ppo_lr{lab.V4_LR / 2:g}"),
    )),
    ("bias against drift", (
        ("REINFORCE + token TIS 2 vs naive", "reinforce_tis2", "naive"),
        ("trust region with unit weights vs naive", "naive_trust_region", "naive"),
    )),
    ("GAC against random skips at its rate", (
        ("GAC on updates vs i.i.d. random skips", "gac_update", "random_skip"),
        ("vs random skips in streaks", "gac_update", "random_skip_streaks"),
        ("vs random skips at its own v5 rate and streaks", "gac_update", "random_skip_matched"),
    )),
    ("the 2026 cures and VCPO", (
        ("VESPO vs PPO", "vespo", "ppo"),
        ("DPPO binary TV vs PPO", "dppo_binary_tv", "ppo"),
        ("VESPO vs DPPO", "vespo", "dppo_binary_tv"),
        ("VCPO vs PPO", "vcpo", "ppo"),
    )),
)  # fmt: skip


def answers(cell: dict, harsh: dict, floor: float) -> str:
    """The few lines at the top: each question read from its paired interval."""

    def vs(a, b, found):
        if a not in found or b not in found:
            return "not run yet"
        return verdict(*paired(found[a], found[b]))

    lines = [
        f"- Rounding floor (largest |score difference| of PPO and its rounding-only re-run): "
        f"{floor:.3f}."
        if math.isfinite(floor)
        else "- Rounding floor: not run yet.",
    ]
    for found, where, design in (
        (cell, "main cell (k=16, lr 5e-4)", set(lab.V5_CELL)),
        (harsh, f"harsher cell ({lab.V5_HARSH})", set(lab.V5_HARSH_ARMS)),
    ):
        if not found:
            lines.append(f"- {where}: no runs yet.")
            continue
        for topic, comparisons in QUESTIONS:
            said = [f"{text} {vs(a, b, found)}" for text, a, b in comparisons if {a, b} <= design]
            if said:
                lines.append(f"- {where}, {topic}: " + "; ".join(said) + ".")
        cures = [name for name in found if name not in ("sync", "ppo_floor")]
        near = [f"{name} {vs(name, 'sync', found)}" for name in cures]
        lines.append(f"- {where}, each arm vs sync (paired): " + "; ".join(near) + ".")
        if "sync" in found and cures:
            gap = {name: paired(found[name], found["sync"])[0] for name in cures}
            best = max(cures, key=lambda name: -math.inf if math.isnan(gap[name]) else gap[name])
            lines.append(f"- {where}, closest to sync: {best} {vs(best, 'sync', found)}.")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, str]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", default="experiments/runs/lab/lagged", type=Path)
    parser.add_argument("--results-md", default="experiments/RESULTS.md")
    args = parser.parse_args(argv)
    runs = by_label([s for s in load_summaries(args.root) if s["label"].startswith("v5")])
    cell = arms(runs, args.root, "v5/")
    harsh = arms(runs, args.root, f"v5_{lab.V5_HARSH}/")
    if "sync" in cell and harsh:
        harsh = {"sync": cell["sync"], **harsh}
    floor_block, floor = floor_table(cell)
    blocks = {
        "v5_answers": answers(cell, harsh, floor),
        "v5_cell": cell_table(
            {k: v for k, v in cell.items() if k != "ppo_floor"}, ("sync", "ppo", "naive")
        ),  # fmt: skip
        "v5_harsh": cell_table(harsh, ("sync", "ppo")) if harsh else "no runs yet",
        "v5_floor": floor_block,
    }
    publish(blocks, args.results_md)
    return blocks


if __name__ == "__main__":
    main()
