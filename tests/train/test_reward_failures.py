"""A run's own reward that hangs, raises, returns NaN or a string (issue #33): the run
finishes, each kind is counted in the metrics, one warning line per kind; a reward that
always fails stops the run in one line; SIGTERM while the reward hangs saves and exits
within a bound. Real runs through the CLI; the SIGTERM one in a real process."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from gac_jax.train.cli import main
from gac_jax.train.metrics import read_metrics

SMALL = [
    "task=arithmetic/add2",
    "init=random",
    "eval_every=0",
    "checkpoint_every=0",
    "rollout.mode=lagged",
    "rollout.lag=1",
    "rollout.groups_per_batch=2",
    "generation.group_size=5",
    "generation.prompt_length=12",
    "generation.max_new_tokens=4",
    "mesh.data=1",
    "reward_guard.timeout=0.5",
]

# Calls cycle through five behaviours, so each batch of 10 completions holds two of each.
REWARDS = """
import itertools, time

_calls = itertools.count()

def flaky(completion, example):
    kind = next(_calls) % 5
    if kind == 0:
        time.sleep(5)
    if kind == 1:
        raise RuntimeError("judge unreachable")
    if kind == 2:
        return float("nan")
    if kind == 3:
        return "0.5"
    return 1.0

def broken(completion, example):
    raise KeyError("score")

def hangs(completion, example):
    time.sleep(120)
    return 1.0
"""


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    (tmp_path / "bad_rewards.py").write_text(textwrap.dedent(REWARDS))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "bad_rewards"
    sys.modules.pop("bad_rewards", None)


def test_each_kind_of_failure_is_counted_and_the_run_finishes(
    reward_module, tmp_path, capsys, caplog
):
    out = tmp_path / "run"
    overrides = [*SMALL, "steps=2", f"reward={reward_module}:flaky"]
    main(
        ["train", "--set", *overrides, "reward_guard.max_failure_fraction=null", "--out", str(out)]
    )
    records = read_metrics(out / "metrics.jsonl")
    assert [r["reward/timeouts"] for r in records] == [2.0, 2.0]
    assert [r["reward/failures"] for r in records] == [6.0, 6.0]  # Raised, NaN, string.
    assert [r["reward"] for r in records] == pytest.approx([0.2, 0.2])  # 2 of 10 scored 1.
    warnings = [r.getMessage() for r in caplog.records if "bad_rewards:flaky" in r.getMessage()]
    assert len(warnings) == 2, warnings  # One failure line, one timeout line.
    assert all("\n" not in w for w in warnings)
    assert "reward-fail 6 reward-timeout 2" in capsys.readouterr().err


def test_a_reward_that_always_fails_stops_the_run_in_one_line(reward_module, tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", "--set", *SMALL, "steps=3", f"reward={reward_module}:broken"]
    assert main([*argv, "--out", str(out)]) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("gac-jax train: error: step 0: reward bad_rewards:broken failed on 10")
    assert "max_failure_fraction=1" in last


@pytest.mark.slow
def test_sigterm_while_the_reward_hangs_saves_and_exits_in_bounded_time(reward_module, tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    overrides = [
        *SMALL,
        "steps=1000",
        "checkpoint_every=1000",
        "reward_guard.timeout=1.0",
        "reward_guard.max_failure_fraction=null",
        f"reward={reward_module}:hangs",
    ]
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gac_jax.train.cli",
            "train",
            "--set",
            *overrides,
            "--out",
            str(out),
        ],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    deadline = time.monotonic() + 300
    metrics = out / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().strip()):
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    signalled = time.monotonic()
    os.kill(process.pid, signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    took = time.monotonic() - signalled
    assert process.returncode == 128 + signal.SIGTERM, err
    # A batch scores its two groups against one 1 s deadline each: the step in flight ends
    # within about 2 s, then the checkpoint (the 120 s sleeps are abandoned).
    assert took < 30, took
    assert "SIGTERM: stopped after step" in err.strip().splitlines()[-1]
    assert list((out / "checkpoints").iterdir())
