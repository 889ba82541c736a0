"""Fixtures of the training-loop tests."""

import dataclasses

import pytest

from gac_jax.tasks import get_task
from gac_jax.train import build
from gac_jax.train import run as run_lib


def digit_share(completion: str, example) -> float:
    """A reward a random model earns some of: the share of digits in the completion."""
    return sum(c.isdigit() for c in completion) / max(len(completion), 1)


@pytest.fixture
def digit_task(monkeypatch):
    """arithmetic/add2 rewarded by `digit_share`, so advantages and gradients are not all
    zero and runs have something to learn (and to compare)."""
    fake = dataclasses.replace(get_task("arithmetic/add2"), reward=digit_share)
    monkeypatch.setattr(build, "get_task", lambda name: fake)
    return fake


@pytest.fixture
def consumed(monkeypatch):
    """Every batch of rollouts the runs in the test train on, in order (recorded where the
    loop collates them)."""
    batches = []
    real_collate = run_lib.collate

    def recording_collate(rollouts, prompt_length, *overlong):
        batches.append(list(rollouts))
        return real_collate(rollouts, prompt_length, *overlong)

    monkeypatch.setattr(run_lib, "collate", recording_collate)
    return batches
