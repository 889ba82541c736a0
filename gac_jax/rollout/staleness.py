"""The staleness and reservation rules of the rollout buffer, as pure functions.

`RolloutBuffer` (threads, locks) and the discrete-event simulation of the pipeline
(`benchmarks/simulation.py`, no threads) both decide with these functions, so there is
one implementation of each rule:

- **staleness** of a group: learner version - the group's (oldest) policy version.
- **stale**: staleness > `max_staleness` (ROLL Flash's alpha); never with no bound.
- **take**: discard every stale group (whatever the policy), then hand out the oldest
  `num_groups` fresh ones, if there are that many.
- **block policy, reservations** (AReaL's rule): the j-th reserved group (0-based) is
  consumed at learner step j // B at the earliest, so a producer may start one with latest
  version v only if j < (v + max_staleness + 1) * B. Under the drop policy a reservation
  is always granted.
- **block policy, giving back**: a group dropped as stale gives its reservation back, so
  the groups behind it move up one place in the consumption order. Without this every
  drop would shrink, for good, how far ahead producers may run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

STALE_POLICIES = ("drop", "block")

T = TypeVar("T")


def check_staleness_settings(
    max_staleness: int | None, stale_policy: str, *, block_needs_bound: bool = True
) -> None:
    """Raises `ValueError` for a negative bound, an unknown policy, or block without a bound.

    Args:
      max_staleness: the bound, or None for none.
      stale_policy: one of `STALE_POLICIES`.
      block_needs_bound: whether the policy is in force (False skips the last check, for a
        configuration where the policy is unused, such as a synchronous run).
    """
    if max_staleness is not None and max_staleness < 0:
        raise ValueError(f"max_staleness={max_staleness} must be >= 0 or None.")
    if stale_policy not in STALE_POLICIES:
        raise ValueError(f"stale_policy={stale_policy!r} is not one of {STALE_POLICIES}.")
    if block_needs_bound and stale_policy == "block" and max_staleness is None:
        raise ValueError("stale_policy='block' needs a max_staleness bound.")


def staleness(learner_version: int, group_version: int) -> int:
    """Policy-version gap between the learner and a group's oldest token."""
    return int(learner_version) - int(group_version)


def is_stale(learner_version: int, group_version: int, max_staleness: int | None) -> bool:
    """Whether a group is too old to train on: staleness > `max_staleness` (None: never)."""
    return max_staleness is not None and staleness(learner_version, group_version) > max_staleness


def reservation_limit(latest_version: int, max_staleness: int, groups_per_batch: int) -> int:
    """How many reservations may be held while `latest_version` is the newest version
    (the block policy's rule, see the module docstring)."""
    return (latest_version + max_staleness + 1) * groups_per_batch


def oldest_allowed_version(reservation: int, max_staleness: int, groups_per_batch: int) -> int:
    """The oldest version the group reserved `reservation`-th (0-based) may be sampled by:
    the inverse of `reservation_limit` (a reservation granted while `latest_version` is
    the newest has an oldest allowed version <= `latest_version`)."""
    return max(0, int(reservation) // groups_per_batch - max_staleness)


def reservation_allowed(
    held: int,
    latest_version: int,
    *,
    max_staleness: int | None,
    groups_per_batch: int,
    stale_policy: str,
) -> bool:
    """Whether one more reservation, the `held`-th (0-based), may be granted now: always
    under the drop policy, below `reservation_limit` under the block policy."""
    if stale_policy != "block":
        return True
    return held < reservation_limit(latest_version, max_staleness, groups_per_batch)


def held_after_drop(held: int, dropped: int, stale_policy: str) -> int:
    """Reservations still held after `dropped` stale groups are discarded (given back
    under the block policy; under the drop policy the count is only a record)."""
    return held - dropped if stale_policy == "block" else held


@dataclasses.dataclass(frozen=True)
class TakeOutcome(Generic[T]):
    """What a `take` does to a queue."""

    batch: tuple[T, ...] | None  # Handed out, oldest first; None when too few fresh ones wait.
    kept: tuple[T, ...]  # The queue afterwards, in order.
    dropped: tuple[T, ...]  # The stale groups discarded (even when `batch` is None).


def take_fresh(
    queue: Iterable[T],
    learner_version: int,
    num_groups: int,
    max_staleness: int | None,
    version_of: Callable[[T], int],
) -> TakeOutcome[T]:
    """The take rule: drop every stale group, then pop the oldest `num_groups` if there.

    Args:
      queue: the waiting groups, oldest first.
      learner_version: the version the learner trains at.
      num_groups: groups to hand out.
      max_staleness: the bound, or None for none.
      version_of: a group's (oldest) policy version.
    """
    fresh, stale = [], []
    for group in queue:
        stale_group = is_stale(learner_version, version_of(group), max_staleness)
        (stale if stale_group else fresh).append(group)
    if len(fresh) < num_groups:
        return TakeOutcome(None, tuple(fresh), tuple(stale))
    return TakeOutcome(tuple(fresh[:num_groups]), tuple(fresh[num_groups:]), tuple(stale))
