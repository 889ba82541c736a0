"""Sharding on 8 fake CPU devices: parameter NamedShardings and sharded == unsharded."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gac_jax.models import (
    Decoder,
    Sampler,
    ShardingRules,
    create_model,
    create_sharded,
    describe_shardings,
    get_config,
    left_pad,
    load_hf_checkpoint,
    make_mesh,
    save_hf_checkpoint,
    shard_model,
)
from gac_jax.models.sharding import fit_spec

EXPECTED_SPECS = {
    "embedding_vd": P("tensor", "fsdp"),
    "lm_head_dv": P("fsdp", "tensor"),
    "final_norm.scale": P(),
    # The layers' stacked axis first, never sharded.
    "layers.attn_norm.scale": P(),
    "layers.attn.q_dnh": P(None, "fsdp", "tensor"),
    "layers.attn.k_dkh": P(None, "fsdp", "tensor"),
    "layers.attn.v_dkh": P(None, "fsdp", "tensor"),
    "layers.attn.o_nhd": P(None, "tensor", None, "fsdp"),
    "layers.mlp.gate_df": P(None, "fsdp", "tensor"),
    "layers.mlp.up_df": P(None, "fsdp", "tensor"),
    "layers.mlp.down_fd": P(None, "tensor", "fsdp"),
}


@pytest.fixture(scope="module")
def mesh():
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (tests/conftest.py fakes them on the CPU)")
    return make_mesh(data=2, fsdp=2, tensor=2)


@pytest.fixture(scope="module")
def config():
    return get_config("tiny_llama")


@pytest.fixture(scope="module")
def reference(config):
    return create_model(config, seed=7)


@pytest.fixture(scope="module")
def tokens():
    return jnp.asarray(np.random.RandomState(0).randint(0, 128, size=(4, 12)))


@jax.jit
def _logits(graphdef, state, tokens):
    return nnx.merge(graphdef, state)(tokens)[0]


def _check_specs(model):
    specs = describe_shardings(model)
    for name, spec in EXPECTED_SPECS.items():
        assert spec == specs[name], name
    for name, value in nnx.to_flat_state(nnx.state(model)):
        sharding = value.get_value().sharding
        assert isinstance(sharding, NamedSharding) and sharding.mesh.shape == {
            "data": 2,
            "fsdp": 2,
            "tensor": 2,
        }, name


def test_sharded_forward_equals_single_device(mesh, config, reference, tokens):
    want = _logits(*nnx.split(reference), tokens)
    sharded = create_model(config, seed=7)
    shard_model(sharded, mesh)
    _check_specs(sharded)
    # A weight really is split: each device holds a quarter of q (fsdp x tensor).
    q = sharded.layers.attn.q_dnh[...]
    assert q.addressable_shards[0].data.shape == (config.num_layers, 32, 2, 16)

    with jax.set_mesh(mesh):
        got = _logits(*nnx.split(sharded), tokens)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # The logits constraint held: batch over (data, fsdp), vocabulary over tensor.
    assert got.sharding.spec == P(("data", "fsdp"), None, "tensor")


def test_create_sharded_and_load_place_parameters_directly(
    mesh, config, reference, tokens, tmp_path
):
    model = create_sharded(lambda: Decoder(config, rngs=nnx.Rngs(params=7)), mesh)
    _check_specs(model)
    for a, b in zip(
        jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(reference)), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)

    save_hf_checkpoint(reference, tmp_path)
    loaded = load_hf_checkpoint(tmp_path, mesh=mesh, dtype="float32")
    _check_specs(loaded)
    for a, b in zip(
        jax.tree.leaves(nnx.state(loaded)), jax.tree.leaves(nnx.state(reference)), strict=True
    ):
        np.testing.assert_array_equal(a, b)


def test_sharded_sampler_matches_single_device(mesh, config, reference):
    prompts, mask = left_pad([[5, 6, 7, 8], [9, 10], [11], [12, 13, 14]], pad_id=0)
    sampler = Sampler(config, max_new_tokens=5, eos_ids=2, pad_id=0)
    want = sampler.generate(reference, prompts, mask, jax.random.key(0), temperature=0.0)
    sharded = shard_model(create_model(config, seed=7), mesh)
    with jax.set_mesh(mesh):
        got = sampler.generate(sharded, prompts, mask, jax.random.key(0), temperature=0.0)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_allclose(got.policy_logps, want.policy_logps, atol=1e-5)


def test_fit_spec_drops_axes_that_do_not_fit(mesh):
    # 3 rows cannot split over data x fsdp = 4; 6 rows split over data only.
    assert fit_spec(P(("data", "fsdp")), (3, 8), mesh) == P()
    assert fit_spec(P(("data", "fsdp")), (6, 8), mesh) == P("data")
    assert fit_spec(P("tensor", "tensor"), (4, 4), mesh) == P("tensor")
    assert fit_spec(P("pipeline"), (4,), mesh) == P()


def test_rules_and_mesh_errors():
    rules = ShardingRules(embed=None, mlp=("fsdp", "tensor"))
    assert rules.spec("embed", "mlp") == P(None, ("fsdp", "tensor"))
    assert rules.act_btd == P(("data", "fsdp"), None, None)
    with pytest.raises(ValueError, match="'hidden'"):
        rules.spec("hidden")
    with pytest.raises(ValueError, match="needs 64 devices"):
        make_mesh(data=4, fsdp=4, tensor=4)
    with pytest.raises(ValueError, match="tensor=0"):
        make_mesh(tensor=0)


def test_explicit_meshes_are_rejected_with_a_clear_error(config, tokens):
    if jax.device_count() < 2:
        pytest.skip("needs 2 devices")
    explicit = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    model = create_model(config, seed=7)
    with jax.set_mesh(explicit), pytest.raises(ValueError, match="AxisType.Auto"):
        model(tokens)
