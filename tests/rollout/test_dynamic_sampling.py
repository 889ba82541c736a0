"""Dynamic sampling (DAPO): groups whose completions all scored alike are discarded before a
batch forms, at most a bounded number per batch, counted, with the staleness bound kept."""

import time

import numpy as np
import pytest

from gac_jax.rollout import (
    AsyncRollouts,
    LaggedRollouts,
    ParamStore,
    PromptOrder,
    RolloutBuffer,
    RolloutConfig,
    SyncRollouts,
)
from gac_jax.rollout.buffer import BufferConfig
from gac_jax.rollout.sources import make_source
from tests.rollout.test_rollout import G, make_rollout


def scored(version, group_id, signal):
    """A group with distinct rewards (`signal`) or all rewards 0."""
    rollout = make_rollout(version, group_id)
    rewards = np.linspace(0.0, 1.0, G, dtype=np.float32) if signal else np.zeros(G, np.float32)
    return type(rollout)(**{**rollout.__dict__, "rewards": rewards})


def has_signal(rollout):
    return bool(np.ptp(rollout.rewards) > 0)


def generate_where(signal_of, calls=None, delay=0.0):
    """A `GenerateGroups` whose group g has signal iff `signal_of(g)`; records its calls."""

    def generate(params, version, requests, key):
        assert params["version"] == version
        if calls is not None:
            calls.append([r.group_id for r in requests])
        if delay:
            time.sleep(delay)
        return [scored(version, r.group_id, signal_of(r.group_id)) for r in requests]

    return generate


def test_the_buffer_discards_groups_without_signal_up_to_its_bound_per_batch():
    buffer = RolloutBuffer(4, 2, max_filtered=3)
    for g, signal in enumerate([False, True, False, False, False, True]):
        assert buffer.put(scored(0, g, signal))
    # Three discarded (the bound), then the fourth group without signal is kept.
    stats = buffer.stats()
    assert (stats.filtered, stats.depth) == (3, 3)
    assert [r.group_id for r in buffer.take(0)] == [1, 4]
    # The bound is per batch: after a take, groups without signal are discarded again.
    assert buffer.put(scored(0, 6, False)) and buffer.stats().filtered == 4
    state = buffer.state()
    assert state["filtered"] == 4 and state["produced"] == state["consumed"] + state["dropped"]
    restored = RolloutBuffer(4, 2, max_filtered=3).restore(state)
    assert restored.stats().filtered == 4
    del state["filtered"]  # A checkpoint from before dynamic sampling.
    assert RolloutBuffer(4, 2).restore(state).stats().filtered == 0


def test_without_dynamic_sampling_every_group_is_kept():
    buffer = RolloutBuffer(4, 2)
    for g in range(3):
        buffer.put(scored(0, g, False))
    assert (buffer.stats().filtered, buffer.stats().depth) == (0, 3)
    with pytest.raises(ValueError, match="max_filtered"):
        RolloutBuffer(4, 2, max_filtered=-1)


def test_a_discarded_group_gives_its_reservation_back_under_the_block_policy():
    buffer = RolloutBuffer(4, 2, max_staleness=0, stale_policy="block", max_filtered=4)
    assert buffer.reserve(0, timeout=0) and buffer.reserve(0, timeout=0)
    assert not buffer.reserve(0, timeout=0)  # Two slots for version 0 at staleness 0.
    buffer.put(scored(0, 0, False))
    assert buffer.stats().reserved == 1 and buffer.reserve(0, timeout=0)


def test_lagged_batches_hold_only_groups_with_signal_drawn_reproducibly():
    def run():
        calls = []
        store = ParamStore(history=3)
        source = LaggedRollouts(
            generate_where(lambda g: g % 3 == 0, calls),
            store,
            PromptOrder(50, seed=1),
            RolloutConfig(groups_per_batch=4, lag=2, dynamic_sampling=True, max_draws=3),
            seed=7,
        )
        batches = []
        for step in range(4):
            store.publish({"version": step}, step)
            batches.append(source.next_batch(step))
        return batches, calls, source.stats()

    (batches, calls, stats), (again, _, _) = run(), run()
    for step, batch in enumerate(batches):
        assert all(has_signal(r) for r in batch)
        assert [r.policy_version for r in batch] == [max(0, step - 2)] * 4
    assert [[r.group_id for r in b] for b in batches] == [[r.group_id for r in b] for b in again]
    # Round r of step t draws ids [(3 t + r) 4, (3 t + r + 1) 4): 3 draws at most per step.
    assert calls[:3] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert calls[3] == [12, 13, 14, 15]
    ids = [g for call in calls for g in call]
    assert len(ids) == len(set(ids))  # No group is drawn twice.
    # Step 0 drew 12 groups, kept 0, 3, 6, 9 and discarded the other 8 (the bound).
    assert stats.filtered >= 8 and stats.consumed == 16


def test_a_policy_whose_groups_all_score_alike_still_trains_after_max_draws():
    calls = []
    store = ParamStore()
    source = SyncRollouts(
        generate_where(lambda g: False, calls),
        store,
        PromptOrder(20),
        RolloutConfig("sync", groups_per_batch=2, dynamic_sampling=True, max_draws=3),
    )
    store.publish({"version": 0}, 0)
    batch = source.next_batch(0)
    assert len(batch) == 2 and not any(has_signal(r) for r in batch)
    assert len(calls) == 3 and source.stats().filtered == 4  # 1 + 4 / 2 draws.


def test_async_batches_hold_only_groups_with_signal_within_the_staleness_bound():
    store = ParamStore(history=1)
    store.publish({"version": 0}, 0)
    source = AsyncRollouts(
        generate_where(lambda g: g % 2 == 0, delay=0.002),
        store,
        PromptOrder(40),
        # One worker thread: groups are drawn and put in id order.
        RolloutConfig("async", groups_per_batch=2, dynamic_sampling=True, max_draws=4),
        BufferConfig(max_staleness=1, stale_policy="block", take_timeout=10.0),
    )
    consumed = []
    try:
        for step in range(8):
            batch = source.next_batch(step)
            assert all(has_signal(r) and 0 <= r.staleness(step) <= 1 for r in batch)
            consumed += [r.group_id for r in batch]
            store.publish({"version": step + 1}, step + 1)
    finally:
        source.close()
    state = source.state()
    assert source.stats().filtered >= 15 and consumed == list(range(0, 32, 2))
    # A discarded group counts as handed out: a resumed source never draws it again.
    not_again = set(range(state["next_group_id"])) | set(state["skip_group_ids"])
    assert set(range(1, consumed[-1], 2)) <= not_again


def test_the_config_turns_it_on_with_its_bound():
    store = ParamStore(history=1)
    config = RolloutConfig(mode="sync", groups_per_batch=4, dynamic_sampling=True, max_draws=3)
    source = make_source(
        config, BufferConfig(), generate_where(lambda g: True), store, PromptOrder(8)
    )
    assert source.buffer.max_filtered == 8
    off = make_source(RolloutConfig(mode="sync"), BufferConfig(), None, store, PromptOrder(8))
    assert off.buffer.max_filtered is None
    for bad, match in (({"max_draws": 0}, "max_draws=0"), ({"dynamic_sampling": 1}, "dynamic")):
        with pytest.raises(ValueError, match=match):
            RolloutConfig(**bad).validate()
