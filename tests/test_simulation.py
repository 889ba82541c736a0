"""The discrete-event simulation of the rollout pipeline (`benchmarks/simulation.py`).

Exact cases are computed by hand; the async engine is replayed call by call against the
real `RolloutBuffer`, so the simulation cannot drift from the buffer's semantics unnoticed.
"""

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gac_jax.rollout import Rollout, RolloutBuffer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from simulation import (  # noqa: E402
    LengthDistribution,
    SimulationConfig,
    compare_async_to_sync,
    format_comparison,
    simulate,
)

sys.path.pop(0)  # The benchmarks' other names (learner, sampler) stay off the path.

HEAVY = LengthDistribution("lognormal", scale=32.0, shape=1.0, max_tokens=256)
BASE = SimulationConfig(
    groups_per_batch=8,
    token_seconds=1e-3,
    group_overhead_seconds=2e-3,
    train_seconds=0.15,
    lengths=HEAVY,
    num_steps=200,
)


def constant(tokens, max_tokens=256):
    return LengthDistribution("constant", scale=tokens, max_tokens=max_tokens)


# ----------------------------------------------------------------------------- lengths


def test_length_distributions_are_clipped_and_heavy_tailed():
    rng = np.random.default_rng(0)
    for dist in (HEAVY, LengthDistribution("pareto", scale=4.0, shape=1.2, max_tokens=512)):
        x = dist.sample(rng, 200_000)
        assert x.dtype == np.int64 and x.min() >= 1 and x.max() == dist.max_tokens
        # Heavy tail: the 99th percentile is far above the median.
        assert np.quantile(x, 0.99) > 6 * np.median(x)
    x = HEAVY.sample(rng, 200_000)
    assert np.median(x) == pytest.approx(32, abs=1)  # ceil of a median-32 log-normal.
    assert np.all(constant(7).sample(rng, 5) == 7)
    with pytest.raises(ValueError, match="kind"):
        LengthDistribution("weibull")
    with pytest.raises(ValueError, match="min_tokens"):
        LengthDistribution(max_tokens=0)


# ----------------------------------------------------------------------------- exact cases


def test_hand_computed_single_worker():
    # Constant 10-token groups at 0.1 s/token + 0.5 s overhead: every group takes 1.5 s.
    g, b, train = 1.5, 2, 4.0
    base = SimulationConfig(
        num_workers=1,
        groups_per_batch=b,
        token_seconds=0.1,
        group_overhead_seconds=0.5,
        train_seconds=train,
        lengths=constant(10),
        num_steps=6,
        max_staleness=1,
    )
    sync = simulate(dataclasses.replace(base, mode="sync"))
    np.testing.assert_allclose(sync.step_end_times, [(t + 1) * (b * g + train) for t in range(6)])
    assert sync.steps_per_second == pytest.approx(1 / (b * g + train))
    # Async, training-bound (train > b * g): the worker fills step 0's batch in b * g, then
    # each step ends `train` after the previous one, always on groups one version old.
    fast = simulate(base)
    np.testing.assert_allclose(fast.step_end_times, [b * g + (t + 1) * train for t in range(6)])
    assert fast.staleness_histogram == {0: b, 1: 5 * b}
    assert fast.dropped == 0 and not fast.deadlocked
    assert fast.learner_idle_fraction == pytest.approx(b * g / fast.seconds)
    # Async, generation-bound (train < b * g): the learner trains while the worker goes on.
    slow = simulate(dataclasses.replace(base, train_seconds=1.0))
    np.testing.assert_allclose(slow.step_end_times, [(t + 1) * b * g + 1.0 for t in range(6)])
    assert slow.worker_utilisation == pytest.approx(1.0)


def test_sync_has_staleness_zero_and_list_schedules_groups():
    result = simulate(dataclasses.replace(BASE, mode="sync", num_workers=3))
    assert result.staleness_histogram == {0: BASE.num_steps * BASE.groups_per_batch}
    assert result.dropped == 0 and result.max_staleness == 0
    # Four 1 s groups on three workers take 2 s (the fourth waits), then 0.5 s of training.
    tiny = SimulationConfig(
        mode="sync",
        num_workers=3,
        groups_per_batch=4,
        token_seconds=1.0,
        lengths=constant(1),
        train_seconds=0.5,
        num_steps=2,
    )
    result = simulate(tiny)
    assert result.step_end_times == (2.5, 5.0)
    assert result.worker_utilisation == pytest.approx(8 / (3 * 5.0))


@pytest.mark.parametrize("workers", [1, 2, 4, 8])
def test_async_with_staleness_zero_is_sync(workers):
    # alpha = 0 under the block policy admits only the current step's B groups: exactly
    # sync, group for group, whatever the lengths.
    config = dataclasses.replace(BASE, num_workers=workers)
    sync = simulate(dataclasses.replace(config, mode="sync"))
    async_ = simulate(dataclasses.replace(config, max_staleness=0))
    np.testing.assert_allclose(async_.step_end_times, sync.step_end_times, rtol=1e-12)
    assert async_.staleness_histogram == sync.staleness_histogram
    assert async_.dropped == 0


def test_free_training_makes_async_as_fast_as_sync():
    free = dataclasses.replace(BASE, train_seconds=0.0)
    for alpha in (1, 2, 4, 8):
        # One worker never waits in either mode: both run the same groups back to back.
        one = compare_async_to_sync(free, [alpha], [1])[(1, alpha)]
        assert one.speedup == pytest.approx(1.0, rel=1e-9)
        # Equal groups divide evenly among workers, so sync leaves nobody idle either.
        for workers in (2, 4, 8):
            even = dataclasses.replace(free, lengths=constant(32))
            cell = compare_async_to_sync(even, [alpha], [workers])[(workers, alpha)]
            assert cell.speedup == pytest.approx(1.0, rel=1e-9)


# ----------------------------------------------------------------------------- properties


def test_deterministic_for_a_seed():
    config = dataclasses.replace(BASE, num_workers=4, max_staleness=2, stale_policy="drop")
    a, b = simulate(config), simulate(config)
    assert a == b
    c = simulate(dataclasses.replace(config, seed=1))
    assert c.step_end_times != a.step_end_times


@given(
    workers=st.integers(1, 8),
    batch=st.integers(1, 6),
    alpha=st.integers(0, 4),
    policy=st.sampled_from(["block", "drop"]),
    extra_capacity=st.integers(0, 8),
    train=st.sampled_from([0.0, 0.01, 0.05, 0.3]),
    seed=st.integers(0, 2**16),
)
def test_async_invariants(workers, batch, alpha, policy, extra_capacity, train, seed):
    config = SimulationConfig(
        num_workers=workers,
        groups_per_batch=batch,
        group_size=4,
        max_staleness=alpha,
        stale_policy=policy,
        capacity=batch + extra_capacity,
        token_seconds=1e-3,
        train_seconds=train,
        lengths=LengthDistribution("pareto", scale=4.0, shape=1.1, max_tokens=128),
        num_steps=40,
        seed=seed,
    )
    result = simulate(config)
    assert not result.deadlocked and result.steps == 40
    assert result.max_staleness <= alpha
    assert result.consumed == 40 * batch == sum(result.staleness_histogram.values())
    assert result.produced == result.consumed + result.dropped + result.depth
    assert result.depth <= config.buffer_capacity
    assert 0.0 < result.worker_utilisation <= 1.0 + 1e-12
    assert -1e-12 <= result.learner_idle_fraction <= 1.0
    assert result.dropped_busy_seconds <= result.worker_busy_seconds
    if alpha == 0 and policy == "block":
        assert result.dropped == 0


@pytest.mark.parametrize(
    "overrides",
    [
        dict(mode="sync"),
        dict(stale_policy="block", max_staleness=2),
        dict(stale_policy="block", max_staleness=4),
        dict(stale_policy="drop", max_staleness=4),
    ],
)
def test_more_workers_never_slow_the_pipeline(overrides):
    config = dataclasses.replace(BASE, num_steps=300, **overrides)
    rates = [
        simulate(dataclasses.replace(config, num_workers=w)).steps_per_second for w in (1, 2, 4, 8)
    ]
    assert all(b >= a * (1 - 1e-9) for a, b in zip(rates, rates[1:], strict=False)), rates


def test_block_mode_keeps_its_speed_up_over_long_runs():
    # Two groups per step, four workers, alpha = 1: stragglers get dropped. Each drop gives
    # its slot back, so late in the run async is as far ahead of sync as early on.
    config = dataclasses.replace(
        BASE, groups_per_batch=2, num_workers=4, max_staleness=1, train_seconds=0.03
    )
    config = dataclasses.replace(config, num_steps=3000)
    result = simulate(config)
    sync = simulate(dataclasses.replace(config, mode="sync"))
    assert result.dropped > 100
    ends, sync_ends = np.asarray(result.step_end_times), np.asarray(sync.step_end_times)
    late_rate = 1000 / (ends[-1] - ends[-1001])
    assert late_rate > 1.5 * 1000 / (sync_ends[-1] - sync_ends[-1001])


# ----------------------------------------------------------------------------- fidelity


def _group(group_id, version):
    return Rollout(
        prompt_id=0,
        group_id=group_id,
        prompt_tokens=np.zeros(1, np.int32),
        completion_tokens=np.zeros((1, 1), np.int32),
        completion_mask=np.ones((1, 1), bool),
        behaviour_logp=np.zeros((1, 1), np.float32),
        rewards=np.zeros(1, np.float32),
        policy_version=version,
    )


@pytest.mark.parametrize(
    "policy, alpha, capacity, train", [("block", 2, 3, 0.1), ("drop", 1, 5, 0.05)]
)
def test_trace_replays_on_the_real_buffer(policy, alpha, capacity, train):
    """Every reserve, put and take the simulation made has the same outcome on the real
    `RolloutBuffer` (timeout 0 stands for "would wait"), and the counters agree."""
    config = dataclasses.replace(
        BASE,
        groups_per_batch=3,
        num_workers=5,
        max_staleness=alpha,
        stale_policy=policy,
        capacity=capacity,
        train_seconds=train,
        lengths=LengthDistribution("pareto", scale=4.0, shape=1.1, max_tokens=256),
        num_steps=150,
    )
    result = simulate(config, record_trace=True)
    assert result.dropped > 0  # The replay covers drops.
    assert any(e[0] == "put" and not e[3] for e in result.trace)  # ... and a full buffer.
    if policy == "block":
        assert any(e[0] == "reserve" and not e[2] for e in result.trace)  # ... and blocking.
    buffer = RolloutBuffer(capacity, 3, max_staleness=alpha, stale_policy=policy)
    for event in result.trace:
        if event[0] == "reserve":
            assert buffer.reserve(event[1], timeout=0) == event[2], event
        elif event[0] == "put":
            assert buffer.put(_group(event[1], event[2]), timeout=0) == event[3], event
        elif event[2] is None:
            with pytest.raises(TimeoutError):
                buffer.take(event[1], timeout=0)
        else:
            assert tuple(r.group_id for r in buffer.take(event[1], timeout=0)) == event[2]
    stats = buffer.stats()
    assert (stats.produced, stats.consumed, stats.dropped, stats.depth) == (
        result.produced,
        result.consumed,
        result.dropped,
        result.depth,
    )
    assert stats.staleness_histogram == result.staleness_histogram


# ----------------------------------------------------------------------------- interface


def test_table_and_validation():
    table = format_comparison(compare_async_to_sync(BASE, [1, 2], [1, 2]), "title")
    lines = table.splitlines()
    assert lines[0] == "title" and "alpha=2" in lines[1] and len(lines) == 4
    with pytest.raises(ValueError, match="needs a max_staleness"):
        SimulationConfig(max_staleness=None)
    with pytest.raises(ValueError, match="capacity"):
        SimulationConfig(groups_per_batch=4, capacity=3)
    with pytest.raises(ValueError, match="some time"):
        SimulationConfig(token_seconds=0.0)
    with pytest.raises(ValueError, match="mode"):
        SimulationConfig(mode="lagged")


def test_tool_latency_adds_to_each_row_and_the_group_waits_for_its_slowest_row():
    # Constant lengths and latencies: a group takes 0.25 s of overhead + 1 s of decoding + 2
    # calls of 0.25 s = 1.75 s; sync then trains 0.5 s, so a step is 2.25 s.
    tools = SimulationConfig(
        mode="sync",
        groups_per_batch=1,
        token_seconds=0.1,
        group_overhead_seconds=0.25,
        lengths=constant(10),
        train_seconds=0.5,
        num_steps=2,
        tool_calls=2,
        tool_latency_seconds=0.25,
        tool_latency_sigma=0.0,
    )
    assert simulate(tools).step_end_times == pytest.approx((2.25, 4.5))
    # Heavy-tailed latencies slow every step; asynchrony never makes it worse.
    heavy = dataclasses.replace(BASE, tool_calls=2, tool_latency_seconds=0.05, num_steps=300)
    plain = dataclasses.replace(BASE, num_steps=300)
    slower = simulate(dataclasses.replace(heavy, mode="sync"))
    assert (
        slower.steps_per_second < simulate(dataclasses.replace(plain, mode="sync")).steps_per_second
    )
    assert compare_async_to_sync(heavy, (2,), (1,))[(1, 2)].speedup >= 1.0
