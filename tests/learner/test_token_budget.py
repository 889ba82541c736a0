"""Micro-batches by token budget: the trimmed, re-split step equals the plain one, and the
budget arithmetic holds for every shape."""

import dataclasses

import jax
import numpy as np
import optax
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from gac_jax import models
from gac_jax.learner import GRPOLearner, LearnerConfig, LossConfig, TrainBatch, token_budget
from gac_jax.learner import learner as learner_module
from gac_jax.learner.token_budget import (
    MicroBatching,
    budget_micro_batches,
    trim_padding,
    used_columns,
)
from gac_jax.rollout import Rollout, collate
from tests.conftest import USERS_COMPILE_OPTIONS


@given(
    rows=st.integers(1, 64),
    width=st.integers(1, 300),
    max_tokens=st.integers(1, 5000),
    minimum=st.integers(1, 8),
    devices=st.sampled_from([1, 2, 4]),
)
def test_the_fewest_micro_batches_that_fit(rows, width, max_tokens, minimum, devices):
    def splits(k):
        return rows % k == 0 and (rows // k) % devices == 0

    if rows % devices or not any(splits(k) for k in range(minimum, rows + 1)):
        why = "cannot be split evenly" if rows % devices else f"micro_batches={minimum} leaves"
        with pytest.raises(ValueError, match=why):
            budget_micro_batches(rows, width, max_tokens, minimum=minimum, devices=devices)
        return
    m = budget_micro_batches(rows, width, max_tokens, minimum=minimum, devices=devices)
    assert rows % m == 0 and (rows // m) % devices == 0  # Whole rows on every device.

    def fits(k):
        return rows // (k * devices) * width <= max_tokens

    # At least the minimum, within the budget (or, when nothing fits, one row a device)...
    assert m >= minimum and (fits(m) or m == rows // devices)
    # ...and no valid count from the minimum up to it would have fitted.
    assert not any(splits(k) and fits(k) for k in range(minimum, m))


@given(
    micro_batches=st.one_of(st.none(), st.integers(1, 4)),
    max_tokens=st.one_of(st.none(), st.integers(1, 3000)),
    mini_batches=st.sampled_from([1, 2]),
    rows=st.sampled_from([8, 16, 32]),
    width=st.integers(1, 200),
)
@example(micro_batches=3, max_tokens=1, mini_batches=2, rows=8, width=1)  # Found in CI.
def test_one_rule_decides_the_count(micro_batches, max_tokens, mini_batches, rows, width):
    """`MicroBatching.of` reads the three settings once: the configured count (1 unset)
    without a budget; within the configured budget, else within the CPU model's where
    both are unset; each count at least the configured one, and a configured count above
    one row a device refused under a budget (`budget_micro_batches`)."""
    settings = dict(micro_batches=micro_batches, max_tokens_per_micro_batch=max_tokens)
    config = LearnerConfig(**settings, mini_batches=mini_batches)
    cpu = models.get_config("tiny")
    rule = MicroBatching.of(config, cpu_model=cpu, devices=2)
    least = 1 if micro_batches is None else micro_batches
    if max_tokens is not None:
        budget, why = max_tokens, f"max_tokens_per_micro_batch={max_tokens}"
    elif micro_batches is None:
        budget, why = token_budget.cpu_tokens_per_micro_batch(cpu, width), "XLA:CPU"
    else:
        budget, why = None, f"micro_batches={micro_batches}"
    assert why in str(rule)
    most = rows // mini_batches // 2  # One row on each of the 2 devices.
    if budget is not None and least > most:
        with pytest.raises(ValueError, match=f"micro_batches={least} leaves less than one row"):
            rule.count(rows, width)
        return
    want = least if budget is None else budget_micro_batches(
        rows // mini_batches, width, budget, minimum=least, devices=2
    )  # fmt: skip
    assert rule.count(rows, width) == want >= least
    assert MicroBatching.of(config, devices=2).count(rows, width) == (
        want if max_tokens is not None else least
    )


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


def _full_batch(rows, width, vocab=128):
    rng = np.random.default_rng(3)
    mask = np.ones((rows, width), bool)
    return TrainBatch(
        rng.integers(3, vocab, (rows, width)).astype(np.int32),
        mask,
        mask.copy(),
        (-3.0 - rng.random((rows, width))).astype(np.float32),
        rng.random(rows).astype(np.float32),
        np.repeat(np.arange(rows // 4, dtype=np.int32), 4),
        np.zeros(rows, np.int32),
    )


@pytest.mark.parametrize(
    "overrides", [{}, dict(num_layers=3, mlp_dim=512), dict(embed_dim=128, num_heads=8)]
)
def test_the_cpu_estimate_is_within_a_quarter_of_xla_s_arena(overrides, monkeypatch):
    # XLA:CPU's temporaries for one step, compiled as users compile it.
    options = {**USERS_COMPILE_OPTIONS, **learner_module.CPU_STEP_COMPILER_OPTIONS}
    monkeypatch.setattr(learner_module, "CPU_STEP_COMPILER_OPTIONS", options)
    cfg = models.get_config("tiny", **overrides)
    model = models.create_model(cfg, seed=0)
    learner = GRPOLearner(
        model, optax.adam(1e-3), models.make_mesh(1, 1, 1), config=LearnerConfig(micro_batches=1)
    )
    batch = learner.place_batch(_full_batch(64, 48))
    compiled = learner.lower(batch, np.int32(0), None).compile()
    per_token = compiled.memory_analysis().temp_size_in_bytes / batch.tokens.size
    monkeypatch.setattr(token_budget, "CPU_MIN_TOKENS", 1)
    estimate = token_budget.CPU_ACTIVATION_BYTES / token_budget.cpu_tokens_per_micro_batch(cfg, 48)
    assert 0.8 <= estimate / per_token <= 1.25, (estimate, per_token)


def test_on_cpu_the_default_splits_a_step_to_keep_its_activations_small(monkeypatch):
    monkeypatch.setattr(token_budget, "CPU_ACTIVATION_BYTES", 1 << 20)
    monkeypatch.setattr(token_budget, "CPU_MIN_TOKENS", 64)
    mesh, batch = models.make_mesh(1, 2, 1), _full_batch(32, 16)
    cfg = models.get_config("tiny", num_layers=1)
    fits = token_budget.cpu_tokens_per_micro_batch(cfg, 16)
    expected = budget_micro_batches(32, 16, fits, devices=2)
    assert expected > 1 and 32 // (expected * 2) * 16 <= fits
    default = _learner(LearnerConfig(), mesh)
    whole = _learner(LearnerConfig(micro_batches=1), mesh)
    a, b = default.step(batch, 0), whole.step(batch, 0)
    assert a["micro_batches"] == expected and b["micro_batches"] == 1
    for key in a.keys() - {"micro_batches"}:
        np.testing.assert_allclose(a[key], b[key], rtol=2e-5, atol=1e-6, err_msg=key)
    for x, y in zip(jax.tree.leaves(default.params), jax.tree.leaves(whole.params), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)
    # A loss whose split needs a whole-batch pass keeps the batch whole.
    model = models.create_model(cfg, seed=1)
    m2po = GRPOLearner(model, optax.sgd(0.5), mesh, loss=LossConfig(policy_loss="m2po"))
    assert m2po.micro_batching.count(32, 16) == 1
