"""A run whose every reward of the first steps is the same (a reward that never matches,
`reward=boxed init=random`) says so in one warning line (issue #63), once, and only then."""

import logging
from types import SimpleNamespace

import numpy as np
import pytest

from gac_jax.train.batch_reports import FLAT_STEPS, FlatRewards
from gac_jax.train.cli import main

LOGGER = "gac_jax.train.batch_reports"


def _batch(*rewards):
    return [SimpleNamespace(rewards=np.asarray(r, np.float32)) for r in rewards]


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def _feed(report, batches, start=0):
    for step, batch in enumerate(batches, start):
        assert report(batch, step) == {}


def test_flat_rewards_warn_once_after_the_watched_steps(caplog):
    report = FlatRewards(FLAT_STEPS, random_init=True)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _feed(report, [_batch([0, 0], [0, 0])] * (FLAT_STEPS - 1))
        assert _warnings(caplog) == []
        _feed(report, [_batch([0, 0], [0, 0])] * 10, start=FLAT_STEPS - 1)
    (message,) = _warnings(caplog)
    assert message.startswith(f"every reward of the first {FLAT_STEPS} steps was 0:")
    assert "samples.jsonl" in message and "init=random" in message and "\n" not in message


@pytest.mark.parametrize(
    ("batches", "start"),
    [
        ([_batch([0, 0])] * 2 + [_batch([0, 1])] + [_batch([0, 0])] * 3, 0),  # One matched.
        ([_batch([1, 1])] + [_batch([0, 0])] * 5, 0),  # Constant in a group, not in the run.
        ([_batch([0, 0])] * 6, 7),  # A resumed run: not its first steps.
    ],
)
def test_no_warning_when_a_reward_differs_or_the_run_resumed(caplog, batches, start):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _feed(FlatRewards(FLAT_STEPS, random_init=False), batches, start)
    assert _warnings(caplog) == []


def test_a_shorter_run_is_warned_at_its_end_without_the_init_hint(caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _feed(FlatRewards(2, random_init=False), [_batch([0.5, 0.5])] * 2)
    (message,) = _warnings(caplog)
    assert "first 2 steps was 0.5" in message and "init=random" not in message


def test_a_run_whose_reward_never_matches_warns_through_the_cli(tmp_path, caplog):
    overrides = ["task=arithmetic/add2", "init=random", "reward=boxed", f"data_dir={tmp_path}"]
    overrides += ["steps=3", "eval_every=0", "checkpoint_every=0", "rollout.mode=sync"]
    overrides += ["rollout.groups_per_batch=2", "generation.group_size=2", "mesh.data=1"]
    overrides += ["generation.prompt_length=12", "generation.max_new_tokens=4"]
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert main(["train", "--set", *overrides, "--out", str(tmp_path / "run")]) == 0
    (message,) = _warnings(caplog)
    assert message.startswith("every reward of the first 3 steps was 0:")
