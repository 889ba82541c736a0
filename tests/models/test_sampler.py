"""Sampler: padding invariance, recompilation, recorded log-probabilities, filters, EOS."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given
from hypothesis import strategies as st

from gac_jax.models import (
    Sampler,
    create_model,
    filter_logits,
    get_config,
    left_pad,
    per_token_logps,
    sample_step,
)

N_NEW = 8
EOS = 2
PAD = 0


@pytest.fixture(scope="module")
def model():
    # A sharper-than-default init so distributions are far from uniform.
    model = create_model(get_config("tiny_llama"), seed=0)
    state = nnx.state(model)
    nnx.update(model, jax.tree.map(lambda x: x * 2.0 if x.ndim > 1 else x, state))
    return model


@pytest.fixture(scope="module")
def sampler(model):
    return Sampler(model.config, max_new_tokens=N_NEW, eos_ids=EOS, pad_id=PAD)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.RandomState(0)
    lengths = (6, 2, 4)
    return [rng.randint(3, 128, size=n).tolist() for n in lengths]


@pytest.fixture(scope="module")
def batch(prompts):
    return left_pad(prompts, PAD, length=6)


@jax.jit
def _score(graphdef, state, tokens, mask):
    return per_token_logps(nnx.merge(graphdef, state), tokens, mask)


def _rescore(model, batch, out):
    tokens = jnp.concatenate([jnp.asarray(batch[0]), out.tokens], axis=1)
    mask = jnp.concatenate([jnp.asarray(batch[1]), out.completion_mask], axis=1)
    return np.asarray(_score(*nnx.split(model), tokens, mask))[:, batch[0].shape[1] :]


def test_left_padding_gives_the_unpadded_continuation(model, sampler, prompts, batch):
    padded = sampler.generate(model, *batch, jax.random.key(0), temperature=0.0)
    # Row 1 (2 tokens, 4 pads) alone and unpadded.
    alone = sampler.generate(
        model, *left_pad([prompts[1]], PAD), jax.random.key(0), temperature=0.0
    )
    np.testing.assert_array_equal(padded.tokens[1], alone.tokens[0])
    np.testing.assert_array_equal(padded.completion_mask[1], alone.completion_mask[0])
    np.testing.assert_allclose(padded.policy_logps[1], alone.policy_logps[0], atol=1e-5)


def test_sampling_parameters_do_not_recompile(model, sampler, batch):
    graphdef, state = nnx.split(model)
    before, cached_before = sampler.num_traces, sampler._jitted._cache_size()
    settings = [
        dict(temperature=1.0, top_k=0, top_p=1.0),
        dict(temperature=0.3, top_k=5, top_p=0.8),
        dict(temperature=np.array([0.0, 0.7, 1.5]), top_k=np.array([1, 0, 9]), top_p=0.5),
    ]
    for i, sampling in enumerate(settings):
        sampler(graphdef, state, *batch, jax.random.key(i), **sampling)
    assert sampler.num_traces - before <= 1  # At most the first call traces.
    # New parameter values (same shapes) reuse the program too.
    new_state = jax.tree.map(lambda x: x * 1.01, state)
    traces = sampler.num_traces
    sampler(graphdef, new_state, *batch, jax.random.key(9), temperature=0.9)
    assert sampler.num_traces == traces
    assert sampler._jitted._cache_size() == cached_before + (sampler.num_traces - before)


def test_logps_match_teacher_forcing_at_temperature_one(model, sampler, batch):
    out = sampler.generate(model, *batch, jax.random.key(1), temperature=1.0)
    mask = np.asarray(out.completion_mask)
    assert mask.sum() > 6
    rescored = _rescore(model, batch, out)
    np.testing.assert_allclose(np.where(mask, rescored, 0.0), out.logps, atol=1e-5, rtol=0)
    np.testing.assert_allclose(out.policy_logps, out.logps, atol=1e-6)
    assert (np.asarray(out.logps)[~mask] == 0).all()


def test_policy_logps_at_other_temperatures(model, sampler, batch):
    out = sampler.generate(model, *batch, jax.random.key(2), temperature=0.6, top_k=20, top_p=0.9)
    mask = np.asarray(out.completion_mask)
    rescored = _rescore(model, batch, out)
    np.testing.assert_allclose(np.where(mask, rescored, 0.0), out.policy_logps, atol=1e-5)
    # The sampling distribution is sharper and truncated: its log-probs are higher.
    assert (np.asarray(out.logps)[mask] >= np.asarray(out.policy_logps)[mask] - 1e-6).all()
    assert (np.asarray(out.logps)[mask] > np.asarray(out.policy_logps)[mask]).any()


def test_top_k_one_is_greedy(model, sampler, batch):
    greedy = sampler.generate(model, *batch, jax.random.key(3), temperature=0.0)
    top1 = sampler.generate(model, *batch, jax.random.key(4), temperature=1.3, top_k=1)
    np.testing.assert_array_equal(top1.tokens, greedy.tokens)
    np.testing.assert_array_equal(top1.logps, 0.0)  # One token carries all the mass.
    np.testing.assert_allclose(top1.policy_logps, greedy.policy_logps, atol=1e-6)


def test_same_key_same_tokens(model, sampler, batch):
    a = sampler.generate(model, *batch, jax.random.key(5), temperature=1.0)
    b = sampler.generate(model, *batch, jax.random.key(5), temperature=1.0)
    c = sampler.generate(model, *batch, jax.random.key(6), temperature=1.0)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.logps, b.logps)
    assert not np.array_equal(a.tokens, c.tokens)


def test_eos_stops_and_masks(model, sampler, batch):
    free = sampler.generate(model, *batch, jax.random.key(7), temperature=0.0)
    # Make row 0's third greedy token the end-of-sequence id of a second sampler.
    tokens0 = np.asarray(free.tokens[0]).tolist()
    eos = tokens0[2]
    first = tokens0.index(eos)
    stopping = Sampler(model.config, max_new_tokens=N_NEW, eos_ids=(eos, 127), pad_id=PAD)
    out = stopping.generate(model, *batch, jax.random.key(7), temperature=0.0)
    assert int(out.lengths[0]) == first + 1  # The EOS token is part of the completion.
    np.testing.assert_array_equal(out.tokens[0, : first + 1], tokens0[: first + 1])
    assert (np.asarray(out.tokens[0, first + 1 :]) == PAD).all()
    assert not np.asarray(out.completion_mask[0, first + 1 :]).any()
    assert (np.asarray(out.logps[0, first + 1 :]) == 0).all()
    assert (np.asarray(out.policy_logps[0, first + 1 :]) == 0).all()
    for row in range(1, 3):  # Other rows run on unless they also hit an EOS id.
        row_tokens = np.asarray(free.tokens[row]).tolist()
        hits = [i for i, t in enumerate(row_tokens) if t in (eos, 127)]
        assert int(out.lengths[row]) == (hits[0] + 1 if hits else N_NEW)
    # Without an EOS every row uses the whole budget.
    np.testing.assert_array_equal(free.lengths, [N_NEW] * 3)


def test_per_row_max_new_tokens(model, sampler, batch):
    free = sampler.generate(model, *batch, jax.random.key(8), temperature=0.0)
    limits = np.array([3, 1, N_NEW], np.int32)
    out = sampler.generate(model, *batch, jax.random.key(8), temperature=0.0, max_new_tokens=limits)
    np.testing.assert_array_equal(out.lengths, np.minimum(free.lengths, limits))
    for row, limit in enumerate(limits):
        np.testing.assert_array_equal(out.tokens[row, :limit], free.tokens[row, :limit])
        assert (np.asarray(out.tokens[row, limit:]) == PAD).all()
        assert not np.asarray(out.completion_mask[row, limit:]).any()
    with pytest.raises(ValueError, match=rf"max_new_tokens=\[0, 1, {N_NEW}\] must be in"):
        sampler.generate(model, *batch, jax.random.key(8), max_new_tokens=[0, 1, N_NEW])


def test_sample_step_with_a_key_per_row_ignores_the_batch():
    logits = jax.random.normal(jax.random.key(0), (5, 32))
    keys = jax.random.split(jax.random.key(1), 5)
    ones = (jnp.ones(5), jnp.zeros(5, jnp.int32), jnp.ones(5))
    step = jax.jit(sample_step)
    tokens = step(logits, keys, *ones)[0]
    alone = [
        int(step(logits[r : r + 1], keys[r : r + 1], *(x[:1] for x in ones))[0][0])
        for r in range(5)
    ]
    np.testing.assert_array_equal(tokens, alone)


def _reference_kept(logits, temperature, top_k, top_p):
    """NumPy float64: which tokens the top-k / top-p sampling distribution keeps."""
    scaled = logits.astype(np.float64) / temperature
    order = np.argsort(-scaled, kind="stable")
    k = len(scaled) if top_k == 0 else min(top_k, len(scaled))
    candidates = order[:k]
    probs = np.exp(scaled[candidates] - scaled[candidates].max())
    probs /= probs.sum()
    kept = 1
    while kept < k and top_p < 1.0 and probs[:kept].sum() < top_p:
        kept += 1
    if top_p >= 1.0:
        kept = k
    return set(candidates[:kept].tolist())


_filter = jax.jit(filter_logits)


@given(
    seed=st.integers(0, 2**31 - 1),
    temperature=st.floats(0.2, 3.0),
    top_k=st.integers(0, 20),
    top_p=st.floats(0.05, 1.0),
)
def test_filter_logits_matches_numpy(seed, temperature, top_k, top_p):
    logits = np.random.RandomState(seed).randn(16).astype(np.float32) * 3
    got = _filter(
        jnp.asarray(logits)[None, :],
        jnp.array([temperature], jnp.float32),
        jnp.array([top_k], jnp.int32),
        jnp.array([top_p], jnp.float32),
    )[0]
    kept = set(np.flatnonzero(np.isfinite(np.asarray(got))).tolist())
    want = _reference_kept(logits, temperature, top_k, top_p)
    assert kept == want
    finite = np.asarray(got)[sorted(kept)]
    np.testing.assert_allclose(finite, logits[sorted(kept)] / np.float32(temperature), rtol=1e-6)


def test_sample_step_frequencies_follow_the_filtered_distribution():
    rows = 20_000
    logits = jnp.broadcast_to(jnp.array([2.0, 1.5, 1.0, 0.0, -1.0, -3.0]), (rows, 6))
    temperature = jnp.full((rows,), 0.8)
    top_k = jnp.full((rows,), 4, jnp.int32)
    top_p = jnp.full((rows,), 0.9)
    tokens, logps, policy = jax.jit(sample_step)(
        logits, jax.random.key(0), temperature, top_k, top_p
    )
    scaled = np.array([2.0, 1.5, 1.0, 0.0, -1.0, -3.0]) / 0.8
    probs = np.exp(scaled[:4] - scaled[:4].max())
    probs /= probs.sum()
    keep = int(np.searchsorted(np.cumsum(probs), 0.9) + 1)  # Nucleus inside the top 4.
    target = np.zeros(6)
    target[:keep] = probs[:keep] / probs[:keep].sum()
    freq = np.bincount(np.asarray(tokens), minlength=6) / rows
    np.testing.assert_allclose(freq, target, atol=0.015)
    np.testing.assert_allclose(np.exp(np.asarray(logps)), target[np.asarray(tokens)], rtol=1e-5)
    full = np.exp(np.array([2.0, 1.5, 1.0, 0.0, -1.0, -3.0]))
    np.testing.assert_allclose(
        np.exp(np.asarray(policy)), (full / full.sum())[np.asarray(tokens)], rtol=1e-5
    )


def test_bad_arguments_raise(model, sampler, batch):
    graphdef, state = nnx.split(model)
    tokens, mask = batch
    key = jax.random.key(0)
    with pytest.raises(ValueError, match=r"top_p=\[1.5"):
        sampler(graphdef, state, tokens, mask, key, top_p=1.5)
    with pytest.raises(ValueError, match=r"temperature=\[-1.0"):
        sampler(graphdef, state, tokens, mask, key, temperature=-1.0)
    with pytest.raises(ValueError, match=r"shape \(3,\)"):
        sampler(graphdef, state, tokens, mask, key, top_k=np.array([1, 2]))
    right_padded = mask[:, ::-1]
    with pytest.raises(ValueError, match="not left-padded"):
        sampler(graphdef, state, tokens, right_padded, key)
    empty = mask.copy()
    empty[2] = False
    with pytest.raises(ValueError, match=r"rows \[2\] have no real token"):
        sampler(graphdef, state, tokens, empty, key)
    with pytest.raises(ValueError, match="outside"):
        Sampler(model.config, max_new_tokens=4, eos_ids=500, pad_id=0)
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        Sampler(model.config, max_new_tokens=0, eos_ids=2, pad_id=0)
    with pytest.raises(ValueError, match="empty"):
        left_pad([[1, 2], []], 0)
