"""per_token_logps: the shift/mask convention against a NumPy float64 reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gac_jax.models import (
    create_model,
    get_config,
    per_token_logps,
    positions_from_mask,
    token_logps_from_logits,
)


@pytest.fixture(scope="module")
def model():
    return create_model(get_config("tiny"), seed=1)


@jax.jit
def _score_and_logits(graphdef, state, tokens, mask):
    model = nnx.merge(graphdef, state)
    logits, _ = model(tokens, positions_from_mask(mask), mask)
    return per_token_logps(model, tokens, mask), logits


def _reference(logits, tokens, mask, temperature=1.0):
    logits = np.asarray(logits, np.float64) / temperature
    logz = np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1)) + logits.max(-1)
    out = np.zeros(tokens.shape)
    for b in range(tokens.shape[0]):
        for t in range(1, tokens.shape[1]):
            if mask[b, t] and mask[b, t - 1]:
                out[b, t] = logits[b, t - 1, tokens[b, t]] - logz[b, t - 1]
    return out


def test_matches_numpy_reference_with_left_padding(model):
    rng = np.random.RandomState(0)
    tokens = rng.randint(0, 128, size=(3, 10))
    mask = np.ones((3, 10), bool)
    mask[1, :4] = False  # Left padding.
    mask[2, 7:] = False  # Trailing padding after a finished completion.
    got, logits = _score_and_logits(*nnx.split(model), jnp.asarray(tokens), jnp.asarray(mask))
    want = _reference(logits, tokens, mask)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    got = np.asarray(got)
    assert (got[:, 0] == 0).all()
    assert (got[1, :5] == 0).all()  # Pads, and the first real token (no real context).
    assert (got[2, 7:] == 0).all()
    valid = mask[:, 1:] & mask[:, :-1]
    assert (got[:, 1:][valid] < 0).all()


def test_padding_content_is_ignored(model):
    rng = np.random.RandomState(1)
    tokens = rng.randint(0, 128, size=(3, 10))  # The shape above: no recompilation.
    mask = np.ones((3, 10), bool)
    mask[:, :3] = False
    other = tokens.copy()
    other[:, :3] = rng.randint(0, 128, size=(3, 3))
    a, _ = _score_and_logits(*nnx.split(model), jnp.asarray(tokens), jnp.asarray(mask))
    b, _ = _score_and_logits(*nnx.split(model), jnp.asarray(other), jnp.asarray(mask))
    np.testing.assert_allclose(a, b, atol=1e-6)


def test_temperature_and_shape_errors():
    rng = np.random.RandomState(2)
    logits = rng.randn(2, 5, 7).astype(np.float32)
    tokens = rng.randint(0, 7, size=(2, 5))
    mask = np.ones((2, 5), bool)
    got = jax.jit(token_logps_from_logits)(logits, tokens, mask, 0.5)
    np.testing.assert_allclose(got, _reference(logits, tokens, mask, 0.5), atol=1e-5)
    with pytest.raises(ValueError, match="mask shape"):
        token_logps_from_logits(logits, tokens, mask[:, :3])
    with pytest.raises(ValueError, match="logits shape"):
        token_logps_from_logits(logits[:, :4], tokens, mask)


def test_gradients_are_finite_and_ignore_masked_tokens(model):
    graphdef, state = nnx.split(model)
    tokens = jnp.asarray(np.random.RandomState(3).randint(0, 128, size=(2, 6)))
    mask = jnp.asarray([[True] * 6, [False, False, True, True, True, True]])

    @jax.jit
    def grad(state, tokens):
        return jax.grad(lambda s: per_token_logps(nnx.merge(graphdef, s), tokens, mask).sum())(
            state
        )

    g = grad(state, tokens)
    leaves = jax.tree.leaves(g)
    assert all(np.isfinite(np.asarray(x)).all() for x in leaves)
    assert any(np.abs(np.asarray(x)).max() > 0 for x in leaves)
    changed = tokens.at[1, 0].set((tokens[1, 0] + 1) % 128)  # A padding token.
    for a, b in zip(leaves, jax.tree.leaves(grad(state, changed)), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
