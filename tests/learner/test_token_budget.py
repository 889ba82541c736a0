"""Micro-batches by token budget: the trimmed, re-split step equals the plain one, and the
budget arithmetic holds for every shape."""

import dataclasses

import jax
import numpy as np
import optax
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gac_jax import models
from gac_jax.learner import GRPOLearner, LearnerConfig, TrainBatch
from gac_jax.learner.token_budget import budget_micro_batches, trim_padding, used_columns
from gac_jax.rollout import Rollout, collate


@given(
    rows=st.integers(1, 64),
    width=st.integers(1, 300),
    max_tokens=st.integers(1, 5000),
    minimum=st.integers(1, 8),
    devices=st.sampled_from([1, 2, 4]),
)
def test_the_fewest_micro_batches_that_fit(rows, width, max_tokens, minimum, devices):
    if rows % devices:
        with pytest.raises(ValueError, match="cannot be split evenly"):
            budget_micro_batches(rows, width, max_tokens, minimum=minimum, devices=devices)
        return
    m = budget_micro_batches(rows, width, max_tokens, minimum=minimum, devices=devices)
    assert rows % m == 0 and (rows // m) % devices == 0  # Whole rows on every device.

    def splits(k):
        return rows % k == 0 and (rows // k) % devices == 0

    def fits(k):
        return rows // (k * devices) * width <= max_tokens

    # Within the budget (or, when nothing fits, one row a device: the most there are)...
    assert fits(m) and m >= minimum or m == rows // devices
    # ...and no valid count from the minimum up to it would have fitted.
    assert not any(splits(k) and fits(k) for k in range(minimum, m))


@given(
    first=st.integers(0, 30),
    used=st.integers(1, 40),
    tail=st.integers(0, 40),
    multiple=st.sampled_from([1, 8, 64]),
)
def test_trimming_keeps_every_used_column(first, used, tail, multiple):
    width = first + used + tail
    rng = np.random.default_rng(first * 1000 + used)
    attention = np.zeros((3, width), bool)
    attention[0, first : first + used] = True
    attention[1, first + used // 2 : first + used] = rng.random(used - used // 2) < 0.7
    tokens = np.where(attention, rng.integers(1, 50, attention.shape), 0).astype(np.int32)
    batch = TrainBatch(
        tokens, attention, attention.copy(), np.where(attention, -1.0, 0.0), *([None] * 3)
    )
    trimmed = trim_padding(batch, multiple)
    w = trimmed.tokens.shape[1]
    assert w == width or w % multiple == 0
    assert w >= used and w <= max(width, 0)
    assert trimmed.attention_mask.sum() == attention.sum()
    start, end = used_columns(trimmed.attention_mask)
    np.testing.assert_array_equal(
        trimmed.tokens[:, start:end], tokens[:, first : first + end - start]
    )


def _padded_batch(rows_groups=4, group=2, width=100):
    # Short completions in wide rows: most columns are padding, as with heavy tails.
    rng = np.random.default_rng(0)
    rollouts = []
    for i in range(rows_groups):
        mask = np.zeros((group, width), bool)
        mask[:, : rng.integers(3, 9)] = True
        rollouts.append(
            Rollout(
                prompt_id=i,
                group_id=i,
                prompt_tokens=rng.integers(3, 60, rng.integers(2, 6)).astype(np.int32),
                completion_tokens=rng.integers(3, 60, (group, width)).astype(np.int32),
                completion_mask=mask,
                behaviour_logp=(-3.0 - rng.random((group, width))).astype(np.float32),
                rewards=rng.random(group).astype(np.float32),
                policy_version=0,
            )
        )
    return TrainBatch(**collate(rollouts, 8))


def _learner(config, mesh):
    model = models.create_model(models.get_config("tiny", num_layers=1), seed=1)
    return GRPOLearner(model, optax.sgd(0.5), mesh, config=config)


@pytest.mark.parametrize(("budget", "expected"), [(1000, 1), (128, 2), (1, 4)])
def test_a_budgeted_step_equals_the_plain_one(budget, expected):
    mesh = models.make_mesh(1, 2, 1)
    batch = _padded_batch()
    plain = _learner(LearnerConfig(), mesh)
    budgeted = _learner(LearnerConfig(max_tokens_per_micro_batch=budget), mesh)
    a = plain.step(batch, 0)
    b = budgeted.step(dataclasses.replace(batch), 0)
    # 8 rows over 2 devices, trimmed from 108 to 64 columns: 4 x 64 tokens a device.
    assert b["micro_batches"] == expected and a["micro_batches"] == 1
    for key in a.keys() - {"micro_batches"}:
        np.testing.assert_allclose(b[key], a[key], rtol=2e-5, atol=1e-6, err_msg=key)
    for x, y in zip(jax.tree.leaves(plain.params), jax.tree.leaves(budgeted.params), strict=True):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-5, atol=1e-6)
