"""The benchmarks' smoke forms run, so a change that breaks a benchmark fails `make test`
(issue #34: `make bench-async` had rotted unseen). Real processes, tiny shapes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import process_env

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.slow
def test_the_accelerator_benchmark_runs_its_smoke_form_and_writes_its_table(tmp_path):
    out = tmp_path / "accelerator"
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "accelerator.py"), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        env=process_env(8),
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


@pytest.mark.slow
def test_the_real_shapes_benchmark_trains_the_one_gpu_preset_in_its_smoke_form(tmp_path):
    # The preset's own run on a tiny Qwen3 written as `hf download` leaves one (random
    # weights, a BPE of fewer ids than the model draws), planned then trained.
    out = tmp_path / "real_shapes"
    _run("real_shapes.py", "--smoke", "--steps", "1", "--out", str(out), env=process_env(1))
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["preset"].startswith("tiny, gsm8k, sync") and result["batch"] == [4, 520]
    assert result["timed_steps"] == 1 and 0 < result["generated_tokens"] <= 4 * 8
    assert result["step_seconds"] >= result["learner_seconds"] > 0
    assert 0 < result["learner_mfu"] < 1 and result["generate_tokens_per_s"] > 0
    assert result["plan_learner_peak_gib"] > 0 and result["plan_sampler_peak_gib"] > 0
    assert result["measured_peak_gib"] is None  # XLA:CPU keeps no allocator statistics.
    assert out.with_suffix(".md").read_text().count("\n| ") == 8


def _run(script: str, *args: str, timeout: int = 600, env=None) -> str:
    """Runs benchmarks/`script` (by default with the suite's 8 fake devices and LLVM's
    optimisations off: a smoke form checks the script, not its code generation)."""
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=process_env(8) if env is None else env,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return done.stdout


@pytest.mark.slow
def test_the_speed_canary_runs_its_smoke_form():
    # Its decode is checked token for token against the plain scan's inside the script.
    out = _run("canary.py", "--smoke", env=process_env(1))
    assert "canary (tiny, 1 rounds" in out and "sampler " in out and "learner step " in out


@pytest.mark.slow
def test_the_transforms_benchmark_runs_its_smoke_form():
    out = _run("transforms.py", "--smoke")
    for name in ("adamw", "gac+ess", "full chain", "full, ref donated"):
        assert name in out


@pytest.mark.slow
def test_the_optimizer_compile_benchmark_runs_its_smoke_form():
    out = _run("optimizer_compile.py", "--smoke", env=process_env(1))
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["8"], ["16"])]
    assert [(r[0], r[1]) for r in rows] == [
        (n, chain) for n in ("8", "16") for chain in ("adamw", "default", "gac+ess")
    ]


@pytest.mark.slow
def test_the_learner_benchmark_runs_its_smoke_form():
    out = _run("learner.py", "--smoke")
    assert "peak: jitted" in out and "options on tiny" in out
    assert "MFU" in out or "mfu" in out


@pytest.mark.slow
def test_the_pipeline_benchmark_runs_its_smoke_form():
    out = _run("pipeline.py", "--smoke")
    assert "(a) buffer overhead" in out and "(b) measured at max_new_tokens=16" in out
    assert "block policy, the real RolloutBuffer" in out


@pytest.mark.slow
def test_the_sampler_benchmark_runs_its_smoke_form():
    out = _run("sampler.py", "--quick")
    assert "slots / all tokens/s: median ratio" in out


@pytest.mark.slow
def test_the_async_benchmark_runs_every_layout_in_its_smoke_form():
    out = _run("async_throughput.py", "--smoke")
    for setting in ("sync", "async shared", "async split", "async in-flight"):
        assert f"\n{setting} " in out, setting
    for layout in ("sync", "split", "split-inflight"):
        assert f"\n{layout} " in out, layout
    assert "fed the costs measured on the shared fake devices" in out
    assert "fed the costs measured in the pinned split" in out
    assert "weights per version: put" in out


@pytest.mark.slow
def test_the_tool_episodes_benchmark_runs_its_smoke_form():
    # The two-core part's split layout is run below (each layout is a minute of Ray start).
    out = _run("tool_episodes.py", "--smoke", "--no-pinned")
    assert "\n  sync " in out and "\n  async-group " in out and "\n  async-batch " in out
    assert "predicted, a group a call: sync" in out and "predicted, a batch a call: sync" in out
    assert "tool calls/episode" in out


@pytest.mark.slow
def test_tool_episodes_run_on_the_pinned_split(tmp_path):
    """A Ray actor pinned to one core samples the slow calculator's episodes (imported
    by its path in the actor) while the learner trains on the other."""
    out = _run(
        "pinned_split.py",
        "--workload",
        "tools",
        "--layout",
        "split",
        "--smoke",
        "--rounds",
        "1",
        "--steps",
        "1",
        "--json",
        str(tmp_path / "split.json"),
    )
    result = json.loads((tmp_path / "split.json").read_text())
    assert result["workload"] == "tools" and result["medians"]["episodes_per_s"] > 0
    assert "weight transfer per version" in out
