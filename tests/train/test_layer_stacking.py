"""Checkpoints saved per layer, before the decoder's layers became a scan, restore stacked."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from gac_jax.models import create_sharded, get_config, make_mesh
from gac_jax.models.decoder import Decoder, saved_per_layer, stack_layers, unstack_layers
from gac_jax.train.checkpoint import abstract_tree, restore_checkpoint, save_checkpoint


def _run_state(seed: int):
    """A run's params and Adam state, on a mesh, Adam's moments made non-zero."""
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    config = get_config("tiny").replace(num_layers=3)
    model = create_sharded(lambda: Decoder(config, rngs=nnx.Rngs(params=seed)), mesh)
    params = nnx.state(model, nnx.Param)
    tx = optax.adam(1e-3)
    grads = jax.tree.map(lambda x: jnp.sin(x * 7.0), params)
    _, opt_state = tx.update(grads, tx.init(params), params)
    return {"params": params, "opt_state": opt_state}


def test_a_per_layer_run_checkpoint_restores_stacked_onto_the_templates_shardings(tmp_path):
    state = _run_state(seed=1)
    per_layer = unstack_layers(state)
    assert saved_per_layer(per_layer) and not saved_per_layer(state)
    q = np.asarray(state["params"]["layers"]["attn"]["q_dnh"][...])
    assert np.array_equal(per_layer["params"]["layers"][2]["attn"]["q_dnh"], q[2])
    save_checkpoint(tmp_path, 4, per_layer)

    template = abstract_tree(_run_state(seed=2))  # Other values, the same layout.
    restored = restore_checkpoint(tmp_path, target=template).state
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for got, want, like in zip(
        jax.tree.leaves(restored), jax.tree.leaves(state), jax.tree.leaves(template), strict=True
    ):
        assert got.sharding == like.sharding
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_stacking_undoes_unstacking_and_leaves_other_trees_alone():
    tree = {"layers": {"w": np.arange(12.0).reshape(3, 4)}, "head": np.ones(2)}
    split = unstack_layers(tree)
    assert sorted(split["layers"]) == [0, 1, 2] and np.array_equal(
        split["layers"][1]["w"], tree["layers"]["w"][1]
    )
    joined = stack_layers({**split, "layers": {str(k): v for k, v in split["layers"].items()}})
    np.testing.assert_array_equal(joined["layers"]["w"], tree["layers"]["w"])
    assert stack_layers(tree)["layers"]["w"] is tree["layers"]["w"]
    assert not saved_per_layer({"w": 1.0}) and not saved_per_layer(tree)
