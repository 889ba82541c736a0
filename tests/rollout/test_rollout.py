"""The rollout system: records, versioned params, the buffer, workers and the three modes.

The model is replaced by a seeded fake `generate_group` (its tokens come from the group's
key), so these tests exercise the concurrency and the bookkeeping, fast.
"""

import random
import threading
import time

import jax
import numpy as np
import pytest

from gac_jax.rollout import (
    AsyncRollouts,
    BufferConfig,
    LaggedRollouts,
    ParamStore,
    PromptOrder,
    Rollout,
    RolloutBuffer,
    RolloutBufferClosed,
    RolloutConfig,
    RolloutWorkerError,
    SyncRollouts,
)

G, L = 4, 6


def make_rollout(version, group_id=0, prompt_id=0, key=None):
    rng = np.random.default_rng(group_id if key is None else np.asarray(jax.random.key_data(key)))
    return Rollout(
        prompt_id=prompt_id,
        group_id=group_id,
        prompt_tokens=np.arange(3, dtype=np.int32),
        completion_tokens=rng.integers(0, 50, (G, L)).astype(np.int32),
        completion_mask=np.ones((G, L), bool),
        behaviour_logp=-rng.random((G, L)).astype(np.float32),
        rewards=rng.random(G).astype(np.float32),
        policy_version=version,
    )


def fake_generate(delay=0.0):
    def generate(params, version, requests, key):
        assert params["version"] == version  # The worker samples with the version it reports.
        if delay:
            time.sleep(random.uniform(0, delay))
        keys = jax.random.split(key, len(requests))
        return [
            make_rollout(version, r.group_id, r.prompt_id, k)
            for r, k in zip(requests, keys, strict=True)
        ]

    return generate


# ----------------------------------------------------------------------------- records


def test_rollout_validates_shapes_and_versions():
    good = make_rollout(3)
    assert good.group_size == G and good.staleness(5) == 2
    with pytest.raises(ValueError, match=r"rewards has shape \(3,\)"):
        Rollout(
            0,
            0,
            good.prompt_tokens,
            good.completion_tokens,
            good.completion_mask,
            good.behaviour_logp,
            np.zeros(3, np.float32),
            0,
        )
    with pytest.raises(ValueError, match="policy_version=-1"):
        Rollout(
            0,
            0,
            good.prompt_tokens,
            good.completion_tokens,
            good.completion_mask,
            good.behaviour_logp,
            good.rewards,
            -1,
        )
    versions = np.full((G, L), 4, np.int32)
    versions[1, 3:] = 5  # A weight update landed mid-completion.
    Rollout(
        0,
        0,
        good.prompt_tokens,
        good.completion_tokens,
        good.completion_mask,
        good.behaviour_logp,
        good.rewards,
        4,
        token_versions=versions,
    )
    with pytest.raises(ValueError, match="oldest token version, 4"):
        Rollout(
            0,
            0,
            good.prompt_tokens,
            good.completion_tokens,
            good.completion_mask,
            good.behaviour_logp,
            good.rewards,
            5,
            token_versions=versions,
        )


# ----------------------------------------------------------------------------- ParamStore


def test_param_store_history_and_errors():
    store = ParamStore(history=2)
    with pytest.raises(LookupError, match="nothing has been published"):
        store.latest()
    for v in range(4):
        store.publish({"w": np.full(10, v, np.float32)}, v)
    params, version = store.latest()
    assert version == 3 and params["w"][0] == 3
    assert store.versions() == [2, 3]
    assert store.get(2)["w"][0] == 2
    with pytest.raises(LookupError, match=r"version 1 is not in the ParamStore; it holds \[2, 3\]"):
        store.get(1)
    with pytest.raises(ValueError, match="version=3 must exceed"):
        store.publish({"w": np.zeros(10, np.float32)}, 3)
    assert store.memory_bytes() == 2 * 10 * 4
    with pytest.raises(ValueError, match="history=0"):
        ParamStore(0)


def test_param_store_wait_for_version():
    store = ParamStore()
    assert not store.wait_for_version(0, timeout=0.01)
    threading.Timer(0.05, store.publish, args=({"w": 1}, 0)).start()
    assert store.wait_for_version(0, timeout=5.0)


# ----------------------------------------------------------------------------- buffer


def test_buffer_drops_stale_groups_and_counts():
    buffer = RolloutBuffer(capacity=8, groups_per_batch=2, max_staleness=1)
    for gid, version in enumerate([0, 1, 2, 2, 3]):
        buffer.put(make_rollout(version, gid))
    batch = buffer.take(learner_version=3)  # Versions 0 and 1 are too old for step 3.
    assert [r.policy_version for r in batch] == [2, 2]
    stats = buffer.stats()
    assert (stats.produced, stats.consumed, stats.dropped, stats.depth) == (5, 2, 2, 1)
    assert stats.staleness_histogram == {1: 2}


def test_buffer_validates_arguments():
    with pytest.raises(ValueError, match="capacity=1 must be >= groups_per_batch=2"):
        RolloutBuffer(1, 2)
    with pytest.raises(ValueError, match="stale_policy='wait'"):
        RolloutBuffer(4, 2, 1, "wait")
    with pytest.raises(ValueError, match="needs a max_staleness"):
        RolloutBuffer(4, 2, None, "block")
    with pytest.raises(ValueError, match="max_staleness=-1"):
        RolloutBuffer(4, 2, -1)


def test_put_blocks_when_full_and_take_times_out():
    buffer = RolloutBuffer(capacity=2, groups_per_batch=2)
    assert buffer.put(make_rollout(0)) and buffer.put(make_rollout(0))
    assert not buffer.put(make_rollout(0), timeout=0.05)
    buffer.take(learner_version=0)
    with pytest.raises(TimeoutError, match="0 of 2 groups"):
        buffer.take(learner_version=0, timeout=0.05)


def test_close_releases_every_waiter_quickly():
    buffer = RolloutBuffer(capacity=1, groups_per_batch=1, max_staleness=0, stale_policy="block")
    assert buffer.reserve(0)  # Slot 0: consumed at step 0, fresh enough for version 0.
    buffer.put(make_rollout(0))
    outcomes = []

    def blocked(call):
        try:
            call()
            outcomes.append("returned")
        except RolloutBufferClosed:
            outcomes.append("closed")

    calls = [
        lambda: buffer.put(make_rollout(0)),  # Full.
        lambda: buffer.reserve(0),  # Slot 1 would be consumed at step 1 > 0 + 0.
    ]
    threads = [threading.Thread(target=blocked, args=(c,)) for c in calls]
    for t in threads:
        t.start()
    time.sleep(0.1)
    assert outcomes == []  # Really blocked.
    start = time.monotonic()
    buffer.close()
    for t in threads:
        t.join(2.0)
    assert time.monotonic() - start < 1.0
    assert sorted(outcomes) == ["closed", "closed"]
    # What was already there can still be drained; then the consumer is told it is over.
    assert len(buffer.take(learner_version=0)) == 1
    with pytest.raises(RolloutBufferClosed):
        buffer.take(learner_version=0)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("max_staleness", [0, 2])
def test_threaded_stress_exactly_once_and_never_too_stale(seed, max_staleness):
    """Producers with random delays and random versions; a consumer advancing its version."""
    rng = random.Random(seed)
    buffer = RolloutBuffer(capacity=6, groups_per_batch=3, max_staleness=max_staleness)
    learner_version = [0]
    produced_ids, produced_lock = [], threading.Lock()
    next_id = iter(range(10**6))

    def producer():
        local = random.Random(rng.random())
        while True:  # Until the buffer is closed.
            time.sleep(local.uniform(0, 0.002))
            with produced_lock:
                gid = next(next_id)
                version = max(0, learner_version[0] - local.randint(0, max_staleness + 2))
                produced_ids.append(gid)
            try:
                buffer.put(make_rollout(version, gid))
            except RolloutBufferClosed:
                with produced_lock:
                    produced_ids.remove(gid)  # Never entered the buffer.
                return

    threads = [threading.Thread(target=producer) for _ in range(4)]
    for t in threads:
        t.start()
    consumed = []
    for step in range(25):
        batch = buffer.take(learner_version=step, timeout=5.0)
        assert all(r.staleness(step) <= max_staleness for r in batch)
        assert len(batch) == 3
        consumed.extend(r.group_id for r in batch)
        learner_version[0] = step + 1
    buffer.close()  # Producers blocked on a full buffer must wake and leave.
    for t in threads:
        t.join(2.0)
        assert not t.is_alive()
    stats = buffer.stats()
    assert len(consumed) == len(set(consumed))  # Never duplicated.
    assert stats.produced == len(produced_ids)
    assert stats.consumed == len(consumed)
    assert stats.produced == stats.consumed + stats.dropped + stats.depth
    assert max(stats.staleness_histogram, default=0) <= max_staleness


# ----------------------------------------------------------------------------- modes


def _store_with(versions, history):
    store = ParamStore(history=history)
    for v in versions:
        store.publish({"version": v}, v)
    return store


def test_lagged_mode_uses_old_versions_and_is_reproducible():
    def run():
        store = ParamStore(history=3)
        config = RolloutConfig(groups_per_batch=2, lag=2)
        source = LaggedRollouts(fake_generate(), store, PromptOrder(10, seed=1), config, seed=7)
        batches = []
        for step in range(6):
            store.publish({"version": step}, step)
            batches.append(source.next_batch(step))
        return batches

    first, second = run(), run()
    for step, (a, b) in enumerate(zip(first, second, strict=True)):
        assert [r.policy_version for r in a] == [max(0, step - 2)] * 2
        for ra, rb in zip(a, b, strict=True):
            np.testing.assert_array_equal(ra.completion_tokens, rb.completion_tokens)
            assert (ra.prompt_id, ra.group_id) == (rb.prompt_id, rb.group_id)
    with pytest.raises(ValueError, match="ParamStore history of at least 3"):
        LaggedRollouts(fake_generate(), ParamStore(2), PromptOrder(10), RolloutConfig(lag=2))


def test_sync_mode_is_on_policy():
    store = ParamStore()
    config = RolloutConfig("sync", groups_per_batch=3)
    source = SyncRollouts(fake_generate(), store, PromptOrder(5), config)
    for step in range(3):
        store.publish({"version": step}, step)
        assert [r.policy_version for r in source.next_batch(step)] == [step] * 3
    assert source.stats().staleness_histogram == {0: 9}


def test_prompt_order_is_a_permutation_per_epoch():
    order = PromptOrder(7, seed=3)
    for epoch in range(3):
        ids = [order.prompt_id(epoch * 7 + i) for i in range(7)]
        assert sorted(ids) == list(range(7))
    assert [order.prompt_id(i) for i in range(7)] != [order.prompt_id(7 + i) for i in range(7)]


@pytest.mark.parametrize("policy, groups_per_call", [("block", 1), ("drop", 1), ("block", 2)])
def test_async_mode_respects_the_bound(policy, groups_per_call):
    store = _store_with([0], history=1)
    source = AsyncRollouts(
        fake_generate(delay=0.004),
        store,
        PromptOrder(20),
        RolloutConfig("async", groups_per_batch=2, num_workers=3, groups_per_call=groups_per_call),
        BufferConfig(max_staleness=1, stale_policy=policy, take_timeout=10.0),
    )
    try:
        for step in range(12):
            batch = source.next_batch(step)
            assert all(0 <= r.staleness(step) <= 1 for r in batch)
            time.sleep(0.005)  # "Training".
            store.publish({"version": step + 1}, step + 1)
    finally:
        source.close()
    assert not source.worker.alive
    stats = source.stats()
    assert stats.consumed == 24
    assert set(stats.staleness_histogram) <= {0, 1}


def test_async_block_policy_with_one_worker_never_drops():
    store = _store_with([0], history=1)
    source = AsyncRollouts(
        fake_generate(delay=0.002),
        store,
        PromptOrder(20),
        RolloutConfig("async", groups_per_batch=2),
        BufferConfig(max_staleness=1, stale_policy="block", take_timeout=10.0),
    )
    try:
        for step in range(10):
            source.next_batch(step)
            store.publish({"version": step + 1}, step + 1)
    finally:
        source.close()
    assert source.stats().dropped == 0


def test_worker_exception_reaches_the_learner_within_seconds():
    calls = [0]

    def flaky(params, version, requests, key):
        calls[0] += 1
        if calls[0] == 3:
            raise ZeroDivisionError("model exploded")
        return [make_rollout(version, r.group_id) for r in requests]

    store = _store_with([0], history=1)
    source = AsyncRollouts(
        flaky,
        store,
        PromptOrder(5),
        RolloutConfig("async", groups_per_batch=2),
        BufferConfig(max_staleness=None, stale_policy="drop", take_timeout=30.0),
    )
    start = time.monotonic()
    with pytest.raises(RolloutWorkerError, match="model exploded") as info:
        for step in range(5):
            source.next_batch(step)
            store.publish({"version": step + 1}, step + 1)
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    assert time.monotonic() - start < 5.0
    source.close()
    assert not source.worker.alive


def test_block_policy_gives_a_dropped_groups_slot_back():
    buffer = RolloutBuffer(capacity=2, groups_per_batch=1, max_staleness=0, stale_policy="block")
    assert buffer.reserve(0)
    buffer.put(make_rollout(0, 0))
    buffer.take(learner_version=0)
    assert not buffer.reserve(0, timeout=0.01)  # It would be consumed at step 1: too late.
    assert buffer.reserve(1)  # Slot 1, for step 1 ...
    buffer.put(make_rollout(0, 1))  # ... but a straggler of version 0 lands in it.
    with pytest.raises(TimeoutError):
        buffer.take(learner_version=1, timeout=0.01)  # Dropped as too stale.
    assert buffer.stats().dropped == 1
    assert buffer.reserve(1, timeout=0.01)  # Its slot came back.
