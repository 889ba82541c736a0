"""Orbax checkpoint helpers: round trips, keep-last-N, interrupted saves, shardings."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from gac_jax.models import create_model, get_config, make_mesh, shard_model
from gac_jax.train.checkpoint import (
    CheckpointManager,
    latest_step,
    load_model_params,
    model_params,
    read_metadata,
    restore_checkpoint,
    restore_model,
    save_checkpoint,
)


def _tree(seed: int):
    rng = np.random.default_rng(seed)
    return {
        "dense": {
            "w": jnp.asarray(rng.normal(size=(8, 4)), jnp.float32),
            "b": jnp.asarray(rng.normal(size=(4,)), jnp.bfloat16),
        },
        "count": jnp.asarray(rng.integers(0, 100, size=()), jnp.int32),
        "table": jnp.asarray(rng.integers(-5, 5, size=(3, 2)), jnp.int32),
    }


def _assert_trees_equal(actual, expected):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        assert a.dtype == e.dtype and a.shape == e.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


def test_round_trip_is_exact_with_and_without_target(tmp_path):
    tree = _tree(0)
    metadata = {"step": 7, "config": {"name": "x", "lr": 1e-3}, "tags": [1, 2.5, None]}
    step_dir = save_checkpoint(tmp_path / "ckpt", 7, tree, metadata)
    assert step_dir == (tmp_path / "ckpt" / "7").resolve() and step_dir.is_dir()

    restored = restore_checkpoint(tmp_path / "ckpt")
    assert restored.step == 7
    assert restored.metadata == metadata
    _assert_trees_equal(restored.state, tree)

    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
    _assert_trees_equal(restore_checkpoint(tmp_path / "ckpt", 7, target=target).state, tree)
    assert read_metadata(tmp_path / "ckpt") == metadata
    assert latest_step(tmp_path / "ckpt") == 7
    assert latest_step(tmp_path / "missing") is None


def test_keeps_the_last_n_and_restores_the_latest(tmp_path):
    with CheckpointManager(tmp_path, max_to_keep=2) as checkpoints:
        for step in range(5):
            checkpoints.save(step * 10, _tree(step), {"step": step * 10})
        assert checkpoints.steps() == (30, 40)
        assert checkpoints.latest_step() == 40
        latest = checkpoints.restore()
        assert latest.step == 40 and latest.metadata == {"step": 40}
        _assert_trees_equal(latest.state, _tree(4))
        _assert_trees_equal(checkpoints.restore(30).state, _tree(3))
        with pytest.raises(FileNotFoundError, match="step 0"):
            checkpoints.restore(0)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["30", "40"]


def test_async_save_is_restorable_after_wait(tmp_path):
    with CheckpointManager(tmp_path, async_save=True) as checkpoints:
        checkpoints.save(1, _tree(1), {"a": 1})
        checkpoints.wait_until_finished()
        assert checkpoints.latest_step() == 1
        _assert_trees_equal(checkpoints.restore().state, _tree(1))


def test_an_unfinished_step_directory_is_never_restored(tmp_path):
    with CheckpointManager(tmp_path) as checkpoints:
        checkpoints.save(4, _tree(4), {"step": 4})
    # What a save of step 9 leaves when the process dies before orbax's final rename:
    # the complete contents, under the temporary name.
    unfinished = tmp_path / "9.orbax-checkpoint-tmp-1732230000000000"
    shutil.copytree(tmp_path / "4", unfinished)
    (unfinished / "metadata" / "metadata").write_text(json.dumps({"step": 9}))

    assert latest_step(tmp_path) == 4
    restored = restore_checkpoint(tmp_path)
    assert restored.step == 4 and restored.metadata == {"step": 4}
    _assert_trees_equal(restored.state, _tree(4))
    assert unfinished.exists(), "a read-only reader must not touch the directory"

    with CheckpointManager(tmp_path) as checkpoints:  # A writer clears the leftover.
        assert checkpoints.steps() == (4,)
        checkpoints.save(9, _tree(9), {"step": 9})
        assert checkpoints.restore().metadata == {"step": 9}
    assert not unfinished.exists()


def test_a_save_that_fails_midway_leaves_the_previous_latest(tmp_path, monkeypatch):
    import orbax.checkpoint as ocp

    with CheckpointManager(tmp_path) as checkpoints:
        checkpoints.save(1, _tree(1), {"step": 1})

    def crash(*args, **kwargs):
        raise OSError("disk full")

    # The JSON item is written after the arrays began: fail there, as a crash would.
    monkeypatch.setattr(ocp.JsonCheckpointHandler, "async_save", crash)
    monkeypatch.setattr(ocp.JsonCheckpointHandler, "save", crash)
    checkpoints = CheckpointManager(tmp_path)
    with pytest.raises(OSError, match="disk full"):
        checkpoints.save(2, _tree(2), {"step": 2})
    monkeypatch.undo()
    checkpoints.close()

    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith("2")]
    assert leftovers and all(".orbax-checkpoint-tmp" in name for name in leftovers)
    assert latest_step(tmp_path) == 1
    assert restore_checkpoint(tmp_path).metadata == {"step": 1}


def test_rejects_bad_metadata_and_repeated_steps(tmp_path):
    with CheckpointManager(tmp_path) as checkpoints:
        with pytest.raises(ValueError, match=r"metadata\['loss'\]"):
            checkpoints.save(0, _tree(0), {"loss": np.float32(1.0)})
        checkpoints.save(0, _tree(0))
        assert checkpoints.read_metadata() == {}
        with pytest.raises(ValueError, match="already saved"):
            checkpoints.save(0, _tree(0))
    with pytest.raises(FileNotFoundError):
        restore_checkpoint(tmp_path / "empty_but_absent")


def test_restore_onto_shardings_of_a_mesh(tmp_path):
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    tree = {"w": jnp.arange(64.0, dtype=jnp.float32).reshape(8, 8), "b": jnp.arange(8.0)}
    saved = jax.device_put(tree, NamedSharding(mesh, PartitionSpec("fsdp")))
    save_checkpoint(tmp_path, 0, saved)

    wanted = {
        "w": NamedSharding(mesh, PartitionSpec(("data", "fsdp"), "tensor")),
        "b": NamedSharding(mesh, PartitionSpec()),
    }
    restored = restore_checkpoint(tmp_path, shardings=wanted).state
    for name in tree:
        assert restored[name].sharding == wanted[name]
        np.testing.assert_array_equal(np.asarray(restored[name]), np.asarray(tree[name]))

    # Without a target or shardings, everything lands on one device, whatever it was saved
    # on.
    plain = restore_checkpoint(tmp_path).state
    assert all(len(x.sharding.device_set) == 1 for x in jax.tree.leaves(plain))


def test_restore_model_fills_a_sharded_model(tmp_path):
    config = get_config("tiny")
    source = create_model(config, seed=1)
    save_checkpoint(tmp_path, 3, model_params(source), {"model": "tiny"})

    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    target = shard_model(create_model(config, seed=2), mesh)
    shardings_before = jax.tree.map(lambda x: x.sharding, model_params(target))
    restored = restore_model(tmp_path, target)
    assert restored.step == 3 and restored.metadata == {"model": "tiny"}
    _assert_trees_equal(model_params(target), model_params(source))
    assert jax.tree.map(lambda x: x.sharding, model_params(target)) == shardings_before
    assert any(len(x.sharding.device_set) > 1 for x in jax.tree.leaves(model_params(target)))


def test_restore_model_from_a_larger_state(tmp_path):
    config = get_config("tiny")
    source = create_model(config, seed=1)
    state = {"params": model_params(source), "opt": {"count": jnp.asarray(5, jnp.int32)}}
    save_checkpoint(tmp_path, 0, state)
    fresh = create_model(config, seed=2)
    restore_model(tmp_path, fresh, params_key="params")
    _assert_trees_equal(model_params(fresh), model_params(source))

    other = load_model_params(create_model(config, seed=3), model_params(source))
    _assert_trees_equal(model_params(other), model_params(source))
