"""Chunked log-probs and entropies: values and gradients against a float64 reference and the
dense [B, T, V] path, the learner's step against the dense step, and memory that does not
grow with T the way the dense path's does."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from gac_jax import models
from gac_jax.learner import (
    LearnerConfig,
    LossConfig,
    TrainBatch,
    make_train_step,
    per_example_grad_sq_norms,
)
from gac_jax.learner import update as update_module
from gac_jax.models import chunked_token_logps_and_entropy, token_logps_from_logits
from gac_jax.rollout import Rollout, collate


def _assert_close(got, want, rtol=1e-6, err_msg=""):
    """Max error at most `rtol` times the largest reference entry, or than 1 if that is
    smaller. Float32 against float64: entries near zero carry the rounding of the large ones
    they are computed from (a peaked softmax's entropy of 0.01 is a difference of logits
    of 10, each rounded to 1e-6)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, err_msg
    scale = max(np.max(np.abs(want)), 1.0)
    error = np.max(np.abs(got - want)) / scale
    assert error <= rtol, f"{err_msg}: relative error {error:.3g} > {rtol}"


def _numpy_reference(hidden, weights, tokens, mask, layout, temperature):
    """float64 log-probs and entropies [B, T], written out position by position."""
    h, w = np.asarray(hidden, np.float64), np.asarray(weights, np.float64)
    z = h @ (w if layout == "dv" else w.T) / temperature
    b, t = tokens.shape
    logp, entropy = np.zeros((b, t)), np.zeros((b, t))
    for i in range(b):
        for j in range(1, t):
            s = z[i, j - 1]
            log_probs = s - (s.max() + np.log(np.sum(np.exp(s - s.max()))))
            entropy[i, j] = -np.sum(np.exp(log_probs) * log_probs)
            if mask[i, j] and mask[i, j - 1]:
                logp[i, j] = log_probs[tokens[i, j]]
    return logp, entropy


def _dense(hidden, weights, tokens, mask, layout, temperature):
    """The [B, T, V] path: logits, then `token_logps_from_logits` and a full log-softmax."""
    logits = hidden @ (weights if layout == "dv" else weights.T)
    return _dense_from_logits(logits, tokens, mask, temperature)


def _dense_from_logits(logits, tokens, mask, temperature):
    logp = token_logps_from_logits(logits, tokens, mask, temperature)
    log_probs = jax.nn.log_softmax(logits[:, :-1] / temperature, axis=-1)
    entropy = -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)
    return logp, jnp.concatenate([jnp.zeros_like(entropy[:, :1]), entropy], axis=1)


def _chunked(chunk_size):
    def fn(hidden, weights, tokens, mask, layout, temperature):
        return chunked_token_logps_and_entropy(
            hidden,
            weights,
            tokens,
            mask,
            chunk_size=chunk_size,
            head_layout=layout,
            temperature=temperature,
        )

    return fn


def _value_and_grads(fn, layout, hidden, weights, tokens, mask, temperature, a, e):
    """Outputs, and the gradients of `sum(a * logp + e * entropy)` in hidden, weights and
    temperature."""

    def objective(h, w, tau):
        logp, entropy = fn(h, w, tokens, mask, layout, tau)
        return jnp.sum(a * logp) + jnp.sum(e * entropy)

    outputs = jax.jit(lambda h, w, tau: fn(h, w, tokens, mask, layout, tau))
    grads = jax.jit(jax.grad(objective, argnums=(0, 1, 2)))
    return outputs(hidden, weights, temperature), grads(hidden, weights, temperature)


def _problem(seed, b, t, d, v, layout):
    rng = np.random.default_rng(seed)
    hidden = rng.standard_normal((b, t, d)).astype(np.float32)
    shape = (d, v) if layout == "dv" else (v, d)
    weights = (rng.standard_normal(shape) / np.sqrt(d) * 2.0).astype(np.float32)
    tokens = rng.integers(0, v, (b, t)).astype(np.int32)
    mask = rng.random((b, t)) > 0.2
    mask[0, : t // 3] = False  # Left padding.
    if b > 2:
        mask[2] = False  # A row with no real token.
    a = rng.standard_normal((b, t)).astype(np.float32)
    e = rng.standard_normal((b, t)).astype(np.float32)
    return hidden, weights, tokens, mask, a, e


CASES = [  # (B, T, D, V, chunk_size, layout, temperature)
    (3, 11, 8, 37, 4, "dv", 1.0),  # T - 1 = 10 positions: chunks of 4, padded by 2.
    (2, 9, 16, 50, 3, "vd", 0.7),  # 8 positions: chunks of 3, padded by 1.
    (3, 7, 8, 29, 64, "dv", 1.3),  # One chunk larger than the sequence.
    (4, 16, 8, 64, 5, "vd", 1.0),  # 15 positions in three chunks, no padding.
    (1, 2, 4, 11, 1, "vd", 0.5),  # A single predicted position.
]


@pytest.mark.parametrize(("b", "t", "d", "v", "chunk", "layout", "tau"), CASES)
def test_values_and_gradients_match_float64_and_the_dense_path(b, t, d, v, chunk, layout, tau):
    hidden, weights, tokens, mask, a, e = _problem(b * t + v, b, t, d, v, layout)
    args = (layout, hidden, weights, tokens, mask, tau, a, e)
    (logp, entropy), grads = _value_and_grads(_chunked(chunk), *args)

    want_logp, want_entropy = _numpy_reference(hidden, weights, tokens, mask, layout, tau)
    _assert_close(logp, want_logp, err_msg="logp vs float64")
    _assert_close(entropy, want_entropy, err_msg="entropy vs float64")
    assert np.all(np.asarray(logp)[~(mask & np.roll(mask, 1, axis=1))] == 0.0)
    assert np.all(np.asarray(logp)[:, 0] == 0.0) and np.all(np.asarray(entropy)[:, 0] == 0.0)

    with jax.enable_x64(True):  # Autodiff of the dense formula, in float64.
        f64 = [np.asarray(x, np.float64) for x in (hidden, weights, a, e)]
        _, want_grads = _value_and_grads(
            _dense, layout, f64[0], f64[1], tokens, mask, np.float64(tau), f64[2], f64[3]
        )
        want_grads = jax.device_get(want_grads)
    (dense_logp, dense_entropy), dense_grads = _value_and_grads(_dense, *args)
    for name, got, want, dense in zip(
        ("hidden", "weights", "temperature"), grads, want_grads, dense_grads, strict=True
    ):
        assert got.dtype == jnp.float32, name
        _assert_close(got, want, err_msg=f"d/d{name} vs float64")
        # Two float32 results, each within 1e-6 of float64: within 2e-6 of each other.
        _assert_close(got, dense, rtol=2e-6, err_msg=f"d/d{name} vs dense float32")
    _assert_close(logp, dense_logp, err_msg="logp vs dense")
    _assert_close(entropy, dense_entropy, err_msg="entropy vs dense")


def test_every_chunk_size_gives_the_one_chunk_result():
    hidden, weights, tokens, mask, a, e = _problem(7, 3, 13, 8, 40, "dv")
    args = ("dv", hidden, weights, tokens, mask, 1.0, a, e)
    (logp, entropy), grads = _value_and_grads(_chunked(12), *args)  # 12 positions: one.
    for chunk in (1, 5, 7):  # 7: two chunks, the second padded by 2.
        (logp_c, entropy_c), grads_c = _value_and_grads(_chunked(chunk), *args)
        _assert_close(logp_c, logp, err_msg=f"logp, chunk {chunk}")
        _assert_close(entropy_c, entropy, err_msg=f"entropy, chunk {chunk}")
        for got, want in zip(grads_c, grads, strict=True):
            _assert_close(got, want, err_msg=f"gradient, chunk {chunk}")


def _dense_token_logps_and_entropy(model, tokens_bt, mask_bt, *, chunk_size, temperature=1.0):
    """The dense path through the whole model (`model(...)`'s [B, T, V] logits)."""
    del chunk_size
    logits, _ = model(tokens_bt, None, mask_bt)
    return _dense_from_logits(logits, tokens_bt, mask_bt, temperature)


@pytest.mark.parametrize("tied", [True, False])
def test_model_scoring_matches_the_dense_logits(tied):
    config = models.get_config("tiny", num_layers=1, tie_word_embeddings=tied)
    graphdef, params = nnx.split(models.create_model(config, seed=3))
    hidden, _, tokens, mask, a, e = _problem(11, 3, 10, 8, config.vocab_size, "dv")
    del hidden

    def objective(fn, p):
        logp, entropy = fn(nnx.merge(graphdef, p), tokens, mask, chunk_size=4)
        return jnp.sum(a * logp) + jnp.sum(e * entropy), (logp, entropy)

    got = jax.jit(jax.grad(lambda p: objective(models.token_logps_and_entropy, p), has_aux=True))
    want = jax.jit(jax.grad(lambda p: objective(_dense_token_logps_and_entropy, p), has_aux=True))
    (grads, values), (want_grads, want_values) = got(params), want(params)
    for x, y in zip(values, want_values, strict=True):
        _assert_close(x, y)
    names = [str(path) for path, _ in jax.tree_util.tree_flatten_with_path(grads)[0]]
    assert any("lm_head" in n for n in names) != tied
    for name, x, y in zip(names, jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        _assert_close(x, y, err_msg=name)
    logp = jax.jit(lambda p: models.per_token_logps(nnx.merge(graphdef, p), tokens, mask))(params)
    _assert_close(logp, want_values[0])


def _batch(seed=0, groups=4, group_size=2, length=6):
    """Rows of different lengths, a row without a valid token (as in test_micro_batches)."""
    rng = np.random.default_rng(seed)
    rollouts = []
    for i in range(groups):
        mask = np.ones((group_size, length), bool)
        mask[0, rng.integers(1, length) :] = False
        if i == 2:
            mask[1, :] = False
        rollouts.append(
            Rollout(
                prompt_id=i,
                group_id=i,
                prompt_tokens=rng.integers(3, 60, 3 + i % 2).astype(np.int32),
                completion_tokens=rng.integers(3, 60, (group_size, length)).astype(np.int32),
                completion_mask=mask,
                behaviour_logp=(-2.5 - 3.0 * rng.random((group_size, length))).astype(np.float32),
                rewards=rng.random(group_size).astype(np.float32),
                policy_version=0,
            )
        )
    return jax.tree.map(jnp.asarray, TrainBatch(**collate(rollouts, 5)))


@pytest.mark.parametrize(
    ("loss", "micro_batches"),
    [(LossConfig(), 1), (LossConfig(advantage="vcpo", grad_norm="exact"), 2)],
)
def test_learner_step_equals_the_dense_step(loss, micro_batches, monkeypatch):
    config = models.get_config("tiny", num_layers=1)
    graphdef, params = nnx.split(models.create_model(config, seed=1))
    batch = _batch()
    tx = optax.sgd(0.5)  # The parameter change is the gradient.

    def run(chunk):
        step = make_train_step(
            graphdef, tx, loss, micro_batches=micro_batches, logits_chunk_size=chunk
        )
        return jax.device_get(jax.jit(step)(params, tx.init(params), batch, jnp.int32(1)))

    chunked = run(3)  # T = 11: ten positions in four chunks of 3, padded by 2.
    monkeypatch.setattr(update_module, "token_logps_and_entropy", _dense_token_logps_and_entropy)
    dense = run(3)
    assert chunked[2].keys() == dense[2].keys()
    for key in dense[2]:
        np.testing.assert_allclose(
            chunked[2][key], dense[2][key], rtol=1e-5, atol=1e-6, err_msg=key
        )
    for a, b in zip(jax.tree.leaves(chunked[0]), jax.tree.leaves(dense[0]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_per_example_norms_in_chunks_of_sequences_equal_the_whole_batch():
    graphdef, params = nnx.split(models.create_model(models.get_config("tiny", num_layers=1)))
    batch = _batch(seed=1, groups=3)  # Six sequences.
    norms = jax.jit(
        per_example_grad_sq_norms,
        static_argnums=0,
        static_argnames=("sequences_per_chunk", "logits_chunk_size"),
    )
    whole = norms(graphdef, params, batch)
    assert whole.shape == (6,) and np.all(np.asarray(whole)[np.any(batch.loss_mask, 1)] > 0)
    # Chunks of 4 sequences leave a remainder of 2; the logits in chunks of 4 positions.
    got = norms(graphdef, params, batch, sequences_per_chunk=4, logits_chunk_size=4)
    np.testing.assert_allclose(got, whole, rtol=1e-6)


def _temp_bytes(fn, b, t, d, v, layout="vd"):
    shape = (d, v) if layout == "dv" else (v, d)
    args = (
        jax.ShapeDtypeStruct((b, t, d), jnp.float32),
        jax.ShapeDtypeStruct(shape, jnp.float32),
        jax.ShapeDtypeStruct((b, t), jnp.int32),
        jax.ShapeDtypeStruct((b, t), jnp.bool_),
    )

    def objective(h, w, tokens, mask):
        logp, entropy = fn(h, w, tokens, mask, layout, 1.0)
        return jnp.sum(logp) + jnp.sum(entropy)

    compiled = jax.jit(jax.grad(objective, argnums=(0, 1))).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_memory_does_not_grow_with_the_sequence_like_the_dense_logits():
    b, d, v, chunk = 2, 32, 4096, 64
    dense = [_temp_bytes(_dense, b, t, d, v) for t in (257, 513)]
    chunked = [_temp_bytes(_chunked(chunk), b, t, d, v) for t in (257, 513)]
    logits_bytes = b * 256 * v * 4  # What 256 more positions' logits take.
    assert dense[1] - dense[0] >= logits_bytes  # The dense path holds all of them.
    assert chunked[1] - chunked[0] < 0.05 * logits_bytes
    # A few chunks' logits [B, chunk, V] and the weights' gradient, not the sequence's.
    assert chunked[1] < 4 * b * chunk * v * 4 + d * v * 4


def test_bad_arguments_are_errors():
    hidden, weights, tokens, mask, _, _ = _problem(0, 2, 5, 4, 9, "dv")
    ok = dict(chunk_size=2)
    for bad, match in [
        (dict(chunk_size=0), "chunk_size=0"),
        (dict(chunk_size=2.0), "chunk_size=2.0"),
        ({**ok, "head_layout": "tied"}, "head_layout='tied'"),
    ]:
        with pytest.raises(ValueError, match=match):
            chunked_token_logps_and_entropy(hidden, weights, tokens, mask, **bad)
    with pytest.raises(ValueError, match="mask shape"):
        chunked_token_logps_and_entropy(hidden, weights, tokens, mask[:, :3], **ok)
    with pytest.raises(ValueError, match="do not contract"):
        chunked_token_logps_and_entropy(hidden, weights, tokens, mask, head_layout="vd", **ok)
    with pytest.raises(ValueError, match="logits_chunk_size=0"):
        LearnerConfig(logits_chunk_size=0).validate()
    one = chunked_token_logps_and_entropy(hidden[:, :1], weights, tokens[:, :1], mask[:, :1], **ok)
    assert all(np.all(np.asarray(x) == 0.0) and x.shape == (2, 1) for x in one)
