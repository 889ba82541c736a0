"""Event-driven reservations (a publish wakes them) and checkpointable rollout state."""

import json
import random
import threading
import time

import numpy as np
import pytest

from gac_jax.rollout import (
    AsyncRollouts,
    BufferConfig,
    GroupNumbering,
    LaggedRollouts,
    ParamStore,
    PromptOrder,
    Rollout,
    RolloutBuffer,
    RolloutConfig,
    RolloutWorker,
)
from gac_jax.rollout import worker as worker_module


def tiny_rollout(version, group_id=0, prompt_id=0):
    z = np.zeros((1, 1), np.int32)
    return Rollout(
        prompt_id,
        group_id,
        z[0],
        z,
        z.astype(bool),
        z.astype(np.float32),
        np.zeros(1, np.float32),
        version,
    )


def instant_generate(delay=0.0):
    def generate(params, version, requests, key):
        assert params["version"] == version
        if delay:
            time.sleep(random.uniform(0, delay))
        return [tiny_rollout(version, r.group_id, r.prompt_id) for r in requests]

    return generate


def published(version, history=1):
    store = ParamStore(history)
    store.publish({"version": version}, version)
    return store


# ----------------------------------------------------------------------------- wake on publish


def test_a_publish_wakes_a_reservation_waiting_for_a_newer_version():
    buffer = RolloutBuffer(capacity=2, groups_per_batch=1, max_staleness=0, stale_policy="block")
    store = published(0)
    store.subscribe(lambda version: buffer.wake())
    assert buffer.reserve(0)  # Slot 0 is consumed at step 0; slot 1 needs version 1.
    granted = threading.Event()
    waiter = threading.Thread(
        target=lambda: buffer.reserve(lambda: store.latest_version) and granted.set()
    )
    waiter.start()  # No timeout: only a wake can let it through.
    assert not granted.wait(0.1)
    store.publish({"version": 1}, 1)
    assert granted.wait(5.0)
    waiter.join(5.0)
    assert buffer.stats().reserved == 2


def test_a_version_function_returning_none_waits_for_the_first_publish():
    buffer = RolloutBuffer(2, 1, max_staleness=0, stale_policy="block")
    store = ParamStore()
    unsubscribe = store.subscribe(lambda version: buffer.wake())
    assert not buffer.reserve(lambda: store.latest_version, timeout=0.02)
    unsubscribe()
    calls = []
    store.subscribe(calls.append)
    store.publish({"version": 0}, 0)
    assert calls == [0]  # The unsubscribed callback is gone, the other is called.
    assert buffer.reserve(lambda: store.latest_version, timeout=0.02)


def test_async_alpha_zero_steps_are_woken_not_polled(monkeypatch):
    # With an hour-long poll, a step finishes promptly only if the publish wakes the worker.
    monkeypatch.setattr(worker_module, "_POLL_SECONDS", 3600.0)
    store = published(0)
    source = AsyncRollouts(
        instant_generate(),
        store,
        PromptOrder(7),
        RolloutConfig("async", groups_per_batch=2),
        BufferConfig(max_staleness=0, stale_policy="block", take_timeout=20.0),
    )
    try:
        for step in range(10):
            if step:
                store.publish({"version": step}, step)
            assert [r.policy_version for r in source.next_batch(step)] == [step, step]
    finally:
        source.close()  # Closing wakes the blocked reservation too.
    assert not source.worker.alive


def test_release_gives_a_reservation_back():
    buffer = RolloutBuffer(capacity=2, groups_per_batch=1, max_staleness=0, stale_policy="block")
    assert buffer.reserve(0)
    assert not buffer.reserve(0, timeout=0.01)  # Slot 1 would be consumed too late.
    buffer.release()  # The producer of slot 0 failed before putting.
    assert buffer.reserve(0, timeout=0.01)
    with pytest.raises(ValueError, match=r"count=2 must lie in \[0, 1 reserved\]"):
        buffer.release(2)


# ----------------------------------------------------------------------------- buffer state


def test_buffer_state_survives_json_and_continues_the_reservation_order():
    buffer = RolloutBuffer(capacity=4, groups_per_batch=1, max_staleness=0, stale_policy="block")
    for gid, version in enumerate([0, 1, 0, 2]):  # Group 2 is a straggler of version 0.
        assert buffer.reserve(gid, timeout=1.0)
        buffer.put(tiny_rollout(version, gid))
    assert [r.group_id for r in buffer.take(learner_version=0)] == [0]
    assert [r.group_id for r in buffer.take(learner_version=1)] == [1]  # Group 2 dropped.
    assert buffer.stats().reserved == 3  # Groups 0, 1 and the waiting group 3.
    state = json.loads(json.dumps(buffer.state()))
    assert state == {
        "produced": 3,  # The waiting group is not carried: it is generated again.
        "consumed": 2,
        "dropped": 1,
        "filtered": 0,
        "reserved": 2,
        "staleness_histogram": {"0": 2},
    }
    resumed = RolloutBuffer(4, 1, max_staleness=0, stale_policy="block").restore(state)
    stats = resumed.stats()
    assert (stats.produced, stats.consumed, stats.dropped, stats.reserved, stats.depth) == (
        3,
        2,
        1,
        2,
        0,
    )
    assert stats.staleness_histogram == {0: 2}
    assert not resumed.reserve(1, timeout=0.01)  # The next slot is consumed at step 2.
    assert resumed.reserve(2, timeout=0.01)


def test_buffer_state_under_the_drop_policy_counts_every_reservation_made():
    buffer = RolloutBuffer(capacity=8, groups_per_batch=2, max_staleness=1, stale_policy="drop")
    for gid, version in enumerate([0, 0, 2, 3, 3]):
        assert buffer.reserve(version, timeout=1.0)
        buffer.put(tiny_rollout(version, gid))
    buffer.take(learner_version=3)  # Drops groups 0 and 1, takes 2 and 3.
    state = buffer.state()
    assert (state["produced"], state["consumed"], state["dropped"], state["reserved"]) == (
        4,
        2,
        2,
        4,
    )


def test_restore_refuses_a_used_buffer_and_a_bad_state():
    state = RolloutBuffer(2, 1).state()
    used = RolloutBuffer(2, 1)
    used.put(tiny_rollout(0))
    with pytest.raises(RuntimeError, match="fresh buffer"):
        used.restore(state)
    with pytest.raises(ValueError, match=r"lacks \['dropped'\]"):
        RolloutBuffer(2, 1).restore({k: v for k, v in state.items() if k != "dropped"})
    with pytest.raises(ValueError, match="produced = consumed"):
        RolloutBuffer(2, 1).restore({**state, "produced": 5})


# ----------------------------------------------------------------------------- numbering


def test_worker_continues_numbering_and_skips_handed_out_ids():
    store, buffer = published(0), RolloutBuffer(capacity=8, groups_per_batch=4)
    worker = RolloutWorker(
        instant_generate(),
        store,
        buffer,
        PromptOrder(5),
        groups_per_call=2,
        numbering=GroupNumbering(first_group_id=10, skip_group_ids=[9, 11, 12]),
    ).start()
    try:
        ids = sorted(r.group_id for r in buffer.take(0, num_groups=4, timeout=10.0))
    finally:
        buffer.close()
        worker.stop()
    assert ids == [10, 13, 14, 15]
    state = worker.state()
    assert state["next_group_id"] >= 16 and state["skip_group_ids"] == []


@pytest.mark.parametrize(
    "policy, max_staleness, threads, per_call",
    [("block", 1, 1, 1), ("drop", None, 3, 2)],  # Neither setting ever drops a group.
)
def test_async_resume_hands_out_every_group_exactly_once(policy, max_staleness, threads, per_call):
    store, consumed, order = published(0), [], PromptOrder(9, seed=2)
    config = RolloutConfig(
        "async", groups_per_batch=3, num_workers=threads, groups_per_call=per_call
    )

    def run(steps, first_step, resume_from):
        source = AsyncRollouts(
            instant_generate(delay=0.003),
            store,
            order,
            config,
            BufferConfig(max_staleness=max_staleness, stale_policy=policy, take_timeout=20.0),
            resume_from=resume_from,
        )
        try:
            for step in range(first_step, first_step + steps):
                if step > store.latest_version:
                    store.publish({"version": step}, step)
                batch = source.next_batch(step)
                assert all(r.prompt_id == order.prompt_id(r.group_id) for r in batch)
                consumed.extend(r.group_id for r in batch)
            return json.loads(json.dumps(source.state())), source.stats()
        finally:
            source.close()

    state, _ = run(6, 0, None)  # Taken while the workers run, as a checkpoint would.
    assert state["buffer"]["consumed"] == 18
    final, stats = run(5, 6, state)
    assert len(consumed) == len(set(consumed)) == 33  # Nothing trained on twice.
    assert (stats.consumed, stats.dropped) == (33, 0)  # The counters continued.
    assert sum(stats.staleness_histogram.values()) == 33
    # Nothing skipped: every id before the oldest pending one was handed out.
    assert set(consumed) == set(range(final["next_group_id"])) | set(final["skip_group_ids"])


def test_lagged_source_carries_its_buffer_counters():
    store = ParamStore(history=2)
    config = RolloutConfig(groups_per_batch=2, lag=1)
    source = LaggedRollouts(instant_generate(), store, PromptOrder(4), config)
    for step in range(3):
        store.publish({"version": step}, step)
        source.next_batch(step)
    resumed = LaggedRollouts(
        instant_generate(), store, PromptOrder(4), config, resume_from=source.state()
    )
    assert resumed.stats() == source.stats()
