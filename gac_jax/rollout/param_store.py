"""`ParamStore`: the versioned parameters that rollout workers sample with."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any

import jax


class ParamStore:
    """Thread-safe store of published `(params, version)`, keeping a bounded history.

    The learner publishes each new version; workers read the latest, and lagged mode reads
    older versions, which is why `history` versions are kept. Versions must increase.
    Params are held as they are given (device arrays stay on device, and are immutable, so
    readers never see a half-written version); `memory_bytes()` states the cost.

    Waiters not blocked on the store itself (a buffer's reservation) `subscribe` to be told
    of each publish. `history` newest versions stay readable (>= 1; lag k needs k + 1).
    """

    def __init__(self, history: int = 1):
        if history < 1:
            raise ValueError(f"history={history} must be >= 1.")
        self._history = history
        self._versions: collections.OrderedDict[int, Any] = collections.OrderedDict()
        self._changed = threading.Condition()
        self._subscribers: list[Callable[[int], None]] = []

    @property
    def history(self) -> int:
        return self._history

    def publish(self, params: Any, version: int) -> None:
        """Makes `params` the latest version; evicts versions beyond the history."""
        with self._changed:
            if self._versions and version <= next(reversed(self._versions)):
                raise ValueError(
                    f"version={version} must exceed the latest published version "
                    f"{next(reversed(self._versions))}."
                )
            self._versions[version] = params
            while len(self._versions) > self._history:
                self._versions.popitem(last=False)
            self._changed.notify_all()
            subscribers = list(self._subscribers)
        # Outside the lock: a subscriber takes its own lock, and may read this store under it.
        for callback in subscribers:
            callback(version)

    def subscribe(self, callback: Callable[[int], None]) -> Callable[[], None]:
        """Calls `callback(version)` after each publish; returns the function that unsubscribes.

        The callback runs in the publishing thread, after the new version is readable, so a
        waiter woken by it sees the version (`RolloutWorker` wakes the buffer's reservations
        this way instead of polling).
        """
        with self._changed:
            self._subscribers.append(callback)

        def unsubscribe() -> None:
            with self._changed:
                if callback in self._subscribers:
                    self._subscribers.remove(callback)

        return unsubscribe

    def latest(self) -> tuple[Any, int]:
        """(params, version) of the newest version; raises LookupError if nothing is published."""
        with self._changed:
            if not self._versions:
                raise LookupError("ParamStore is empty: nothing has been published yet.")
            version = next(reversed(self._versions))
            return self._versions[version], version

    @property
    def latest_version(self) -> int | None:
        with self._changed:
            return next(reversed(self._versions)) if self._versions else None

    def get(self, version: int) -> Any:
        """The params of `version`; LookupError naming the versions held if it is not kept."""
        with self._changed:
            if version not in self._versions:
                raise LookupError(
                    f"version {version} is not in the ParamStore; it holds "
                    f"{list(self._versions)} (history={self._history})."
                )
            return self._versions[version]

    def wait_for_version(self, version: int, timeout: float | None = None) -> bool:
        """Blocks until a version >= `version` is published; False on timeout."""
        with self._changed:
            return self._changed.wait_for(
                lambda: bool(self._versions) and next(reversed(self._versions)) >= version,
                timeout=timeout,
            )

    def versions(self) -> list[int]:
        with self._changed:
            return list(self._versions)

    def memory_bytes(self) -> int:
        """Bytes held by all kept versions (sum of the leaves' nbytes)."""
        with self._changed:
            trees = list(self._versions.values())
        return sum(int(getattr(leaf, "nbytes", 0)) for t in trees for leaf in jax.tree.leaves(t))
