"""The laboratory's --quick subset end to end: experiments/lab.py trains every sweep's runs,
experiments/report.py turns them into RESULTS.md's tables, and the tables hold the runs'
numbers (changing a run's summary changes the table)."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gac_jax.train.metrics import read_metrics
from tests.conftest import process_env

REPO = Path(__file__).resolve().parents[2]
EXPERIMENTS = REPO / "experiments"
sys.path.insert(0, str(EXPERIMENTS))
import lab  # noqa: E402
import report  # noqa: E402


def _block(text: str, name: str) -> str:
    match = re.search(rf"<!-- BEGIN {name} -->\n(.*?)<!-- END {name} -->", text, re.S)
    assert match, f"no block {name}"
    return match.group(1)


def _row(block: str, *first_cells: str) -> list[str]:
    """The cells of the table row whose first cells are `first_cells`."""
    for line in block.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[: len(first_cells)] == list(first_cells):
            return cells
    raise AssertionError(f"no row {first_cells} in\n{block}")


def _env() -> dict[str, str]:
    """This environment without conftest's 8 fake devices (the scripts run on one), LLVM's
    optimisations off (`process_env`: compiles are most of a quick run's time; the tests
    compare the report with the runs' own numbers, whatever the code generation)."""
    return process_env(None)


def _summary(root: Path, label: str) -> dict:
    return json.loads((root / label / "seed0" / "summary.json").read_text())


def _script(name: str, *args: str, timeout: int = 300) -> None:
    """Runs experiments/`name` with `args`; fails the test with its stderr if it fails."""
    done = subprocess.run(
        [sys.executable, str(EXPERIMENTS / name), *args],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def _report(root: Path, out: Path) -> str:
    results = out / "RESULTS.md"
    _script("report.py", "--root", str(root), "--out", str(out), "--results-md", str(results))
    return results.read_text()


@pytest.fixture(scope="module")
def quick_lab(tmp_path_factory):
    root = tmp_path_factory.mktemp("lab")
    done = subprocess.run(
        [sys.executable, str(EXPERIMENTS / "lab.py"), "--quick", "--root", str(root / "runs")],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    out = root / "results"
    out.mkdir()
    shutil.copy(EXPERIMENTS / "RESULTS.md", out / "RESULTS.md")
    return root / "runs", out, _report(root / "runs", out)


def test_the_quick_subset_trains_every_sweep_once(quick_lab):
    runs, _, _ = quick_lab
    expected = {(s.label, s.seed) for s in lab.specs_of(list(lab.SWEEPS), None, quick=True)}
    found = {
        (str(p.parent.parent.relative_to(folder)), int(p.parent.name.removeprefix("seed")))
        for folder in (runs / "lagged", runs / "async", runs / "tools")
        for p in folder.glob("**/summary.json")
    }
    assert found == expected and len(expected) == 26  # v5: two quick runs


def test_the_report_tables_are_the_runs_numbers(quick_lab):
    runs, out, text = quick_lab
    lagged = runs / "lagged"
    sync = _block(text, "sync")
    first = read_metrics(lagged / lab.SYNC_LABEL / "seed0")[0]
    assert _row(sync, "0")[1] == f"{first['eval_start/pass@1']:.3f}"
    assert f"**{_summary(lagged, lab.SYNC_LABEL)['gain']:.3f}**" in sync
    stale = _summary(lagged, lab.staleness_label(lab.LAB_LEARNING_RATE, 2))
    row = _row(_block(text, "staleness"), f"{lab.LAB_LEARNING_RATE:g}", "2")
    assert row[3] == f"{stale['final_accuracy']:.3f}"
    assert row[6] == f"{stale['ess_ratio_median']:.3g}"
    align = _summary(lagged, "align_g2/k0")
    row = _row(_block(text, "alignment"), "2", "0")
    assert math.isfinite(align["b_simple"]) and row[3] == f"{align['b_simple']:.0f}"
    ratio = align["noise_batch_size"] / align["b_simple"]
    assert row[7] == f"{1 / (1 + 1 / ratio):.3f}"
    gac = _summary(lagged, "gac/k2")
    assert _row(_block(text, "cures"), "gac")[2] == f"{gac['final_accuracy']:.3f}"
    asynchronous = _summary(runs / "async", "naive/async")
    assert _row(_block(text, "async"), "naive/async")[2] == f"{asynchronous['staleness_mean']:.3g}"
    naive = _summary(lagged, lab.cell_label("naive", 2))
    row = _row(_block(text, "v3_cell"), "naive")
    assert row[1] == "1" and row[-7] == str(int(naive["collapsed"]))
    assert f"{naive['final_accuracy']:.3f}" in row
    gac = _summary(lagged, "v3/gac/k2")
    assert _row(_block(text, "v3_gac"), "gac")[2] == f"{gac['project_fraction']:.3f}"
    assert "fired before the collapse" in _block(text, "v3_diagnostics")
    ppo = _summary(lagged, "v3map/ppo/k2")
    assert _row(_block(text, "v3_map"), "ppo", "2")[3] == f"{ppo['final_accuracy']:.3f}"
    for png in ("sync_curve", "staleness", "alignment", "cures", "async_gaps", "v3_cell"):
        assert (out / f"{png}.png").stat().st_size > 1000


def test_the_v4_tables_are_the_runs_numbers(quick_lab):
    runs, out, _ = quick_lab
    results = out / "RESULTS.md"
    _script(
        "report_v4.py",
        "--root",
        str(runs / "lagged"),
        "--out",
        str(out),
        "--results-md",
        str(results),
    )
    text = results.read_text()
    lagged = runs / "lagged"
    naive = _summary(lagged, "v4/naive/k2")
    row = _row(_block(text, "v4_cell"), "naive")
    assert row[1] == "1" and f"{naive['final_accuracy']:.3f}" in row
    assert row[-8] == f"{naive['policy_kl_median']:.3g}"
    gac = _summary(lagged, "v4/gac_update/k2")
    row = _row(_block(text, "v4_gac"), "gac_update")
    assert row[3] == f"{gac['skip_fraction']:.3f}"
    assert row[-1] == f"{gac['update_cosine_median']:.3g}"
    mapped = _summary(lagged, "v4map/g2/k2")
    map_row = _row(_block(text, "v4_map"), "2", "2")
    assert map_row[3] == f"{mapped['final_accuracy']:.3f}"
    records = read_metrics(lagged / "v4map/g2/k2" / "seed0")[1:41]  # Before the loss.
    early_kl = np.median([r["policy_change/kl"] for r in records])
    assert map_row[8] == f"{early_kl:.3g}" and map_row[7] == f"{mapped['policy_kl_median']:.3g}"
    assert (out / "v4_cell.png").stat().st_size > 1000


def test_the_tool_table_is_the_runs_numbers(quick_lab):
    runs, out, _ = quick_lab
    results = out / "RESULTS.md"
    _script(
        "report_tools.py",
        "--root",
        str(runs / "tools"),
        "--out",
        str(out),
        "--results-md",
        str(results),
    )
    block = _block(results.read_text(), "tools_cell")
    naive = _summary(runs / "tools", "tools/naive/k2")
    row = _row(block, "v3 regime, naive k=2")
    assert row[1] == "1" and f"{naive['final_accuracy']:.3f}" in row
    assert (out / "tools_cell.png").stat().st_size > 1000


def test_an_edited_summary_changes_the_table(quick_lab, tmp_path):
    runs, _, _ = quick_lab
    copy = tmp_path / "runs"
    shutil.copytree(runs, copy)
    path = copy / "lagged" / "gac/k2" / "seed0" / "summary.json"
    summary = json.loads(path.read_text())
    path.write_text(json.dumps({**summary, "final_accuracy": 0.987}))
    out = tmp_path / "results"
    out.mkdir()
    shutil.copy(EXPERIMENTS / "RESULTS.md", out / "RESULTS.md")
    assert _row(_block(_report(copy, out), "cures"), "gac")[2] == "0.987"


def test_the_norm_gac_removed_is_read_from_the_cosines():
    # A projection along the reference keeps the orthogonal part: the fraction of the norm
    # removed follows from the cosines before and after, checked against the vectors.
    import report_v3

    rng = np.random.default_rng(0)
    r, g = rng.normal(size=50), rng.normal(size=50) + 0.8 * rng.normal(size=50)
    g = g + 1.5 * r  # Aligned with the reference.
    unit = r / np.linalg.norm(r)
    projected = g - 0.7 * (g @ unit) * unit
    cos = lambda a: float(a @ unit / np.linalg.norm(a))  # noqa: E731
    records = [
        {"step": 0},
        {
            "step": 1,
            "grad_norm": 1.0,
            "gac_regime": 1,
            "gac_cosine": cos(g),
            "gac_cosine_after": cos(projected),
        },
        {"step": 2, "grad_norm": 1.0, "gac_regime": 2, "gac_cosine": 0.9, "gac_cosine_after": 0.0},
        {"step": 3, "grad_norm": 1.0, "gac_regime": 0, "gac_cosine": 0.1, "gac_cosine_after": 0.1},
        {"step": 4, "grad_norm": 0.0, "gac_regime": 2, "gac_cosine": 0.0, "gac_cosine_after": 0.0},
    ]
    removed = 1 - np.linalg.norm(projected) / np.linalg.norm(g)
    np.testing.assert_allclose(report_v3.removed_fraction(records), (removed + 1 + 0) / 3)


def test_intervals_are_student_t_intervals_of_the_mean():
    x = [0.21, 0.25, 0.19, 0.23, 0.22]
    mean, half = report.interval(x)
    # t_{0.975, 4} = 2.7764 (a table's value).
    assert mean == pytest.approx(np.mean(x))
    assert half == pytest.approx(2.7764 * np.std(x, ddof=1) / np.sqrt(5), rel=1e-4)
    assert report.ci_cell([0.5]) == "0.500" and math.isnan(report.interval([0.5])[1])


def test_a_child_runs_only_the_sweeps_its_parent_names():
    args = lab._parser().parse_args(["--quick", "--only", "sync", "cures", "--only", "async"])
    assert args.only == ["async"] and args.quick


def test_the_kept_runs_give_the_same_report(quick_lab, tmp_path):
    # experiments/keep_runs.py keeps what the report reads; the rest stays behind.
    runs, _, text = quick_lab
    kept = tmp_path / "kept"
    _script("keep_runs.py", "--root", str(runs), "--out", str(kept), timeout=120)
    assert not list(kept.glob("**/checkpoints"))
    sync_record = read_metrics(kept / "lagged" / lab.SYNC_LABEL / "seed0")[-1]
    assert "loss" not in sync_record and "step" in sync_record
    out = tmp_path / "results"
    out.mkdir()
    shutil.copy(EXPERIMENTS / "RESULTS.md", out / "RESULTS.md")
    again = _report(kept, out)
    for name in ("sync", "staleness", "alignment", "cures", "async"):
        assert _block(again, name) == _block(text, name)


def test_the_collapse_onset_is_where_the_reward_first_halves():
    import report_v3

    records = [{"step": t, "reward": 0.2 if t < 30 else 0.0} for t in range(80)]
    # The first 10-step window below half the first window's mean ends at step 34
    # (steps 25-34: five at 0.2, five at 0, mean 0.1 is not below 0.1; 26-35 is).
    assert report_v3.collapse_onset(records) == 35
    steady = [{"step": t, "reward": 0.2} for t in range(80)]
    assert report_v3.collapse_onset(steady) == 79  # None: the last step.
