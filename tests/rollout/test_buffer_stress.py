"""Threaded stress test of `RolloutBuffer`: over 10,000 groups, a killed producer, a close.

Producers reserve (with the latest version or a random recent one), wait a random while,
and put a group of a random valid version; a consumer takes batches and publishes the next
version; one producer dies between a reservation and its put, and gives the reservation
back (`release`, the buffer's documented contract); a closer closes the buffer at a random
moment after the target. Every group put is consumed, dropped as stale, or still waiting:
none lost, none twice, none over the bound, and the counters balance exactly.
"""

import random
import threading
import time

import numpy as np
import pytest

from gac_jax.rollout import ParamStore, Rollout, RolloutBuffer, RolloutBufferClosed

TARGET_GROUPS = 10_000
GROUPS_PER_BATCH = 4
_Z = np.zeros((1, 1), np.int32)


def tiny_rollout(version, group_id):
    mask, logp, rewards = _Z.astype(bool), _Z.astype(np.float32), np.zeros(1, np.float32)
    return Rollout(0, group_id, _Z[0], _Z, mask, logp, rewards, version)


class ProducerKilled(Exception):
    pass


class Ledger:
    """What the producers did, counted on their side."""

    def __init__(self):
        self.lock = threading.Lock()
        self.granted = self.released = 0
        self.put_ids: list[int] = []
        self.errors: list[BaseException] = []
        self.killed = False
        self._ids = iter(range(10**9))

    def next_id(self):
        with self.lock:
            return next(self._ids)


def producer(buffer, store, ledger, policy, alpha, seed, kill_after):
    rng = random.Random(seed)
    made = 0
    while True:
        held = False
        try:
            latest = store.latest_version
            if policy == "block" and rng.random() < 0.5:
                version = lambda: store.latest_version  # noqa: E731 - read at each wake
                low = latest
            else:  # A recent version (under drop, some will be too stale to train on).
                low = rng.randint(max(0, latest - (1 if policy == "block" else alpha + 2)), latest)
                version = low
            if not buffer.reserve(version, timeout=0.002):
                continue
            held = True
            with ledger.lock:
                ledger.granted += 1
            if rng.random() < 0.01:
                time.sleep(rng.uniform(0, 0.002))
            made += 1
            if made == kill_after:
                raise ProducerKilled  # Between the reservation and the put.
            gid = ledger.next_id()
            # Sample with the reserved version or a newer one (the reservation's contract).
            buffer.put(tiny_rollout(rng.randint(low, store.latest_version), gid))
            held = False
            with ledger.lock:
                ledger.put_ids.append(gid)
        except RolloutBufferClosed:
            return _give_back(buffer, ledger, held)
        except ProducerKilled:
            ledger.killed = True
            return _give_back(buffer, ledger, held)
        except BaseException as error:  # noqa: BLE001 - reported by the test
            ledger.errors.append(error)
            return None


def _give_back(buffer, ledger, held):
    if held:
        buffer.release()
        with ledger.lock:
            ledger.released += 1


def consume(buffer, store, alpha, reached_target):
    """Takes batches until the buffer is closed; returns the group ids taken."""
    taken, step = [], 0
    while True:
        try:
            batch = buffer.take(learner_version=step, timeout=20.0)
        except RolloutBufferClosed:
            return taken
        assert len(batch) == GROUPS_PER_BATCH
        assert all(0 <= r.staleness(step) <= alpha for r in batch), step
        taken.extend(r.group_id for r in batch)
        if len(taken) >= TARGET_GROUPS:
            reached_target.set()
        step += 1
        store.publish(None, step)


@pytest.mark.parametrize("policy, alpha, seed", [("drop", 1, 0), ("block", 1, 1), ("block", 0, 2)])
def test_buffer_stress_exactly_once_within_the_bound(policy, alpha, seed):
    rng = random.Random(seed)
    buffer = RolloutBuffer(2 * GROUPS_PER_BATCH, GROUPS_PER_BATCH, alpha, policy)
    store = ParamStore()
    store.publish(None, 0)
    store.subscribe(lambda version: buffer.wake())
    ledger, reached_target = Ledger(), threading.Event()
    kill_after = [rng.randint(200, 800)] + [0] * 3  # Producer 0 dies; 0 never matches.
    threads = [
        threading.Thread(
            target=producer,
            args=(buffer, store, ledger, policy, alpha, rng.random(), kill_after[i]),
        )
        for i in range(4)
    ]
    close_delay = rng.uniform(0, 0.02)

    def closer():
        reached_target.wait()
        time.sleep(close_delay)
        buffer.close()

    threads.append(threading.Thread(target=closer))
    for thread in threads:
        thread.start()
    taken = consume(buffer, store, alpha, reached_target)
    for thread in threads:
        thread.join(10.0)
        assert not thread.is_alive()
    assert ledger.errors == [] and ledger.killed
    stats, waiting = buffer.stats(), buffer.waiting_group_ids()
    assert len(taken) >= TARGET_GROUPS
    assert len(taken) == len(set(taken)) == stats.consumed  # None twice.
    assert len(ledger.put_ids) == len(set(ledger.put_ids)) == stats.produced
    assert not set(taken) & set(waiting) and set(taken) | set(waiting) <= set(ledger.put_ids)
    assert stats.produced == stats.consumed + stats.dropped + stats.depth  # None lost.
    assert stats.depth == len(waiting) < GROUPS_PER_BATCH
    assert max(stats.staleness_histogram) <= alpha
    # Reservations: every one granted was put or given back; a dropped group gave its slot
    # back under the block policy.
    assert ledger.granted - ledger.released == stats.produced
    held = stats.consumed + stats.depth if policy == "block" else stats.produced
    assert stats.reserved == held
