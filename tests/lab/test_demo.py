"""The demo (`gac_jax.lab.demo`, `gac-jax demo`) at a tiny size: both arms trained in two
child processes, the comparison line read back from their metrics, the plot, a rerun that
keeps the finished runs."""

import io
import json

import pytest

from gac_jax.lab.demo import ARMS, REGIME, progress, run_demo
from gac_jax.train.config_io import load_config

pytestmark = pytest.mark.slow


def _eval_pass_at_1(run):
    """(before training, at the last evaluation) of a run's metrics.jsonl, read as JSON."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    first = next(r["eval_start/pass@1"] for r in records if "eval_start/pass@1" in r)
    last = [r["eval/pass@1"] for r in records if "eval/pass@1" in r][-1]
    return first, last


def test_the_demo_trains_both_arms_side_by_side_and_compares_them(tmp_path):
    tiny = [
        "steps=2",
        "eval_every=1",
        "eval_size=8",
        "eval_samples=2",
        "rollout.groups_per_batch=2",
        "generation.group_size=4",
        f"data_dir={tmp_path / 'tfds'}",
    ]
    shown = io.StringIO()
    result = run_demo(tmp_path / "demo", overrides=tiny, stream=shown, every=0.5)
    assert list(result.runs) == list(ARMS) == ["naive", "VCPO"]
    (a, b), (c, d) = (_eval_pass_at_1(run) for run in result.runs.values())
    assert result.line == (
        "held-out pass@1 over 2 updates on rollouts 16 updates old: "
        f"naive {a:.2f} -> {b:.2f}; VCPO {c:.2f} -> {d:.2f}"
    )
    naive, vcpo = (load_config(str(run / "config.json")) for run in result.runs.values())
    assert naive.rollout.lag == vcpo.rollout.lag == 16 and "rollout.lag=16" in REGIME
    assert naive.loss.correction == vcpo.loss.correction == "tis" and naive.steps == 2
    assert naive.ess is None and naive.loss.advantage == "grpo"
    assert vcpo.ess is not None and vcpo.loss.advantage == "vcpo"
    assert result.plot == tmp_path / "demo" / "demo.png"
    assert result.plot.read_bytes()[:4] == b"\x89PNG"
    assert {p.name for p in (tmp_path / "demo").glob("process*.log")} == {
        "process0.log",
        "process1.log",
    }
    lines = shown.getvalue().splitlines()
    logs = tmp_path / "demo" / "process*.log"
    assert lines[0] == f"Training naive, VCPO side by side, logs in {logs}"
    assert all(line.startswith("  naive ") for line in lines[1:])  # `progress`, indented.
    assert progress(result.runs, 2) == (
        f"naive step 2/2, pass@1 {a:.2f} -> {_eval(result, 'naive')} -> {b:.2f}; "
        f"VCPO step 2/2, pass@1 {c:.2f} -> {_eval(result, 'VCPO')} -> {d:.2f}"
    )
    assert progress({"naive": tmp_path / "none"}, 2) == (
        "naive starting (compiling, evaluating the start)"
    )
    # Run again: the finished arms are kept, not retrained, in this process.
    before = [(run / "metrics.jsonl").read_bytes() for run in result.runs.values()]
    again = run_demo(tmp_path / "demo", overrides=tiny, jobs=1, stream=io.StringIO())
    assert again.line == result.line
    assert [(run / "metrics.jsonl").read_bytes() for run in again.runs.values()] == before


def _eval(result, arm):
    """The middle evaluation (after the first update) of `arm`, as `progress` prints it."""
    lines = (result.runs[arm] / "metrics.jsonl").read_text().splitlines()
    return f"{[json.loads(x) for x in lines][0]['eval/pass@1']:.2f}"
