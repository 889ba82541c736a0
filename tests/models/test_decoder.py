"""Decoder layers against NumPy float64 references, KV-cache consistency, masks, remat."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gac_jax.models import (
    RopeScaling,
    create_model,
    get_config,
    init_cache,
    positions_from_mask,
    rope_inverse_frequencies,
)
from gac_jax.models.layers import RMSNorm, rope_tables, rotate
from tests.conftest import USERS_COMPILE_OPTIONS


def _forward(model, tokens, positions=None, mask=None):
    graphdef, state = nnx.split(model)
    return _jit_forward(graphdef, state, tokens, positions, mask)


@jax.jit
def _jit_forward(graphdef, state, tokens, positions, mask):
    return nnx.merge(graphdef, state)(tokens, positions, mask)[0]


def test_rms_norm_matches_numpy():
    norm = RMSNorm(8, eps=1e-6, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    norm.scale[...] = jnp.arange(1.0, 9.0)
    x = np.random.RandomState(0).randn(3, 5, 8)
    got = jax.jit(lambda m, v: m(v))(norm, jnp.asarray(x, jnp.float32))
    want = x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + 1e-6) * np.arange(1.0, 9.0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_rope_frequencies_plain_and_llama3():
    plain = rope_inverse_frequencies(8, 10_000.0)
    np.testing.assert_allclose(plain, 10_000.0 ** (-np.arange(0, 8, 2) / 8), rtol=1e-6)

    # Llama 3.1 reference formula, written per frequency.
    scaling = RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
    )
    base = 500_000.0 ** (-np.arange(0, 32, 2) / 32)
    want = []
    for f in base:
        wavelength = 2 * np.pi / f
        if wavelength < 64 / 4.0:
            want.append(f)
        elif wavelength > 64 / 1.0:
            want.append(f / 8.0)
        else:
            smooth = (64 / wavelength - 1.0) / (4.0 - 1.0)
            want.append((1 - smooth) * f / 8.0 + smooth * f)
    got = rope_inverse_frequencies(32, 500_000.0, scaling)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    # All three regimes occur, so the test exercises every branch.
    assert (got == base.astype(np.float32)).any() and (got < base / 7.9).any()
    assert ((got > base / 7.9) & (got < base * 0.999)).any()


def test_rotate_turns_the_halves_by_the_positions_angles():
    rng = np.random.RandomState(1)
    x = rng.randn(2, 3, 2, 8)
    positions = np.array([[0, 1, 5], [7, 2, 3]])
    inv_freq = rope_inverse_frequencies(8, 100.0)
    got = jax.jit(lambda x, p: rotate(x, rope_tables(p, inv_freq)))(
        jnp.asarray(x, jnp.float32), jnp.asarray(positions)
    )
    angle = positions[:, :, None, None] * inv_freq.astype(np.float64)[None, None, None, :]
    x1, x2 = x[..., :4], x[..., 4:]
    want = np.concatenate(
        [x1 * np.cos(angle) - x2 * np.sin(angle), x2 * np.cos(angle) + x1 * np.sin(angle)], -1
    )
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # A rotation keeps norms per (head, frequency pair).
    np.testing.assert_allclose(
        np.asarray(got)[..., :4] ** 2 + np.asarray(got)[..., 4:] ** 2, x1**2 + x2**2, rtol=1e-4
    )


def test_rope_table_lookup_matches_evaluated_tables():
    inv_freq = rope_inverse_frequencies(16, 1e6)
    positions = jnp.asarray([[0, 1, 2, 40], [3, 3, 0, 49]])
    evaluated = rope_tables(positions, inv_freq)
    looked_up = jax.jit(lambda p: rope_tables(p, inv_freq, 50))(positions)
    angle = np.asarray(positions, np.float64)[:, :, None, None] * inv_freq.astype(np.float64)
    for got, fn in zip(looked_up, (np.cos, np.sin), strict=True):
        assert got.shape == (2, 4, 1, 8) and got.dtype == jnp.float32
        np.testing.assert_allclose(got, fn(angle), atol=2e-6)
    for got, want in zip(looked_up, evaluated, strict=True):
        np.testing.assert_allclose(got, want, atol=2e-6)
    with pytest.raises(ValueError, match="max_position=0"):
        rope_tables(positions, inv_freq, 0)
    # Positions outside [0, max_position) are clipped into it.
    cos, _ = rope_tables(jnp.asarray([[-3, 60]]), inv_freq, 50)
    np.testing.assert_array_equal(
        cos[0, :, 0], rope_tables(jnp.asarray([[0, 49]]), inv_freq, 50)[0][0, :, 0]
    )


def test_default_positions_equal_explicit_ones(model):
    """Without positions the decoder derives them from the mask and looks its rotary
    tables up; explicit positions evaluate them. Both give the same logits."""
    tokens = jax.random.randint(jax.random.key(4), (2, 7), 3, model.config.vocab_size)
    mask = jnp.asarray([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]], bool)
    default = _forward(model, tokens, None, mask)
    explicit = _forward(model, tokens, positions_from_mask(mask), mask)
    np.testing.assert_allclose(default, explicit, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module", params=["tiny", "tiny_llama", "tiny scanned"])
def model(request):
    name, *scanned = request.param.split()
    return create_model(get_config(name, scan_layers=bool(scanned)), seed=3)


@pytest.mark.parametrize("remat", ["none", "full", "dots"])
def test_the_scanned_layers_compute_the_unrolled_layers_bits(remat):
    """One program loops over the stacked layers, the other runs them one after another:
    the same logits, gradients and cached decode, bit for bit as users compile them."""
    cfg = get_config("tiny", num_layers=3, remat=remat)
    tokens = jax.random.randint(jax.random.key(5), (2, 7), 0, cfg.vocab_size)
    mask = jnp.ones((2, 7), bool).at[0, :2].set(False)

    def run(graphdef, state):
        loss = lambda s: jnp.mean(nnx.merge(graphdef, s)(tokens, None, mask)[0] ** 2)  # noqa: E731
        decoder = nnx.merge(graphdef, state)
        cache = init_cache(cfg, 2, 9) | {"index": jnp.array([0, 2], jnp.int32)}
        prefill, cache = decoder(
            tokens[:, :5], positions_from_mask(mask)[:, :5], mask[:, :5], cache
        )
        step, _ = decoder(tokens[:, 5:7], jnp.asarray([[3, 4], [5, 6]]), None, cache)
        return jax.grad(loss)(state), prefill, step

    outs = {}
    for scan in (False, True):
        graphdef, state = nnx.split(create_model(cfg.replace(scan_layers=scan), seed=1))
        compiled = jax.jit(run, compiler_options=USERS_COMPILE_OPTIONS)
        assert ("while" in compiled.lower(graphdef, state).as_text()) == scan
        outs[scan] = compiled(graphdef, state)
    for a, b in zip(jax.tree.leaves(outs[True]), jax.tree.leaves(outs[False]), strict=True):
        np.testing.assert_array_equal(a, b)


def test_cached_decoding_equals_full_forward(model):
    cfg = model.config
    tokens = jax.random.randint(jax.random.key(0), (2, 9), 0, cfg.vocab_size)
    full = _forward(model, tokens)

    @jax.jit
    def incremental(graphdef, state, tokens):
        decoder = nnx.merge(graphdef, state)
        cache = init_cache(cfg, 2, 12)
        positions = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32)[None, :], (2, 9))
        outs = []
        # A 6-token prefill, a 2-token chunk, then single tokens.
        for start, stop in ((0, 6), (6, 8), (8, 9)):
            logits, cache = decoder(tokens[:, start:stop], positions[:, start:stop], None, cache)
            outs.append(logits)
        return jnp.concatenate(outs, axis=1), cache["index"]

    stepped, index = incremental(*nnx.split(model), tokens)
    assert int(index) == 9
    np.testing.assert_allclose(stepped, full, rtol=1e-5, atol=1e-5)


def test_per_row_cache_index_writes_each_row_at_its_own_slot(model):
    """A cache index [B]: row 1 starts 3 slots later than row 0 (its first slots stay
    masked), then both go on in chunks and single tokens; logits equal the full forward."""
    cfg = model.config
    tokens = jax.random.randint(jax.random.key(2), (2, 7), 0, cfg.vocab_size)
    full = _forward(model, tokens)

    @jax.jit
    def incremental(graphdef, state, tokens):
        decoder = nnx.merge(graphdef, state)
        cache = init_cache(cfg, 2, 12) | {"index": jnp.array([0, 3], jnp.int32)}
        positions = jnp.broadcast_to(jnp.arange(7, dtype=jnp.int32)[None, :], (2, 7))
        outs = []
        for start, stop in ((0, 4), (4, 5), (5, 7)):
            logits, cache = decoder(tokens[:, start:stop], positions[:, start:stop], None, cache)
            outs.append(logits)
        return jnp.concatenate(outs, axis=1), cache

    stepped, cache = incremental(*nnx.split(model), tokens)
    np.testing.assert_array_equal(cache["index"], [7, 10])
    np.testing.assert_array_equal(cache["key_mask"][1], [0, 0, 0] + [1] * 7 + [0, 0])
    np.testing.assert_allclose(stepped, full, rtol=1e-5, atol=1e-5)


def test_left_padding_does_not_change_real_logits(model):
    cfg = model.config
    tokens = np.asarray(jax.random.randint(jax.random.key(1), (1, 6), 3, cfg.vocab_size))
    alone = _forward(model, jnp.asarray(tokens))
    padded = np.concatenate([np.full((1, 3), 77), tokens], axis=1)  # Garbage pads.
    mask = np.concatenate([np.zeros((1, 3), bool), np.ones((1, 6), bool)], axis=1)
    positions = positions_from_mask(jnp.asarray(mask))
    np.testing.assert_array_equal(positions, [[0, 0, 0, 0, 1, 2, 3, 4, 5]])
    got = _forward(model, jnp.asarray(padded), positions, jnp.asarray(mask))
    np.testing.assert_allclose(got[:, 3:], alone, rtol=1e-5, atol=1e-5)
    assert np.isfinite(np.asarray(got)).all()


def test_remat_is_applied_and_keeps_loss_and_gradients():
    cfg = get_config("tiny", num_layers=1)
    tokens = jax.random.randint(jax.random.key(2), (2, 6), 0, cfg.vocab_size)

    def loss_fn(remat):
        graphdef, state = nnx.split(create_model(cfg.replace(remat=remat), seed=0))

        def loss(state):
            return jnp.mean(nnx.merge(graphdef, state)(tokens)[0] ** 2)

        return loss, state

    for remat in ("none", "full", "dots"):
        loss, state = loss_fn(remat)
        jaxpr = str(jax.make_jaxpr(jax.grad(loss))(state))
        assert ("checkpoint" in jaxpr or "remat" in jaxpr) == (remat != "none"), remat

    base_loss, base_grad = jax.jit(jax.value_and_grad(loss_fn("none")[0]))(loss_fn("none")[1])
    loss, grad = jax.jit(jax.value_and_grad(loss_fn("full")[0]))(loss_fn("full")[1])
    np.testing.assert_allclose(loss, base_loss, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grad), jax.tree.leaves(base_grad), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)


def test_bfloat16_compute_stays_close_to_float32():
    cfg = get_config("tiny")
    tokens = jax.random.randint(jax.random.key(4), (2, 8), 0, cfg.vocab_size)
    f32 = _forward(create_model(cfg, seed=5), tokens)
    bf16_model = create_model(cfg.replace(dtype="bfloat16"), seed=5)
    bf16 = _forward(bf16_model, tokens)
    assert bf16.dtype == jnp.float32  # Logits are always float32.
    assert bf16_model.layers.attn.q_dnh[...].dtype == jnp.float32  # param_dtype
    rel = np.abs(np.asarray(bf16) - np.asarray(f32)).max() / np.abs(np.asarray(f32)).max()
    assert 0 < rel < 3e-2


def test_tied_and_untied_parameters():
    tied = create_model(get_config("tiny"))
    untied = create_model(get_config("tiny_llama"))
    assert tied.lm_head_dv is None
    assert untied.lm_head_dv[...].shape == (64, 128)
    assert untied.layers.attn.q_norm is None  # Llama has no q/k norm.
    assert tied.layers.attn.q_norm.scale[...].shape == (tied.config.num_layers, 16)


def test_bad_inputs_raise():
    model = create_model(get_config("tiny"))
    with pytest.raises(ValueError, match=r"shape \[B, T\]"):
        model(jnp.zeros((4,), jnp.int32))
    with pytest.raises(ValueError, match="input_mask shape"):
        model(jnp.zeros((2, 3), jnp.int32), None, jnp.ones((2, 4), bool))
    with pytest.raises(ValueError, match="max_length=0"):
        init_cache(model.config, 2, 0)
