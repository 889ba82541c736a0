"""Split devices on one host (`placement.devices=N`): the sampler on its own N devices, the
learner on the rest, asynchronous training between them."""

import jax
import numpy as np
import pytest

from gac_jax.learner import TrainBatch
from gac_jax.rollout import GenerationConfig, PlacementConfig, RolloutConfig
from gac_jax.rollout.placement import RolloutPlacement, rollout_mesh, split_devices
from gac_jax.train import loop
from gac_jax.train import run as run_lib
from gac_jax.train.checkpoint import restore_checkpoint
from gac_jax.train.config import TrainConfig
from gac_jax.train.config_io import apply_overrides
from gac_jax.train.metrics import read_metrics


def _devices_of(tree) -> set:
    return {d for x in jax.tree.leaves(tree) for d in x.sharding.device_set}


def test_split_devices_takes_the_last_local_devices():
    devices = jax.devices()
    learner, rollout = split_devices(2)
    assert rollout == devices[-2:] and learner == devices[:-2]
    assert split_devices(0) == (devices, [])
    with pytest.raises(ValueError, match="placement.devices=8 must leave the learner"):
        split_devices(8)
    with pytest.raises(ValueError, match="tensor_parallel=3 must divide the 2 rollout devices"):
        rollout_mesh(devices[-2:], tensor_parallel=3)


def test_publishing_reshards_onto_the_rollout_mesh_and_back():
    from gac_jax import models

    learner_devices, rollout_devices = split_devices(2)
    mesh = models.make_mesh(1, len(learner_devices), 1, devices=learner_devices)
    model = models.create_sharded(
        lambda: models.create_model(models.get_config("tiny"), seed=0), mesh
    )
    params = nnx_params(model)
    placement = RolloutPlacement(mesh, rollout_mesh(rollout_devices, tensor_parallel=2))
    published = placement.to_rollout(params)
    assert _devices_of(published) == set(rollout_devices)
    # Tensor-parallel over the 2 rollout devices: some leaves are split in two, each
    # device holding half; the others are replicated on both.
    halves = [x.addressable_shards[0].data.size * 2 == x.size for x in jax.tree.leaves(published)]
    assert any(halves)
    back = placement.to_learner(published, params)
    assert _devices_of(back) == set(learner_devices)
    for a, b, c in zip(*(jax.tree.leaves(t) for t in (params, published, back)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
        assert a.sharding == c.sharding


def nnx_params(model):
    from flax import nnx

    return nnx.state(model, nnx.Param)


@pytest.mark.slow
def test_async_training_on_split_devices(tmp_path, digit_task, monkeypatch):
    config = TrainConfig(
        task="arithmetic/add2",
        data_dir=str(tmp_path / "tfds"),
        init="random",
        steps=4,
        eval_every=4,
        eval_size=2,
        eval_samples=2,
        checkpoint_every=4,
        rollout=RolloutConfig(mode="async", groups_per_batch=3),
        placement=PlacementConfig(devices=2),
        generation=GenerationConfig(group_size=2, prompt_length=12, max_new_tokens=5),
    )
    config = apply_overrides(config, ["buffer.max_staleness=1"])
    learner_devices, rollout_devices = split_devices(2)
    seen = {"sampler": set(), "store": set(), "learner": set()}
    consumed = []
    real_build_run, real_collate = loop.build_run, run_lib.collate

    def spying_build_run(c):
        run = real_build_run(c)
        sampler = run.generator.sampler

        class SpyingSampler:
            def __getattr__(self, name):
                return getattr(sampler, name)

            def __call__(self, *args, **kwargs):
                out = sampler(*args, **kwargs)
                seen["sampler"] |= _devices_of(out)
                seen["store"] |= _devices_of(run.store.latest()[0])
                seen["learner"] |= _devices_of((run.learner.params, run.learner.opt_state))
                return out

        run.generator.sampler = SpyingSampler()
        return run

    def recording_collate(rollouts, prompt_length, *overlong):
        consumed.append(list(rollouts))
        return real_collate(rollouts, prompt_length, *overlong)

    monkeypatch.setattr(loop, "build_run", spying_build_run)
    monkeypatch.setattr(run_lib, "collate", recording_collate)
    out = loop.train(config, tmp_path / "run")

    assert seen["sampler"] == set(rollout_devices) == seen["store"]
    assert seen["learner"] == set(learner_devices)
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert all(r["version_gap_max"] <= 1 for r in records)
    assert any(k.startswith("eval/") for k in records[-1])  # Evaluated on the rollout mesh.

    # A reference learner (same init, same 6 devices) fed the same rollouts ends with the
    # same params, bit for bit.
    reference = real_build_run(config)
    for step, rollouts in enumerate(consumed):
        batch = TrainBatch(**real_collate(rollouts, config.generation.prompt_length))
        reference.learner.step(batch, step)
    trained = restore_checkpoint(out / "checkpoints").state["params"]
    leaves = zip(jax.tree.leaves(trained), jax.tree.leaves(reference.learner.params), strict=True)
    for a, b in leaves:
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
