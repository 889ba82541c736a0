"""Rollout workers as Ray actors: separate processes, each with its own devices and JAX runtime.

`RayRolloutPool` is a `GenerateGroups`, so it plugs into `RolloutWorker` (and
`AsyncRollouts`): the worker threads keep the reservations, version choice, numbering and
buffer puts; each hands its call to one actor process and waits for the rollouts.

Weights travel by version through Ray's object store: the first call for a version
`ray.put`s the host params once; every actor fetches that object (zero-copy on the
learner's node) and places it on its devices, once per version. An actor's death reaches
the waiting thread as `RayActorError` (see `on_actor_failure`); a `RolloutActorDied` fails
the buffer, so the learner's next `take` raises `RolloutWorkerError` at once.

In-flight updates (`follow=store`) post each version on a small board actor that each
actor's thread waits on; every token keeps its version (`EpisodeSampler.sample_inflight`).
Transfers are timed (`put_seconds`, `transfer_seconds`), calls by `call_intervals`.

Example::

    def factory():  # Runs inside each actor process; must be picklable (module-level).
        model = create_model(get_config("tiny"), seed=0)
        graphdef, _ = nnx.split(model)
        generator = TaskGroupGenerator(graphdef, sampler, task, examples, tokenizer, config)
        return generator, jax.device_put

    LocalRayCluster().start().connect()  # Or ray.init(address=...) for a running cluster.
    with RayRolloutPool(factory, num_actors=4, env={"JAX_PLATFORMS": "cpu"}) as pool:
        config = RolloutConfig(mode="async", groups_per_batch=8, num_workers=4)
        source = AsyncRollouts(pool, store, prompts, config, BufferConfig())
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import ray

from gac_jax._closing import Closing
from gac_jax._validation import check_choice, check_int
from gac_jax.rollout.buffer import RolloutBufferClosed
from gac_jax.rollout.param_store import ParamStore
from gac_jax.rollout.ray_cluster import ON_ACTOR_FAILURE
from gac_jax.rollout.record import Rollout
from gac_jax.rollout.worker import GenerateGroups, GroupRequest

logger = logging.getLogger(__name__)


#: Runs inside an actor process and returns `(generate_groups, place)`: a `GenerateGroups`
#: for the actor's own devices, and `place(host_params) -> params`, which puts a host
#: (NumPy) param tree on those devices (`jax.device_put`, or onto the actor's mesh).
ActorFactory = Callable[[], tuple[GenerateGroups, Callable[[Any], Any]]]


class RolloutActorDied(RuntimeError):
    """A rollout actor's process died and the pool was not allowed to replace it."""


class RolloutPoolClosed(RolloutBufferClosed):
    """The pool was closed while a thread was calling it (the worker thread ends quietly)."""


#: Records an actor keeps of its calls and transfers (the newest ones).
_HISTORY = 100_000


class _VersionBoard:
    """The newest published version and its params' object reference (wrapped in a list,
    so that Ray hands the reference over rather than the params); an async Ray actor, so
    that rollout actors can wait on it for a newer version without polling."""

    def __init__(self):
        self._newest: tuple[int, list[ray.ObjectRef]] | None = None
        self._posted = asyncio.Condition()

    async def post(self, version: int, wrapped_ref: list[ray.ObjectRef]) -> None:
        async with self._posted:
            if self._newest is None or version > self._newest[0]:
                self._newest = (version, wrapped_ref)
                self._posted.notify_all()

    async def newer_than(self, version: int) -> tuple[int, list[ray.ObjectRef]]:
        """Waits until a version newer than `version` is posted, and returns it."""
        async with self._posted:
            await self._posted.wait_for(
                lambda: self._newest is not None and self._newest[0] > version
            )
            return self._newest


class _RolloutActor:
    """One rollout process: builds its generator on its own devices, keeps the newest params.

    Created by `RayRolloutPool` as a Ray actor; not meant to be used directly. With a
    `board`, the generator's `latest_params` (in-flight updates) reads the newest version
    from it.
    """

    def __init__(self, factory: ActorFactory, board: ray.actor.ActorHandle | None = None):
        self._generate, self._place = factory()
        self._version: int | None = None
        self._params: Any = None
        self._versions_seen: list[int] = []
        self._transfers: collections.deque = collections.deque(maxlen=_HISTORY)
        self._calls: collections.deque = collections.deque(maxlen=_HISTORY)
        self._board = board
        # In-flight updates: the newest version posted, kept up to date by a thread that
        # waits on the board, so that a look between decode chunks costs no Ray call.
        self._posted: tuple[int, list[ray.ObjectRef]] | None = None
        self._posted_lock = threading.Lock()
        if board is not None:
            if not hasattr(self._generate, "latest_params"):
                raise TypeError(
                    "in-flight updates need a generator with a `latest_params` attribute "
                    f"(TaskGroupGenerator has one); the factory returned {self._generate!r}."
                )
            self._generate.latest_params = self._newest
            threading.Thread(target=self._follow_board, name="follow-board", daemon=True).start()

    def _follow_board(self) -> None:
        version = -1
        while True:
            try:
                posted = ray.get(self._board.newer_than.remote(version))
            except Exception:  # noqa: BLE001 - the board was killed: the pool is closing
                return
            with self._posted_lock:
                self._posted = posted
            version = posted[0]

    def _take(self, version: int, wrapped_ref: list[ray.ObjectRef]) -> None:
        """Fetches and places `version`'s params (unless they are the ones held), timed."""
        if version == self._version:
            return
        start = time.perf_counter()
        self._params, self._version = None, None  # A failed fetch leaves no stale version.
        self._params = jax.block_until_ready(self._place(ray.get(wrapped_ref[0])))
        self._version = version
        self._transfers.append((version, time.perf_counter() - start))

    def _newest(self) -> tuple[Any, int]:
        """In-flight `latest_params`: the newest posted version if it is newer than the
        params held (fetched and placed once), else the params held."""
        with self._posted_lock:
            newest = self._posted
        if newest is not None and (self._version is None or newest[0] > self._version):
            self._take(*newest)
        return self._params, self._version

    def generate(
        self,
        params_ref: list[ray.ObjectRef],
        version: int,
        requests: Sequence[GroupRequest],
        key_data: np.ndarray,
        key_impl: str,
    ) -> list[Rollout]:
        start = time.time()
        self._take(version, params_ref)
        self._versions_seen.append(version)
        key = jax.random.wrap_key_data(key_data, impl=key_impl)
        rollouts = self._generate(self._params, version, requests, key)
        self._calls.append((start, time.time()))
        return rollouts

    def records(self, name: str) -> list:
        """A copy of `versions_seen`, `transfers` or `calls` (see the pool's getters)."""
        return list(getattr(self, f"_{name}"))

    def pid(self) -> int:
        return os.getpid()


class RayRolloutPool(Closing):
    """Rollout generation in `num_actors` Ray actor processes; a `GenerateGroups`.

    Each calling thread is bound to one actor: its first call claims the actor with the
    fewest live threads (ties: the lowest index) until the thread ends; an actor runs its
    calls one at a time.

    Initialise Ray first (`LocalRayCluster.connect`, which does not fork this JAX process,
    or `ray.init(address=...)`). Actors start in the background; the first call to each
    waits for its `factory` (`pids()` waits for all).

    Args:
      factory: a picklable zero-argument callable, run inside each actor, returning
        `(generate_groups, place)` (`ActorFactory`); it builds everything that touches
        devices on the actor's side.
      on_actor_failure: when an actor dies, "replace" warns, starts a new actor and retries
        the same groups on it (at most `max_replacements` times in the pool's life); "stop"
        raises `RolloutActorDied`, as does an actor whose `factory` raises (never replaced).
      actor_options: extra `ray.remote` options (`num_gpus`, ...); `num_cpus` defaults to 1.
      env: the actors' environment variables, e.g. ``{"JAX_PLATFORMS": "cpu"}``.
      keep_versions: the newest versions kept in the object store (an evicted one is put
        again: this bounds memory, not correctness).
      follow: in-flight updates: the learner's `ParamStore`, whose versions are posted to
        the actors; their generators (with `latest_params`) swap between decode chunks.
    """

    def __init__(
        self,
        factory: ActorFactory,
        num_actors: int,
        *,
        on_actor_failure: str = "replace",
        max_replacements: int = 3,
        actor_options: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        keep_versions: int = 2,
        follow: ParamStore | None = None,
    ):
        if not callable(factory):
            raise TypeError(f"factory must be a zero-argument callable, got {factory!r}.")
        check_int("num_actors", num_actors, 1)
        check_choice("on_actor_failure", on_actor_failure, ON_ACTOR_FAILURE)
        if max_replacements < 0:
            raise ValueError(f"max_replacements={max_replacements} must be >= 0.")
        if keep_versions < 1:
            raise ValueError(f"keep_versions={keep_versions} must be >= 1.")
        self.num_actors = num_actors
        self.on_actor_failure = on_actor_failure
        self.max_replacements = max_replacements
        self.keep_versions = keep_versions
        self.replacements = 0
        self._factory = factory
        options = {"num_cpus": 1, **(actor_options or {})}
        if env:
            runtime_env = dict(options.get("runtime_env") or {})
            env_vars = {**runtime_env.get("env_vars", {}), **{k: str(v) for k, v in env.items()}}
            options["runtime_env"] = {**runtime_env, "env_vars": env_vars}
        self._actor_class = ray.remote(_RolloutActor).options(**options)
        self._lock = threading.Lock()  # Actors, their pids, claims, closed.
        self._put_lock = threading.Lock()  # Serialises puts: each version is put once.
        self._refs: dict[int, ray.ObjectRef] = {}
        self._claims = [0] * num_actors  # Live threads bound to each actor.
        self._local = threading.local()
        self._closed = False
        self._put_seconds: dict[int, float] = {}
        self._published = threading.Event()
        self._unsubscribe: Callable[[], None] | None = None
        self._store = follow
        self._board = None
        if follow is not None:
            self._board = ray.remote(_VersionBoard).options(num_cpus=0).remote()
        self._actors = [self._actor_class.remote(factory, self._board) for _ in range(num_actors)]
        self._pid_refs = [actor.pid.remote() for actor in self._actors]
        if follow is not None:  # In-flight updates: each version published is put and posted.
            self._unsubscribe = follow.subscribe(lambda version: self._published.set())
            name = "RayRolloutPool.post"
            threading.Thread(target=self._post_versions, name=name, daemon=True).start()
            if follow.latest_version is not None:
                self._published.set()

    def __call__(
        self, params: Any, version: int, requests: Sequence[GroupRequest], key: jax.Array
    ) -> list[Rollout]:
        """Generates `requests` with params of `version` on this thread's actor."""
        if self._closed:
            raise RolloutPoolClosed("the RayRolloutPool is closed.")
        params_ref = self._params_ref(params, int(version))
        key_data = np.asarray(jax.random.key_data(key))
        key_impl = str(jax.random.key_impl(key))
        # The ref goes wrapped in a list so that Ray does not fetch it for every call: the
        # actor fetches and places it only when the version changes.
        args = ([params_ref], int(version), list(requests), key_data, key_impl)
        index = self._index()
        while True:
            with self._lock:
                actor = self._actors[index]
            try:
                rollouts = ray.get(actor.generate.remote(*args))
            except ray.exceptions.RayActorError as error:
                self._handle_death(index, actor, error)  # Raises, or replaces the actor.
                continue
            # `created_at` is another process's (possibly another host's) monotonic clock:
            # stamp the arrival on this one, where the buffer and the learner read it.
            arrived = time.monotonic()
            return [dataclasses.replace(r, created_at=arrived) for r in rollouts]

    def _post_versions(self) -> None:
        """In-flight updates: puts each newly published version and posts it to the board
        (a version published while the previous one was being put is skipped)."""
        while True:
            self._published.wait()
            self._published.clear()
            if self._closed:
                return
            params, version = self._store.latest()
            try:
                ref = self._params_ref(params, version)
                self._board.post.remote(version, [ref])
            except Exception:  # noqa: BLE001 - a closed pool or a stopped Ray: nothing to post to
                if self._closed or not ray.is_initialized():
                    return
                logger.exception("posting version %d to the rollout actors failed", version)

    def _params_ref(self, params: Any, version: int) -> ray.ObjectRef:
        """The object holding `version`'s params on the host, put on its first request."""
        with self._put_lock:
            ref = self._refs.get(version)
            if ref is None:
                if self._closed:
                    raise RolloutPoolClosed("the RayRolloutPool is closed.")
                start = time.perf_counter()
                ref = self._refs[version] = ray.put(jax.device_get(params))
                self._put_seconds[version] = time.perf_counter() - start
                while len(self._refs) > self.keep_versions:
                    # Actors still fetching an evicted version keep it alive (Ray counts
                    # the refs that calls in flight hold).
                    del self._refs[min(self._refs)]
            return ref

    def _index(self) -> int:
        """This thread's actor: claimed on its first call, released when the thread ends."""
        claim = getattr(self._local, "claim", None)
        if claim is None:
            with self._lock:
                index = min(range(self.num_actors), key=lambda i: (self._claims[i], i))
                self._claims[index] += 1
            claim = self._local.claim = _Claim(index)
            weakref.finalize(claim, self._release, index)
        return claim.index

    def _release(self, index: int) -> None:
        with self._lock:
            self._claims[index] -= 1

    def _handle_death(
        self, index: int, actor: ray.actor.ActorHandle, error: ray.exceptions.RayActorError
    ) -> None:
        with self._lock:
            if self._closed:
                raise RolloutPoolClosed("the RayRolloutPool was closed.") from error
            if self._actors[index] is not actor:
                return  # A thread sharing this actor has replaced it already.
            try:
                name = f"rollout actor {index} (pid {ray.get(self._pid_refs[index], timeout=0)})"
            except Exception:  # noqa: BLE001 - the actor died before it answered: no pid to name
                name = f"rollout actor {index}"
            # Ray's message: what happened on its first line, the remote exception (of a
            # failed start) on its last; the whole of it stays in the chained traceback.
            lines = str(error).strip().splitlines() or [type(error).__name__]
            cause = lines[0]
            if getattr(error, "actor_init_failed", False):
                raise RolloutActorDied(
                    f"{name} failed to start: its factory raised {lines[-1]}"
                ) from error
            if self.on_actor_failure == "stop":
                raise RolloutActorDied(
                    f"{name} died ({cause}); pass on_actor_failure='replace' to RayRolloutPool "
                    "to start a new actor in its place."
                ) from error
            if self.replacements >= self.max_replacements:
                raise RolloutActorDied(
                    f"{name} died ({cause}) after {self.replacements} replacements, the "
                    f"most allowed (max_replacements={self.max_replacements}); raise "
                    "max_replacements if deaths are expected."
                ) from error
            logger.warning("%s died (%s); starting a replacement.", name, cause)
            ray.kill(actor)  # It may be unreachable rather than dead: make sure.
            replacement = self._actor_class.remote(self._factory, self._board)
            self._actors[index] = replacement
            self._pid_refs[index] = replacement.pid.remote()
            self.replacements += 1

    @property
    def actors(self) -> list[ray.actor.ActorHandle]:
        """The current actor handles, by index (a replaced actor's handle is the new one)."""
        with self._lock:
            return list(self._actors)

    def pids(self, timeout: float | None = None) -> list[int]:
        """The actors' process ids, waiting until every actor has started."""
        return ray.get([actor.pid.remote() for actor in self.actors], timeout=timeout)

    def versions_seen(self) -> list[list[int]]:
        """For each actor, the version of each of its calls in order (a replacement starts
        afresh)."""
        return ray.get([actor.records.remote("versions_seen") for actor in self.actors])

    def put_seconds(self) -> dict[int, float]:
        """Seconds this process took to copy each version's params to the host and put them
        into the object store (once per version)."""
        with self._put_lock:
            return dict(self._put_seconds)

    def transfer_seconds(self) -> list[list[tuple[int, float]]]:
        """For each actor, (version, seconds to fetch and place its params) per version."""
        return ray.get([actor.records.remote("transfers") for actor in self.actors])

    def call_intervals(self) -> list[list[tuple[float, float]]]:
        """For each actor, the (start, end) wall-clock times (`time.time()`) of its calls."""
        return ray.get([actor.records.remote("calls") for actor in self.actors])

    def close(self) -> None:
        """Kills the actors and drops the params in the object store. A thread waiting on
        a call ends with `RolloutPoolClosed`, which the worker treats as a closed buffer."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            actors = list(self._actors)
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._published.set()  # The poster sees the pool closed and ends.
        with self._put_lock:
            self._refs.clear()
        if ray.is_initialized():
            for actor in actors + ([self._board] if self._board is not None else []):
                ray.kill(actor)


@dataclasses.dataclass(frozen=True)
class _Claim:
    """A thread's binding to an actor; when the thread ends its local storage, and with it
    this object, is freed, and the finalizer gives the claim back."""

    index: int
