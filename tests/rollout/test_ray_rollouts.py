"""Rollout workers as Ray actors: a real local Ray cluster, real actor processes, each with
its own JAX runtime (CPU, 2 fake devices), fed by `AsyncRollouts` worker threads while the
test thread plays the learner (publishes versions, takes batches)."""

import os
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import ray
from flax import nnx

from gac_jax import models
from gac_jax.rollout import (
    AsyncRollouts,
    BufferConfig,
    GenerationConfig,
    ParamStore,
    PromptOrder,
    Rollout,
    RolloutConfig,
    RolloutWorkerError,
    TaskGroupGenerator,
    make_sampler,
)
from gac_jax.rollout.ray_cluster import LocalRayCluster
from gac_jax.rollout.ray_rollouts import RayRolloutPool, RolloutActorDied
from gac_jax.rollout.worker import GroupRequest, group_key
from gac_jax.tasks import get_task
from tests.conftest import process_env

# Each actor is its own JAX runtime with 2 fake CPU devices (this process has 8).
ACTOR_ENV = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": process_env(2)["XLA_FLAGS"]}
EXAMPLES = [
    {"a": a, "op": "+", "b": b, "answer": a + b}
    for a, b in [(12, 34), (50, 7), (3, 99), (41, 41), (8, 15), (27, 60)]
]
# Sampled, not greedy: the test process regenerates a group from its key and params, which
# checks that the key and the weights reached the actor intact.
CONFIG = GenerationConfig(group_size=2, prompt_length=8, max_new_tokens=4)
GROUPS_PER_BATCH = 2
MAX_STALENESS = 1
SEED = 0

# The actors cannot import this test module (pytest loads it by path), so the factories
# below travel by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def make_generator() -> TaskGroupGenerator:
    """The real generator of the tiny decoder, sampling arithmetic/add2 prompts (params
    arrive per call)."""
    config = models.get_config("tiny")
    # The structure only: initialising weights that are never used costs seconds.
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: models.create_model(config)))
    tokenizer = models.CharTokenizer()
    sampler = make_sampler(config, tokenizer, CONFIG)
    task = get_task("arithmetic/add2")
    return TaskGroupGenerator(graphdef, sampler, task, EXAMPLES, tokenizer, CONFIG)


def tiny_model_factory():
    """Runs in each actor process: the generator on the actor's devices."""
    return make_generator(), jax.device_put


class SlowLookups:
    """A generator whose every look at the newest version (between decode chunks) takes
    50 ms, so that a learner publishing every few hundred ms lands inside calls."""

    def __init__(self, generator):
        self._generator = generator

    @property
    def latest_params(self):
        return self._generator.latest_params

    @latest_params.setter
    def latest_params(self, newest):
        def slow():
            time.sleep(0.05)
            return newest()

        self._generator.latest_params = slow

    def __call__(self, *args):
        return self._generator(*args)


def inflight_factory():
    """Runs in each actor process: the generator, looking for a new version every step."""
    generator = make_generator()
    generator.chunk_steps = 1
    return SlowLookups(generator), jax.device_put


def fake_factory():
    """Runs in each actor process: groups of zeros, no model (for the failure tests)."""

    def generate(params, version, requests, key):
        time.sleep(0.01)
        g, length = 2, 3
        return [
            Rollout(
                prompt_id=r.prompt_id,
                group_id=r.group_id,
                prompt_tokens=np.zeros(2, np.int32),
                completion_tokens=np.zeros((g, length), np.int32),
                completion_mask=np.ones((g, length), bool),
                behaviour_logp=np.zeros((g, length), np.float32),
                rewards=np.zeros(g, np.float32),
                policy_version=version,
            )
            for r in requests
        ]

    return generate, lambda host_params: host_params


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    # A fresh cluster of this test's own, never someone else's, started from a clean
    # interpreter (no fork of this JAX process).
    with LocalRayCluster(num_cpus=4) as cluster:
        cluster.connect(log_to_driver=False)
        yield
        ray.shutdown()


@pytest.fixture(scope="module")
def replacing_pool(ray_cluster):
    """Two actors of the tiny model, shared by the tests below (their start-up dominates)."""
    with RayRolloutPool(
        tiny_model_factory, 2, on_actor_failure="replace", max_replacements=1, env=ACTOR_ENV
    ) as pool:
        yield pool


@pytest.fixture(scope="module")
def base_params():
    """Random weights of the tiny decoder on this process's devices (drawn directly: the
    model's own initialiser takes seconds on a loaded machine)."""
    abstract = nnx.split(nnx.eval_shape(lambda: models.create_model(models.get_config("tiny"))))
    rng = np.random.default_rng(0)
    return jax.tree.map(
        lambda leaf: jnp.asarray(rng.normal(0.0, 0.2, leaf.shape), leaf.dtype), abstract[1]
    )


class Learner:
    """The test thread's learner: publishes version `step` (params moved by step * 1e-3),
    then takes that step's batch, recording (learner version, group)."""

    def __init__(self, pool, base_params, store=None, pause=0.0):
        self.base_params = base_params
        self.published = {}
        self.taken: list[tuple[int, Rollout]] = []
        self.store = store or ParamStore()
        self.pause = pause  # Seconds each step spends "training" after its batch.
        self.step = 0
        self.publish(0)
        self.source = AsyncRollouts(
            pool,
            self.store,
            PromptOrder(len(EXAMPLES), seed=SEED),
            RolloutConfig("async", groups_per_batch=GROUPS_PER_BATCH, num_workers=2),
            BufferConfig(max_staleness=MAX_STALENESS, stale_policy="block", take_timeout=120.0),
            seed=SEED,
        )

    def publish(self, version):
        params = jax.tree.map(lambda x: x + version * 1e-3, self.base_params)
        self.published[version] = params
        self.store.publish(params, version)

    def train_step(self):
        if self.step > 0:
            self.publish(self.step)
        self.taken += [(self.step, r) for r in self.source.next_batch(self.step)]
        time.sleep(self.pause)
        self.step += 1

    def check_bound_and_ids(self):
        gaps = [step - rollout.policy_version for step, rollout in self.taken]
        assert all(0 <= gap <= MAX_STALENESS for gap in gaps), gaps
        ids = [rollout.group_id for _, rollout in self.taken]
        assert len(set(ids)) == len(ids) == GROUPS_PER_BATCH * self.step


def test_actors_sample_published_versions_in_order_within_the_bound(replacing_pool, base_params):
    # The in-process twin of the actors' generator, which regenerates two groups below;
    # built and compiled first, while the actors start.
    generator = make_generator()
    generator(base_params, 0, [GroupRequest(0, 0)], jax.random.key(0))
    learner = Learner(replacing_pool, base_params)
    try:
        for _ in range(6):
            learner.train_step()
    finally:
        learner.source.close()

    learner.check_bound_and_ids()
    seen = replacing_pool.versions_seen()
    assert all(seen), f"an actor did no work: {seen}"
    for versions in seen:
        assert versions == sorted(versions), seen
    assert len({v for versions in seen for v in versions}) > 1, seen  # New weights arrived.
    # The tokens are the model's: the same (params, version, request, key) in this process
    # gives the same samples (oldest and newest version taken).
    for _, rollout in (learner.taken[0], learner.taken[-1]):
        request = GroupRequest(rollout.prompt_id, rollout.group_id)
        params = learner.published[rollout.policy_version]
        key = group_key(SEED, rollout.group_id)
        [again] = generator(params, rollout.policy_version, [request], key)
        np.testing.assert_array_equal(again.completion_tokens, rollout.completion_tokens)
        np.testing.assert_array_equal(again.completion_mask, rollout.completion_mask)
        np.testing.assert_allclose(again.behaviour_logp, rollout.behaviour_logp, atol=1e-5)


def test_inflight_actors_swap_to_published_versions_between_chunks(base_params):
    store = ParamStore()
    with RayRolloutPool(inflight_factory, 1, env=ACTOR_ENV, follow=store) as pool:
        learner = Learner(pool, base_params, store=store, pause=0.3)
        try:
            for _ in range(6):
                learner.train_step()
        finally:
            learner.source.close()
        transfers = pool.transfer_seconds()[0]
        puts = pool.put_seconds()
        calls = pool.call_intervals()[0]

    learner.check_bound_and_ids()
    mixed = 0
    for step, rollout in learner.taken:
        versions = rollout.token_versions[rollout.completion_mask]
        # The group's version is its oldest token's, and no token comes from the future.
        assert rollout.policy_version == versions.min() and versions.max() <= step
        rows = np.where(rollout.completion_mask, rollout.token_versions, np.iinfo(np.int32).max)
        assert np.all(np.diff(np.minimum.accumulate(rows[:, ::-1], axis=1)[:, ::-1]) >= 0)
        mixed += len(np.unique(versions)) > 1
    assert mixed > 0, "no group spanned a weight update; the test did not exercise it"
    # Every version the actor took was timed on both sides.
    taken = [version for version, _ in transfers]
    assert len(set(taken)) > 1 and set(taken) <= set(puts)
    assert all(seconds > 0 for _, seconds in transfers) and all(v > 0 for v in puts.values())
    assert calls and all(start <= end for start, end in calls)


def test_a_killed_actor_is_replaced_and_training_goes_on(replacing_pool, base_params):
    pids = replacing_pool.pids()
    learner = Learner(replacing_pool, base_params)
    try:
        for _ in range(2):
            learner.train_step()
        os.kill(pids[0], signal.SIGKILL)
        deadline = time.monotonic() + 120
        # Until the replacement has generated (its first call is the retry of the groups
        # the dead actor had in flight, or the next call of the thread bound to it).
        while not (replacing_pool.replacements and replacing_pool.versions_seen()[0]):
            assert time.monotonic() < deadline, "no replacement generated within 120 s"
            learner.train_step()
        for _ in range(2):
            learner.train_step()
    finally:
        learner.source.close()

    assert replacing_pool.replacements == 1
    new_pids = replacing_pool.pids()
    assert new_pids[0] != pids[0] and new_pids[1] == pids[1]
    learner.check_bound_and_ids()


def test_an_actor_death_reaches_the_learner_within_seconds_with_stop(base_params):
    with RayRolloutPool(fake_factory, 2, on_actor_failure="stop", env=ACTOR_ENV) as pool:
        pid = pool.pids()[1]
        learner = Learner(pool, base_params)
        try:
            while not all(pool.versions_seen()):
                learner.train_step()
            ray.kill(pool.actors[1])
            killed = time.monotonic()
            with pytest.raises(
                RolloutWorkerError, match=rf"rollout actor 1 \(pid {pid}\) died"
            ) as failed:
                while True:
                    learner.train_step()
            elapsed = time.monotonic() - killed
        finally:
            learner.source.close()
    assert elapsed < 10.0, elapsed
    assert isinstance(failed.value.__cause__, RolloutActorDied)
    assert "on_actor_failure='replace'" in str(failed.value)
    learner.check_bound_and_ids()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(num_actors=0), "num_actors=0 must be an int >= 1"),
        (dict(on_actor_failure="retry"), "on_actor_failure='retry' is unknown"),
        (dict(max_replacements=-1), "max_replacements=-1 must be >= 0"),
        (dict(keep_versions=0), "keep_versions=0 must be >= 1"),
    ],
)
def test_bad_arguments_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RayRolloutPool(fake_factory, **{"num_actors": 1, **kwargs})
