"""report_v5: a run's numbers from its metrics, paired intervals against a float64
reference, and the blocks rebuilt from the kept runs."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"
sys.path.insert(0, str(EXPERIMENTS))
import report_v5  # noqa: E402


def write_run(directory: Path, kl, skipped, evals) -> None:
    """A run's metrics.jsonl: one record a step, evaluations at the steps `evals` names."""
    directory.mkdir(parents=True)
    rows = [{"step": 0, "eval_start/pass@1": 0.05}]
    for step, (k, s) in enumerate(zip(kl, skipped, strict=True)):
        row = {"step": step, "policy_change/kl": k, "gac_skipped": float(s)}
        if step + 1 in evals:
            row["eval/pass@1"] = evals[step + 1]
        rows.append(row)
    (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_run_numbers_count_only_applied_steps_and_the_longest_streak(tmp_path):
    skipped = [0, 1, 1, 0, 1, 1, 1, 0, 0, 0]
    kl = [0.5, 0.0, 0.0, 0.1, 0.0, 0.0, 0.0, 0.3, 0.2, 0.4]
    write_run(tmp_path / "run", kl, skipped, {4: 0.1, 8: 0.2, 10: 0.3})
    report_v5.SCORE_UPDATES, saved = (4, 8, 10), report_v5.SCORE_UPDATES
    try:
        numbers = report_v5.run_numbers(tmp_path / "run")
    finally:
        report_v5.SCORE_UPDATES = saved
    assert numbers["score"] == pytest.approx(0.2)
    assert numbers["start"] == 0.05 and numbers["final"] == 0.3
    assert numbers["kl_applied"] == pytest.approx(np.median([0.5, 0.1, 0.3, 0.2, 0.4]))
    assert numbers["kl_sum"] == pytest.approx(sum(kl))
    assert numbers["skip_fraction"] == pytest.approx(0.5)
    assert numbers["longest_streak"] == 3


def test_a_run_missing_an_evaluation_has_no_score(tmp_path):
    write_run(tmp_path / "run", [0.1] * 110, [0] * 110, {100: 0.2})
    assert math.isnan(report_v5.run_numbers(tmp_path / "run")["score"])


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.floats(0.0, 0.3), min_size=2, max_size=6),
    st.lists(st.floats(-0.1, 0.1), min_size=6, max_size=6),
)
def test_paired_differences_match_a_float64_t_interval(base, shifts):
    """Arm b is arm a shifted seed by seed; the pairing uses the shared seeds only."""
    a = {s: {"score": x} for s, x in enumerate(base)}
    b = {s: {"score": x - d} for s, (x, d) in enumerate(zip(base, shifts, strict=False))}
    b[99] = {"score": 1.0}  # A seed a lacks is not paired.
    mean, half, n = report_v5.paired(a, b)
    diffs = np.array([a[s]["score"] - b[s]["score"] for s in a], np.float64)
    assert n == len(base)
    assert mean == pytest.approx(diffs.mean(), abs=1e-12)
    expected = stats.t.ppf(0.975, n - 1) * diffs.std(ddof=1) / np.sqrt(n)
    assert half == pytest.approx(expected, abs=1e-12)
    word = report_v5.verdict(mean, half, n).split()[3]
    assert word == ("above" if mean > half else "below" if mean < -half else "within")


def test_verdicts_by_hand():
    assert report_v5.verdict(0.05, 0.02, 5) == "+0.050 ± 0.020 above (5 seeds)"
    assert report_v5.verdict(-0.05, 0.06, 3) == "-0.050 ± 0.060 within (3 seeds)"
    assert report_v5.verdict(-0.154, math.nan, 1) == "-0.154 (1 seed)"
    assert report_v5.verdict(math.nan, math.nan, 0) == "-"


def test_the_blocks_are_rebuilt_from_the_kept_runs():
    """The kept runs give the figures RESULTS.md quotes."""
    root = EXPERIMENTS / "results" / "lab5_runs" / "lagged"
    blocks = report_v5.main(["--root", str(root), "--results-md", "none"])
    assert "naive -0.158 ± 0.006 below (5 seeds)" in blocks["v5_answers"]
    assert "PPO + GAC on updates vs PPO +0.002 ± 0.017 within (5 seeds)" in blocks["v5_answers"]
    assert "| sync | 5 | 0.065 ± 0.005 | 0.180 ± 0.005 |" in blocks["v5_cell"]
    assert "PPO and its rounding-only re-run): 0.015." in blocks["v5_answers"]
    assert "VESPO vs DPPO +0.005 ± 0.009 within (5 seeds)" in blocks["v5_answers"]
    assert "i.i.d. random skips +0.022 ± 0.018 above (5 seeds)" in blocks["v5_answers"]
    assert "in streaks +0.008 ± 0.016 within (5 seeds)" in blocks["v5_answers"]
    assert "own v5 rate and streaks +0.018 ± 0.017 above (5 seeds)" in blocks["v5_answers"]
    harsh = "harsher cell (k64), GAC on a clipped loss: PPO + GAC on updates vs PPO -0.002 ± 0.005"
    assert harsh in blocks["v5_answers"]
    assert "own thresholds vs PPO -0.001 ± 0.007 within (5 seeds)" in blocks["v5_answers"]
    assert "VESPO vs DPPO -0.011 ± 0.007 below (5 seeds)" in blocks["v5_answers"]
    assert "closest to sync: dppo_binary_tv -0.042 ± 0.007 below (5 seeds)." in blocks["v5_answers"]
    assert "closest to sync: vespo -0.024 ± 0.008 below (5 seeds)." in blocks["v5_answers"]
    results = (EXPERIMENTS / "RESULTS.md").read_text()
    for name, block in blocks.items():  # RESULTS.md holds what the kept runs give.
        assert f"<!-- BEGIN {name} -->\n{block}\n<!-- END {name} -->" in results, name


def test_a_cells_answers_name_only_the_comparisons_it_runs():
    """The harsher cell runs no bias-against-drift arm and no half step: its lines do not
    say those are "not run yet"; its arms not yet run are."""
    scores = {"sync": 0.18, "ppo": 0.10, "ppo_gac_update": 0.12}
    harsh = {arm: {s: {"score": x + 0.01 * s} for s in range(3)} for arm, x in scores.items()}
    text = report_v5.answers({}, harsh, math.nan)
    harsh_lines = [line for line in text.splitlines() if "harsher cell" in line]
    assert "PPO + GAC on updates vs PPO +0.020 ± 0.000 above (3 seeds)" in harsh_lines[0]
    assert "half the step" not in text and "bias against drift" not in text
    assert "random skips" not in text and "VESPO vs PPO not run yet" in text
    assert harsh_lines[-1].endswith(
        "closest to sync: ppo_gac_update -0.060 ± 0.000 below (3 seeds)."
    )
