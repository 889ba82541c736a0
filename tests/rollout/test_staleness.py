"""The staleness and reservation rules (`gac_jax.rollout.staleness`), alone.

`RolloutBuffer` and the pipeline simulation both decide with these functions; here they
are checked against hand-computed cases and, with hypothesis, against the guarantees the
buffer promises: no group older than the bound is ever handed out, and under the block
policy groups that finish in reservation order are never dropped.
"""

import collections

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gac_jax.rollout.staleness import (
    STALE_POLICIES,
    check_staleness_settings,
    held_after_drop,
    is_stale,
    reservation_allowed,
    reservation_limit,
    staleness,
    take_fresh,
)


def test_staleness_and_is_stale():
    assert staleness(5, 3) == 2
    assert staleness(0, 0) == 0
    assert not is_stale(5, 3, max_staleness=2)  # At the bound: fresh.
    assert is_stale(5, 2, max_staleness=2)
    assert not is_stale(1000, 0, max_staleness=None)  # No bound: never stale.
    assert is_stale(1, 0, max_staleness=0)


def test_reservation_rule_by_hand():
    # B = 2, alpha = 1, latest version 0: groups 0..3 may start (steps 0 and 1 use them).
    assert reservation_limit(0, 1, 2) == 4
    kwargs = dict(max_staleness=1, groups_per_batch=2)
    granted = [reservation_allowed(j, 0, stale_policy="block", **kwargs) for j in range(6)]
    assert granted == [True, True, True, True, False, False]
    # One published version later, two more slots.
    assert reservation_allowed(5, 1, stale_policy="block", **kwargs)
    assert not reservation_allowed(6, 1, stale_policy="block", **kwargs)
    # The drop policy never blocks, with or without a bound.
    assert reservation_allowed(10**6, 0, stale_policy="drop", **kwargs)
    assert reservation_allowed(
        10**6, 0, max_staleness=None, groups_per_batch=2, stale_policy="drop"
    )


def test_dropped_groups_give_their_reservation_back_only_when_blocking():
    assert held_after_drop(7, 3, "block") == 4
    assert held_after_drop(7, 3, "drop") == 7
    assert held_after_drop(7, 0, "block") == 7


def test_take_fresh_by_hand():
    # (group id, version) pairs, oldest first; the learner is at version 4, alpha = 1.
    queue = [(0, 2), (1, 4), (2, 3), (3, 1), (4, 4)]
    out = take_fresh(queue, 4, 2, 1, lambda g: g[1])
    assert out.batch == ((1, 4), (2, 3))
    assert out.kept == ((4, 4),)
    assert out.dropped == ((0, 2), (3, 1))
    # Too few fresh groups: no batch, but the stale ones are still dropped.
    out = take_fresh(queue, 4, 4, 1, lambda g: g[1])
    assert out.batch is None
    assert out.kept == ((1, 4), (2, 3), (4, 4))
    assert out.dropped == ((0, 2), (3, 1))
    # No bound: nothing is dropped, the oldest are taken.
    out = take_fresh(queue, 4, 2, None, lambda g: g[1])
    assert out.batch == ((0, 2), (1, 4)) and out.dropped == ()


def test_settings_are_checked():
    for policy in STALE_POLICIES:
        check_staleness_settings(0, policy)
    check_staleness_settings(None, "drop")
    check_staleness_settings(None, "block", block_needs_bound=False)
    with pytest.raises(ValueError, match="max_staleness=-1"):
        check_staleness_settings(-1, "drop")
    with pytest.raises(ValueError, match="is not one of"):
        check_staleness_settings(1, "wait")
    with pytest.raises(ValueError, match="needs a max_staleness"):
        check_staleness_settings(None, "block")


@given(
    versions=st.lists(st.integers(0, 12), max_size=12),
    learner_version=st.integers(0, 14),
    num_groups=st.integers(1, 6),
    bound=st.one_of(st.none(), st.integers(0, 5)),
)
def test_take_never_hands_out_a_group_older_than_the_bound(
    versions, learner_version, num_groups, bound
):
    queue = list(enumerate(versions))  # (position, version): positions show the order.
    out = take_fresh(queue, learner_version, num_groups, bound, lambda g: g[1])
    # An independent reference: the fresh groups in order, the oldest num_groups of them.
    fresh = [g for g in queue if bound is None or learner_version - g[1] <= bound]
    stale = [g for g in queue if g not in fresh]
    assert list(out.dropped) == stale
    if out.batch is None:
        assert len(fresh) < num_groups and list(out.kept) == fresh
    else:
        assert all(learner_version - v <= bound for _, v in out.batch if bound is not None)
        assert list(out.batch) + list(out.kept) == fresh
        assert len(out.batch) == num_groups


@given(
    batch=st.integers(1, 4),
    alpha=st.integers(0, 3),
    policy=st.sampled_from(STALE_POLICIES),
    in_order=st.booleans(),
    actions=st.lists(st.tuples(st.sampled_from("rft"), st.integers(0, 10**6)), max_size=200),
)
def test_a_pipeline_built_on_the_rules_keeps_the_bound(batch, alpha, policy, in_order, actions):
    """Producers and a learner driven by the rules alone, in a random interleaving.

    "r": a producer reserves (when allowed) and starts a group with the latest version;
    "f": a group in flight finishes (the oldest, or any one when not `in_order`);
    "t": the learner takes a batch and publishes the next version.
    """
    version = held = 0
    in_flight: collections.deque[tuple[int, int]] = collections.deque()  # (id, version)
    queue: list[tuple[int, int]] = []
    next_id = taken = dropped = 0
    for action, pick in actions:
        if action == "r":
            allowed = reservation_allowed(
                held, version, max_staleness=alpha, groups_per_batch=batch, stale_policy=policy
            )
            if policy == "block":
                assert allowed == (held < (version + alpha + 1) * batch)
            if allowed:
                in_flight.append((next_id, version))
                next_id, held = next_id + 1, held + 1
        elif action == "f" and in_flight:
            index = 0 if in_order else pick % len(in_flight)
            queue.append(in_flight[index])
            del in_flight[index]
        elif action == "t":
            out = take_fresh(queue, version, batch, alpha, lambda g: g[1])
            queue = list(out.kept)
            dropped += len(out.dropped)
            held = held_after_drop(held, len(out.dropped), policy)
            if out.batch is not None:
                assert all(0 <= version - v <= alpha for _, v in out.batch)
                taken += len(out.batch)
                version += 1
    assert taken + dropped + len(queue) + len(in_flight) == next_id  # Exactly once.
    if policy == "block" and in_order:
        # AReaL's guarantee: the j-th group is trained at step j // B <= v + alpha.
        assert dropped == 0
