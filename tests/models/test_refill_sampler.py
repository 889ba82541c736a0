"""RefillSampler: the fixed sampler's outputs, slot reuse, per-row keys, EOS, few rows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gac_jax.models import RefillSampler, Sampler, create_model, get_config, left_pad
from gac_jax.models.scoring import per_token_logps

N_NEW = 12
EOS = 2
PAD = 0
PROMPT_LEN = 8


@pytest.fixture(scope="module")
def model():
    # A sharper-than-default init so distributions are far from uniform.
    model = create_model(get_config("tiny_llama"), seed=0)
    state = nnx.state(model)
    nnx.update(model, jax.tree.map(lambda x: x * 2.0 if x.ndim > 1 else x, state))
    return model


@pytest.fixture(scope="module")
def fixed(model):
    return Sampler(model.config, max_new_tokens=N_NEW, eos_ids=EOS, pad_id=PAD)


def _refill(model, slots, eos=EOS):
    return RefillSampler(model.config, max_new_tokens=N_NEW, eos_ids=eos, pad_id=PAD, slots=slots)


def _prompts(rows, seed=0):
    """`rows` distinct prompts of 1..PROMPT_LEN tokens, left-padded to PROMPT_LEN."""
    rng = np.random.RandomState(seed)
    prompts = [
        rng.randint(3, 128, size=rng.randint(1, PROMPT_LEN + 1)).tolist() for _ in range(rows)
    ]
    return left_pad(prompts, PAD, PROMPT_LEN)


def _heavy_tailed_limits(rows, seed=0):
    rng = np.random.RandomState(seed)
    return np.clip(np.rint(rng.lognormal(np.log(3.0), 1.0, size=rows)), 1, N_NEW).astype(np.int32)


def _assert_same(a, b):
    for name in ("tokens", "completion_mask", "lengths"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    np.testing.assert_allclose(a.logps, b.logps, atol=1e-5, rtol=0)
    np.testing.assert_allclose(a.policy_logps, b.policy_logps, atol=1e-5, rtol=0)


@jax.jit
def _score(graphdef, state, tokens, mask):
    return per_token_logps(nnx.merge(graphdef, state), tokens, mask)


def _rescore(model, batch, out):
    """Teacher-forced log-probs of the completions, from a fresh forward pass."""
    tokens = jnp.concatenate([jnp.asarray(batch[0]), out.tokens], axis=1)
    mask = jnp.concatenate([jnp.asarray(batch[1]), out.completion_mask], axis=1)
    return np.asarray(_score(*nnx.split(model), tokens, mask))[:, batch[0].shape[1] :]


@pytest.mark.parametrize("slots", [3, 8])  # 8: the tail is compacted to 4 slots.
def test_greedy_equals_the_fixed_sampler(model, fixed, slots):
    batch = _prompts(11)
    key = jax.random.key(0)
    want = fixed.generate(model, *batch, key, temperature=0.0)
    got = _refill(model, slots).generate(model, *batch, key, temperature=0.0)
    _assert_same(got, want)
    assert np.asarray(want.completion_mask).sum() > 30  # Long enough to reuse slots.


def test_heavy_tailed_rows_answered_once_in_order(model, fixed):
    """N > B rows with varied limits: every row is its own prompt's greedy answer (the
    fixed sampler's), at its own limit unless it ends with EOS first."""
    rows = 23
    batch, limits = _prompts(rows, seed=1), _heavy_tailed_limits(rows)
    assert limits.max() == N_NEW and limits.min() == 1
    key = jax.random.key(1)
    want = fixed.generate(model, *batch, key, temperature=0.0, max_new_tokens=limits)
    got = _refill(model, 8).generate(model, *batch, key, temperature=0.0, max_new_tokens=limits)
    _assert_same(got, want)
    lengths, tokens = np.asarray(got.lengths), np.asarray(got.tokens)
    ended_by_eos = tokens[np.arange(rows), lengths - 1] == EOS
    np.testing.assert_array_equal(lengths[~ended_by_eos], limits[~ended_by_eos])
    assert (lengths <= limits).all()
    # Each row's tokens are those of its prompt alone (so not another row's answer).
    alone = fixed.generate(model, batch[0][5:6], batch[1][5:6], key, temperature=0.0)
    np.testing.assert_array_equal(got.tokens[5, : lengths[5]], alone.tokens[0, : lengths[5]])


def test_samples_do_not_depend_on_the_slots(model):
    """Keys are per (row, step): any number of slots gives the same samples, and their
    log-probs are the model's (the refilled slots' caches hold the right keys)."""
    batch, limits = _prompts(13, seed=2), _heavy_tailed_limits(13, seed=2)
    sampling = dict(temperature=np.linspace(0.5, 1.5, 13), top_k=5, top_p=0.95)
    outs = [
        _refill(model, slots).generate(
            model, *batch, jax.random.key(3), max_new_tokens=limits, **sampling
        )
        for slots in (2, 5, None)
    ]
    for other in outs[1:]:
        _assert_same(other, outs[0])
    mask = np.asarray(outs[0].completion_mask)
    rescored = _rescore(model, batch, outs[0])
    np.testing.assert_allclose(np.where(mask, rescored, 0.0), outs[0].policy_logps, atol=1e-5)
    different_key = _refill(model, 5).generate(
        model, *batch, jax.random.key(4), max_new_tokens=limits, **sampling
    )
    assert not np.array_equal(different_key.tokens, outs[0].tokens)


def _softmax64(logits):
    z = np.asarray(logits, np.float64)
    p = np.exp(z - z.max(axis=-1, keepdims=True))
    return p / p.sum(axis=-1, keepdims=True)


def test_sampled_tokens_follow_the_model():
    """Many rows of one prompt, two tokens each through 16 reused slots, from a model with
    16 tokens: the first token, and the second after the model's likeliest first one,
    have the model's softmax distribution, as the fixed sampler's do (total variation
    within three times its expected size)."""
    model = create_model(get_config("tiny_llama", vocab_size=16), seed=0)
    nnx.update(model, jax.tree.map(lambda x: x * 4.0 if x.ndim > 1 else x, nnx.state(model)))
    rows, prompt, eos = 4000, [5, 7, 3], 15
    batch = left_pad([prompt] * rows, PAD, 4)
    probs_v = _softmax64(model(jnp.asarray([prompt]))[0][0, -1])
    top = int(np.argmax(probs_v))
    second_logits = model(jnp.asarray([prompt + [top]]))[0][0, -1]
    probs_tv = np.stack([probs_v, _softmax64(second_logits)])
    samplers = (
        RefillSampler(model.config, max_new_tokens=2, eos_ids=eos, pad_id=PAD, slots=16),
        Sampler(model.config, max_new_tokens=2, eos_ids=eos, pad_id=PAD),
    )
    for sampler in samplers:
        out = sampler.generate(model, *batch, jax.random.key(5), temperature=1.0)
        tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
        assert ((lengths == 2) | (tokens[:, 0] == eos)).all()
        firsts = np.bincount(tokens[:, 0], minlength=16)
        seconds = np.bincount(tokens[tokens[:, 0] == top, 1], minlength=16)
        for counts, p in ((firsts, probs_tv[0]), (seconds, probs_tv[1])):
            n = counts.sum()
            assert n > 500
            tv = 0.5 * np.abs(counts / n - p).sum()
            # E[TV] <= 0.5 * sum sqrt(p (1 - p) / n).
            assert tv < 1.5 * np.sqrt(p * (1 - p) / n).sum(), (type(sampler).__name__, tv, n)


def test_eos_ends_a_row_and_frees_its_slot(model, fixed):
    batch = _prompts(9, seed=4)
    free = fixed.generate(model, *batch, jax.random.key(6), temperature=0.0)
    tokens0 = np.asarray(free.tokens[0]).tolist()
    eos = tokens0[2]
    first = tokens0.index(eos)
    stopping = Sampler(model.config, max_new_tokens=N_NEW, eos_ids=(eos, 127), pad_id=PAD)
    want = stopping.generate(model, *batch, jax.random.key(6), temperature=0.0)
    got = _refill(model, 2, eos=(eos, 127)).generate(
        model, *batch, jax.random.key(6), temperature=0.0
    )
    _assert_same(got, want)
    assert int(got.lengths[0]) == first + 1  # The EOS token is part of the completion.
    assert (np.asarray(got.tokens[0, first + 1 :]) == PAD).all()
    assert (np.asarray(got.logps[0, first + 1 :]) == 0).all()
    assert (np.asarray(got.policy_logps[0, first + 1 :]) == 0).all()


def test_fewer_rows_than_slots(model, fixed):
    batch = _prompts(3, seed=5)
    limits = np.array([N_NEW, 1, 5], np.int32)
    want = fixed.generate(model, *batch, jax.random.key(7), temperature=0.0, max_new_tokens=limits)
    sampler = _refill(model, 16)
    got = sampler.generate(model, *batch, jax.random.key(7), temperature=0.0, max_new_tokens=limits)
    _assert_same(got, want)
    assert got.tokens.shape == (3, N_NEW)
    # Sampling parameters and limits are arrays: new values reuse the program.
    traces = sampler.num_traces
    sampler.generate(model, *batch, jax.random.key(8), temperature=0.7, top_p=0.9, max_new_tokens=2)
    assert sampler.num_traces == traces


def test_bad_arguments_raise(model):
    batch = _prompts(3)
    graphdef, state = nnx.split(model)
    for slots in (0, 2.0, True):
        with pytest.raises(ValueError, match=f"slots={slots!r}"):
            _refill(model, slots)
    with pytest.raises(ValueError, match=r"max_new_tokens=\[3, 13, 1\]"):
        _refill(model, 2)(graphdef, state, *batch, jax.random.key(0), max_new_tokens=[3, 13, 1])
    with pytest.raises(ValueError, match="not left-padded"):
        _refill(model, 2)(graphdef, state, batch[0], batch[1][:, ::-1], jax.random.key(0))
