"""`with_compute` gives any model the run's dtypes and remat, keeping its weights."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gac_jax import models


def _params(model):
    return jax.tree.leaves(nnx.state(model, nnx.Param))


def test_nothing_to_change_returns_the_model_itself():
    model = models.create_model(models.get_config("tiny"), seed=0)
    assert models.with_compute(model, models.ComputeConfig()) is model
    same = models.ComputeConfig(dtype=model.config.dtype, remat=model.config.remat)
    assert models.with_compute(model, same) is model


def test_casts_the_weights_and_keeps_their_shardings_and_values():
    mesh = models.make_mesh(1, 4, 1)
    model = models.create_sharded(
        lambda: models.create_model(models.get_config("tiny", dtype="float32"), seed=0), mesh
    )
    new = models.with_compute(model, models.ComputeConfig(param_dtype="bfloat16", remat="full"))
    assert (new.config.param_dtype, new.config.remat, new.config.dtype) == (
        "bfloat16",
        "full",
        "float32",
    )
    for old, cast in zip(_params(model), _params(new), strict=True):
        assert cast.dtype == jnp.bfloat16 and cast.sharding == old.sharding
        np.testing.assert_array_equal(np.asarray(cast), np.asarray(old.astype(jnp.bfloat16)))
    tokens = jnp.arange(12, dtype=jnp.int32).reshape(2, 6) % model.config.vocab_size
    # The same function up to the weights' bf16 rounding; remat changes no value.
    np.testing.assert_allclose(new(tokens)[0], model(tokens)[0], atol=0.02)


def test_bad_values_name_the_field():
    with pytest.raises(ValueError, match=r"remat='some' is not one of"):
        models.ComputeConfig(remat="some").validate()
    with pytest.raises(ValueError, match=r"param_dtype='float64'"):
        models.ComputeConfig(param_dtype="float64").validate()


def test_a_remat_model_samples_like_the_plain_one():
    # Remat applies to the training forward only: decoding with a cache has no backward.
    model = models.create_model(models.get_config("tiny"), seed=0)
    remat = models.with_compute(model, models.ComputeConfig(remat="full"))
    sampler = models.Sampler(model.config, max_new_tokens=4, eos_ids=2, pad_id=0)
    prompts = jnp.full((2, 3), 5, jnp.int32)
    mask = jnp.ones((2, 3), bool)
    key = jax.random.key(0)
    plain = sampler.generate(model, prompts, mask, key, temperature=0.0)
    rematted = sampler.generate(remat, prompts, mask, key, temperature=0.0)
    np.testing.assert_array_equal(rematted.tokens, plain.tokens)
