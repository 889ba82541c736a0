"""The async loop's two other ways to sample: in-flight weight updates, and Ray actors."""

import time

import numpy as np
import pytest

from gac_jax import models
from gac_jax.rollout import GenerationConfig, RolloutConfig
from gac_jax.rollout.ray_cluster import LocalRayCluster
from gac_jax.train import loop
from gac_jax.train import run as run_lib
from gac_jax.train.config import TrainConfig
from gac_jax.train.config_io import apply_overrides
from gac_jax.train.metrics import read_metrics
from tests.conftest import process_env


def _config(tmp_path, steps, *overrides):
    config = TrainConfig(
        task="arithmetic/add2",
        data_dir=str(tmp_path / "tfds"),
        init="random",
        steps=steps,
        eval_every=0,
        checkpoint_every=0,
        rollout=RolloutConfig(mode="async", groups_per_batch=2),
        generation=GenerationConfig(group_size=2, prompt_length=12, max_new_tokens=12),
    )
    return apply_overrides(config, ["buffer.max_staleness=1", "mesh.data=1", *overrides])


@pytest.mark.slow
def test_inflight_updates_tag_each_token_with_its_version(
    tmp_path, digit_task, monkeypatch, consumed
):
    # A slow sampler (each look at the newest version between decode steps takes 50 ms)
    # and a learner that spends 0.2 s a step: the learner publishes while a worker is
    # still decoding, so some groups mix versions.
    real_build_run, real_step = loop.build_run, run_lib.Run.step

    def slow_build_run(config):
        run = real_build_run(config)
        latest = run.generator.latest_params

        def slow_latest():
            time.sleep(0.05)
            return latest()

        run.generator.latest_params = slow_latest
        return run

    def slow_step(*args, **kwargs):
        time.sleep(0.2)
        return real_step(*args, **kwargs)

    monkeypatch.setattr(loop, "build_run", slow_build_run)
    monkeypatch.setattr(run_lib.Run, "step", slow_step)
    config = _config(
        tmp_path,
        6,
        "generation.slots=2",
        "rollout.inflight_updates=true",
        "rollout.inflight_chunk_steps=1",
    )
    out = loop.train(config, tmp_path / "run")
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(6))
    groups = [r for batch in consumed for r in batch]
    assert all(r.token_versions is not None for r in groups)
    mixed = 0
    for step, batch in enumerate(consumed):
        for r in batch:
            versions = r.token_versions[r.completion_mask]
            # The group's version is its oldest token's, within the bound of its step.
            assert r.policy_version == versions.min() and step - r.policy_version <= 1
            assert versions.max() <= step  # No token from the future.
            rows = np.where(r.completion_mask, r.token_versions, np.iinfo(np.int32).max)
            assert np.all(np.diff(np.minimum.accumulate(rows[:, ::-1], axis=1)[:, ::-1]) >= 0)
            mixed += len(np.unique(versions)) > 1
    assert mixed > 0, "no group spanned a weight update; the test did not exercise it"


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    with LocalRayCluster(num_cpus=3) as cluster:
        cluster.connect(log_to_driver=False)
        yield ray
        ray.shutdown()


@pytest.mark.slow
def test_ray_backend_trains_within_the_bound(tmp_path, ray_cluster, monkeypatch, consumed):
    monkeypatch.setenv("XLA_FLAGS", process_env(1)["XLA_FLAGS"])
    config = _config(
        tmp_path,
        4,
        "rollout.backend=ray",
        "rollout.num_workers=2",
        "generation.max_new_tokens=4",
    )
    run_dir = loop.train(config, tmp_path / "run")
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert all(r["rollout_actor_replacements"] == 0 for r in records)
    ids = [r.group_id for batch in consumed for r in batch]
    assert len(ids) == len(set(ids)) == 8
    for step, batch in enumerate(consumed):
        assert all(0 <= step - r.policy_version <= 1 for r in batch)
        # Real samples from the actors: tokens within the vocabulary, behaviour log-probs
        # of real tokens negative and finite.
        vocab = models.get_config(config.model).vocab_size
        for r in batch:
            logp = r.behaviour_logp[r.completion_mask]
            assert r.completion_mask.any() and np.all(r.completion_tokens < vocab)
            assert np.all(np.isfinite(logp)) and np.all(logp <= 0)


@pytest.mark.slow
def test_ray_actors_run_tool_episodes_with_inflight_updates(
    tmp_path, ray_cluster, monkeypatch, consumed
):
    """The calculator's multi-turn episodes in a Ray actor process (its own environment),
    taking in-flight updates: observations are masked, versions never go back in a row."""
    from gac_jax.train.config import get_preset

    monkeypatch.setenv("XLA_FLAGS", process_env(1)["XLA_FLAGS"])
    config = apply_overrides(
        get_preset("calculator"),
        [
            f"data_dir={tmp_path / 'tfds'}",
            "init=random",
            "steps=3",
            "eval_every=0",
            "checkpoint_every=0",
            "mesh.data=1",
            "generation.group_size=2",
            "generation.max_new_tokens=24",
            "generation.temperature=2.0",
            "rollout.groups_per_batch=4",
            "rollout.mode=async",
            "rollout.backend=ray",
            "rollout.inflight_updates=true",
            "rollout.inflight_chunk_steps=2",
            "buffer.max_staleness=1",
        ],
    )
    run_dir = loop.train(config, tmp_path / "run")
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    groups = [r for batch in consumed for r in batch]
    assert all(r.observation_mask is not None and r.token_versions is not None for r in groups)
    assert sum(int(r.observation_mask.sum()) for r in groups) > 0
    for r in groups:
        assert not (r.observation_mask & r.completion_mask).any()
        for mask, versions in zip(r.completion_mask, r.token_versions, strict=True):
            assert np.all(np.diff(versions[mask]) >= 0)
