"""experiments/rerun_check.py: a re-run equals its kept run only if every shared
non-timing value does, bit for bit."""

from __future__ import annotations

import json
import sys
from pathlib import Path

EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"
sys.path.insert(0, str(EXPERIMENTS))
import rerun_check  # noqa: E402


def _run(directory: Path, records) -> Path:
    directory.mkdir(parents=True)
    (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return directory


KEPT = [
    {"step": 0, "loss": 0.5, "grad_norm": 1.25, "train_seconds": 3.0, "kl": "NaN"},
    {"step": 1, "loss": 0.25, "grad_norm": 1.0, "train_seconds": 2.0, "kl": 0.1},
]


def test_an_equal_rerun_passes_with_timings_and_new_metrics_aside(tmp_path, capsys):
    _run(tmp_path / "kept/a/seed0", KEPT)
    rerun = [{**r, "train_seconds": 9.0, "new_metric": 1.0} for r in KEPT]
    _run(tmp_path / "new/a/seed0", rerun)
    assert rerun_check.main([str(tmp_path / "kept"), str(tmp_path / "new")]) == 0
    out = capsys.readouterr().out
    assert "2 of 2 steps, 8 values compared, 0 differ; 1 metrics only in the re-run" in out


def test_one_last_bit_of_difference_fails_and_is_named(tmp_path, capsys):
    _run(tmp_path / "kept/a/seed0", KEPT)
    rerun = [KEPT[0], {**KEPT[1], "grad_norm": 1.0000001}]
    _run(tmp_path / "new/a/seed0", rerun)
    assert rerun_check.main([str(tmp_path / "kept"), str(tmp_path / "new")]) == 1
    assert "step 1 grad_norm: kept 1.0, re-run 1.0000001" in capsys.readouterr().out


def test_a_rerun_without_a_kept_run_fails(tmp_path, capsys):
    _run(tmp_path / "kept/a/seed0", KEPT)
    _run(tmp_path / "new/b/seed0", KEPT)
    assert rerun_check.main([str(tmp_path / "kept"), str(tmp_path / "new")]) == 1
    assert "no kept run" in capsys.readouterr().out
