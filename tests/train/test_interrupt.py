"""SIGTERM (a preempted machine) during a run: the step finishes, a checkpoint is written,
the process exits with 128 + 15 and one line saying how to resume, and the resumed run
continues exactly as the uninterrupted one (lagged mode is deterministic). Real processes."""

import os
import shlex
import signal
import subprocess
import sys
import time

import pytest

from gac_jax.train import loop
from gac_jax.train.config import TrainConfig
from gac_jax.train.config_io import apply_overrides, save_config
from gac_jax.train.metrics import read_metrics

TIMING = ("per_s", "seconds", "wait")
STEPS = 8


def _cli(*args):
    return [sys.executable, "-m", "gac_jax.train.cli", *args]


def _comparable(records):
    return [{k: v for k, v in r.items() if not any(t in k for t in TIMING)} for r in records]


@pytest.fixture(scope="module")
def config_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("interrupt")
    config = apply_overrides(
        TrainConfig(),
        [
            "task=arithmetic/add2",
            f"data_dir={root / 'tfds'}",
            "init=random",
            f"steps={STEPS}",
            "eval_every=0",
            "checkpoint_every=100",
            "rollout.mode=lagged",
            "rollout.lag=2",
            "rollout.groups_per_batch=2",
            "generation.group_size=2",
            "generation.prompt_length=12",
            "generation.max_new_tokens=5",
            "mesh.data=1",
        ],
    )
    return save_config(config, root / "config.yaml")


def _lines(path):
    try:
        return len(path.read_text().splitlines())
    except FileNotFoundError:
        return 0


@pytest.mark.slow
def test_sigterm_checkpoints_and_the_resumed_run_continues_exactly(config_file, tmp_path):
    straight = tmp_path / "straight"
    done = subprocess.run(_cli("train", "--config", str(config_file), "--out", str(straight)))
    assert done.returncode == 0

    run = tmp_path / "run"
    process = subprocess.Popen(
        _cli("train", "--config", str(config_file), "--out", str(run)),
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 300
    while _lines(run / "metrics.jsonl") < 2 and time.monotonic() < deadline:
        assert process.poll() is None, process.stderr.read()
        time.sleep(0.05)
    os.kill(process.pid, signal.SIGTERM)
    _, err = process.communicate(timeout=300)
    assert process.returncode == 128 + signal.SIGTERM, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("SIGTERM: stopped after step ") and "--resume`." in last
    # Acknowledged when it came, before the step it let finish.
    assert "SIGTERM: finishing the current step, then saving a checkpoint" in err
    stopped_at = _lines(run / "metrics.jsonl")
    assert 2 <= stopped_at < STEPS
    assert (run / "checkpoints" / str(stopped_at)).is_dir()

    resumed = subprocess.run(shlex.split(last.split("`")[1]))  # The command as printed.
    assert resumed.returncode == 0
    a = read_metrics(straight / "metrics.jsonl")
    b = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in b] == list(range(STEPS))
    assert _comparable(a) == _comparable(b)


@pytest.mark.parametrize(
    ("argv0", "expected"),
    [
        ("/opt/my env/.venv/bin/gac-jax", "'/opt/my env/.venv/bin/gac-jax'"),
        (".venv/bin/gac-jax", os.path.abspath(".venv/bin/gac-jax")),
        (loop.__file__.replace("loop.py", "cli.py"), f"{sys.executable} -m gac_jax.train.cli"),
        ("/usr/lib/python3/site-packages/pytest/__main__.py", "gac-jax"),  # Called from Python.
    ],
)
def test_the_resume_command_is_the_command_that_ran(monkeypatch, argv0, expected):
    monkeypatch.setattr(sys, "argv", [argv0, "train"])
    stopped = loop.RunInterrupted("runs/my run", 3, signal.SIGINT)
    assert str(stopped).endswith(f"resume with `{expected} train --out 'runs/my run' --resume`.")
