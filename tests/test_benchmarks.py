"""The benchmarks' smoke forms run, so a change that breaks a benchmark fails `make test`
(issue #34: `make bench-async` had rotted unseen). Real processes, tiny shapes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.slow
def test_the_accelerator_benchmark_runs_its_smoke_form_and_writes_its_table(tmp_path):
    out = tmp_path / "accelerator"
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "accelerator.py"), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["backend"] == "cpu" and result["peak_flops"] > 0
    assert 0 < result["learner"]["mfu"] < 1 and result["learner"]["tokens_per_s"] > 0
    assert [row["tokens_per_s"] > 0 for row in result["sampler"]] == [True, True]
    assert all(0 < row["fraction_of_roofline"] for row in result["sampler"])
    assert result["update"]["adamw_ms"] > 0 and result["update"]["gac_ess_ms"] > 0
    table = out.with_suffix(".md").read_text()
    assert table.count("\n| ") == 5  # The header row, the learner, two samplers, the update.
