"""Sampler: greedy decoding equals teacher forcing, padding invariance, recompilation,
recorded log-probabilities, filters, EOS, slot refill (heavy-tailed lengths, per-row keys,
few rows) and the sampled distribution.

References are independent of the sampler: full teacher-forced forwards without a KV
cache, and NumPy float64 distributions. The in-flight driver is in test_inflight.py."""

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
N_LONG = 12  # The slot-refill tests' length: long enough for slots to be reused.
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


@jax.jit
def _logits(graphdef, state, tokens, mask):
    return nnx.merge(graphdef, state)(tokens, None, mask)[0]


def _greedy_reference(model, batch, n, limits=None, eos=(EOS,)):
    """Each row's greedy completion of at most `n` tokens (its limit, or through its first
    EOS id), by full teacher-forced forwards without a KV cache: `(tokens, mask)`."""
    tokens, mask = (np.asarray(x) for x in batch)
    rows, prompt_len = tokens.shape
    limits = np.full(rows, n) if limits is None else np.asarray(limits)
    tokens = np.concatenate([tokens, np.full((rows, n), PAD, np.int32)], axis=1)
    mask = np.concatenate([mask, np.zeros((rows, n), bool)], axis=1)
    active = np.ones(rows, bool)
    graphdef, state = nnx.split(model)
    for j in range(n):
        column = prompt_len + j
        logits = np.asarray(_logits(graphdef, state, tokens, mask))[:, column - 1]
        chosen = logits.argmax(axis=-1)
        tokens[active, column], mask[active, column] = chosen[active], True
        active &= ~np.isin(chosen, eos) & (j + 1 < limits)
    return tokens[:, prompt_len:], mask[:, prompt_len:]


def _assert_greedy(model, batch, out, limits=None, eos=(EOS,)):
    """`out` holds the greedy completions, with the model's log-probabilities."""
    tokens, mask = _greedy_reference(model, batch, out.tokens.shape[1], limits, eos)
    np.testing.assert_array_equal(out.tokens, tokens)
    np.testing.assert_array_equal(out.completion_mask, mask)
    np.testing.assert_array_equal(out.lengths, mask.sum(axis=1))
    rescored = np.where(mask, _rescore(model, batch, out), 0.0)
    np.testing.assert_allclose(out.policy_logps, rescored, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(out.logps, 0.0)  # Greedy rows sample from no distribution.


def _assert_same(a, b):
    for name in ("tokens", "completion_mask", "lengths"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    np.testing.assert_allclose(a.logps, b.logps, atol=1e-5, rtol=0)
    np.testing.assert_allclose(a.policy_logps, b.policy_logps, atol=1e-5, rtol=0)


def _refill(model, slots, eos=EOS):
    return Sampler(model.config, max_new_tokens=N_LONG, eos_ids=eos, pad_id=PAD, slots=slots)


def _prompts(rows, seed=0):
    """`rows` distinct prompts of 1..PROMPT_LEN tokens, left-padded to PROMPT_LEN."""
    rng = np.random.RandomState(seed)
    prompts = [
        rng.randint(3, 128, size=rng.randint(1, PROMPT_LEN + 1)).tolist() for _ in range(rows)
    ]
    return left_pad(prompts, PAD, PROMPT_LEN)


def _heavy_tailed_limits(rows, seed=0):
    rng = np.random.RandomState(seed)
    return np.clip(np.rint(rng.lognormal(np.log(3.0), 1.0, size=rows)), 1, N_LONG).astype(np.int32)


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
    before, cached_before = sampler.num_traces, sampler.compiled_programs()["sample"]
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
    assert sampler.compiled_programs()["sample"] == cached_before + (sampler.num_traces - before)


def test_samplers_of_one_specification_share_their_programs(model, batch):
    """A second sampler of the same model configuration, lengths, ids and slots traces
    nothing and gives the same tokens; one of another length has programs of its own."""
    graphdef, state = nnx.split(model)
    # EOS ids no other test uses: no sampler of this process has these specifications yet.
    first = Sampler(model.config, max_new_tokens=5, eos_ids=(EOS, 4), pad_id=PAD, slots=2)
    out = first(graphdef, state, *batch, jax.random.key(3), temperature=0.8)
    traces, programs = first.num_traces, first.compiled_programs()
    second = Sampler(model.config, max_new_tokens=5, eos_ids=[EOS, 4], pad_id=PAD, slots=2)
    assert traces >= 1 and (second.num_traces, second.compiled_programs()) == (traces, programs)
    again = second(graphdef, state, *batch, jax.random.key(3), temperature=0.8)
    assert (second.num_traces, second.compiled_programs()) == (traces, programs)
    np.testing.assert_array_equal(again.tokens, out.tokens)
    other = Sampler(model.config, max_new_tokens=6, eos_ids=(EOS, 4), pad_id=PAD, slots=2)
    assert (other.num_traces, other.compiled_programs()["sample"]) == (0, 0)
    other(graphdef, state, *batch, jax.random.key(3), temperature=0.8)
    assert other.num_traces == 1 and first.num_traces == traces


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


@pytest.mark.parametrize("slots", [None, 2])  # 2: the slot freed by an EOS is refilled.
def test_eos_stops_and_masks(model, sampler, batch, slots):
    free = sampler.generate(model, *batch, jax.random.key(7), temperature=0.0)
    # Make row 0's third greedy token the end-of-sequence id of a second sampler.
    tokens0 = np.asarray(free.tokens[0]).tolist()
    eos = tokens0[2]
    first = tokens0.index(eos)
    stopping = Sampler(
        model.config, max_new_tokens=N_NEW, eos_ids=(eos, 127), pad_id=PAD, slots=slots
    )
    out = stopping.generate(model, *batch, jax.random.key(7), temperature=0.0)
    _assert_greedy(model, batch, out, eos=(eos, 127))
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


def test_rows_without_a_filter_skip_the_sort_with_the_same_bits():
    """With top-k 0 (or >= V) and top-p 1 in every row, `sample_step` skips the sort of
    the vocabulary (`filter_logits`) at run time; a row sampled so gives the tokens and
    both log-probs, bit for bit, that it gets in a batch whose other row filters."""
    logits = jax.random.normal(jax.random.key(5), (2, 64)) * 3
    keys = jax.random.split(jax.random.key(6), 2)
    temperature = jnp.array([0.7, 0.7])
    step = jax.jit(sample_step)
    mixed = step(logits, keys, temperature, jnp.array([0, 5], jnp.int32), jnp.array([1.0, 0.9]))
    for top_k in (0, 64):
        alone = step(logits[:1], keys[:1], temperature[:1], jnp.array([top_k], jnp.int32),
                     jnp.ones(1))  # fmt: skip
        for got, want in zip(alone, mixed, strict=True):
            np.testing.assert_array_equal(got, want[:1])
    unfiltered = (jnp.zeros(2, jnp.int32), jnp.ones(2))
    closed = jax.make_jaxpr(sample_step)(logits, keys, temperature, *unfiltered)
    assert "sort" in _primitives(closed.jaxpr, conds=True)
    assert "sort" not in _primitives(closed.jaxpr, conds=False)  # Only in a cond's branch.


def _primitives(jaxpr, conds: bool) -> set[str]:
    """The primitives `jaxpr` runs, in its sub-programs too (in `cond` branches if `conds`)."""
    names = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "cond" and not conds:
            continue
        names.add(eqn.primitive.name)
        for value in jax.tree.leaves(list(eqn.params.values()), is_leaf=_is_jaxpr):
            if _is_jaxpr(value):
                names |= _primitives(getattr(value, "jaxpr", value), conds)
    return names


def _is_jaxpr(x) -> bool:
    return isinstance(x, jax.extend.core.ClosedJaxpr | jax.extend.core.Jaxpr)


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


@pytest.mark.parametrize(
    "temperature, top_k, top_p, plain",
    [(1.0, 0, 1.0, True), (1.0, 64, 1.0, True), (0.7, 0, 1.0, False), (1.0, 5, 1.0, False),
     (1.0, 0, 0.9, False)],
)  # fmt: skip
def test_sample_step_policy_logps_are_the_policys_with_or_without_the_shortcut(
    temperature, top_k, top_p, plain
):
    """At temperature 1 with no filter (`top_k` 0 or >= V counts as none) the sampled
    distribution is the policy and its log-probs are reused as the policy's; otherwise
    the policy's are computed on their own. Both against float64."""
    logits = jax.random.normal(jax.random.key(3), (8, 64)) * 3
    per_row = (
        jnp.full(8, temperature),
        jnp.full(8, top_k, jnp.int32),
        jnp.full(8, top_p),
    )
    tokens, logps, policy = jax.jit(sample_step)(logits, jax.random.key(4), *per_row)
    z = np.asarray(logits, np.float64)
    top = z.max(-1, keepdims=True)
    log_softmax = z - (top + np.log(np.exp(z - top).sum(-1, keepdims=True)))
    want = log_softmax[np.arange(8), np.asarray(tokens)]
    np.testing.assert_allclose(np.asarray(policy), want, rtol=1e-5, atol=1e-6)
    assert np.array_equal(np.asarray(policy), np.asarray(logps)) == plain


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
    for slots in (0, 2.0, True):
        with pytest.raises(ValueError, match=f"slots={slots!r}"):
            _refill(model, slots)
    with pytest.raises(ValueError, match="empty"):
        left_pad([[1, 2], []], 0)


@pytest.mark.parametrize("slots", [3, 8, None])  # 8: the tail is compacted to 4 slots.
def test_greedy_equals_teacher_forcing(model, slots):
    batch = _prompts(11)
    out = _refill(model, slots).generate(model, *batch, jax.random.key(0), temperature=0.0)
    _assert_greedy(model, batch, out)
    assert np.asarray(out.completion_mask).sum() > 30  # Long enough to reuse slots.


def test_heavy_tailed_rows_answered_once_in_order(model):
    """More rows than slots, with varied limits: every row is its own prompt's greedy
    answer, at its own limit unless it ends with EOS first."""
    rows = 23
    batch, limits = _prompts(rows, seed=1), _heavy_tailed_limits(rows)
    assert limits.max() == N_LONG and limits.min() == 1
    key = jax.random.key(1)
    got = _refill(model, 8).generate(model, *batch, key, temperature=0.0, max_new_tokens=limits)
    _assert_greedy(model, batch, got, limits)
    lengths, tokens = np.asarray(got.lengths), np.asarray(got.tokens)
    ended_by_eos = tokens[np.arange(rows), lengths - 1] == EOS
    np.testing.assert_array_equal(lengths[~ended_by_eos], limits[~ended_by_eos])
    # Each row's tokens are those of its prompt alone (so not another row's answer).
    alone = _refill(model, None).generate(model, batch[0][5:6], batch[1][5:6], key, temperature=0)
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


@pytest.mark.parametrize("slots", [16, None])  # 16: 4000 rows through reused slots.
def test_sampled_tokens_follow_the_model(slots):
    """Many rows of one prompt, two tokens each, from a model with 16 tokens: the first
    token, and the second after the model's likeliest first one, have the model's
    softmax distribution (total variation within three times its expected size)."""
    model = create_model(get_config("tiny_llama", vocab_size=16), seed=0)
    nnx.update(model, jax.tree.map(lambda x: x * 4.0 if x.ndim > 1 else x, nnx.state(model)))
    rows, prompt, eos = 4000, [5, 7, 3], 15
    batch = left_pad([prompt] * rows, PAD, 4)
    probs_v = _softmax64(model(jnp.asarray([prompt]))[0][0, -1])
    top = int(np.argmax(probs_v))
    second_logits = model(jnp.asarray([prompt + [top]]))[0][0, -1]
    probs_tv = np.stack([probs_v, _softmax64(second_logits)])
    sampler = Sampler(model.config, max_new_tokens=2, eos_ids=eos, pad_id=PAD, slots=slots)
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
        assert tv < 1.5 * np.sqrt(p * (1 - p) / n).sum(), (tv, n)


def test_fewer_rows_than_slots(model):
    batch = _prompts(3, seed=5)
    limits = np.array([N_LONG, 1, 5], np.int32)
    sampler = _refill(model, 16)
    got = sampler.generate(model, *batch, jax.random.key(7), temperature=0.0, max_new_tokens=limits)
    _assert_greedy(model, batch, got, limits)
    assert got.tokens.shape == (3, N_LONG)
    # Sampling parameters and limits are arrays: new values reuse the program.
    traces = sampler.num_traces
    sampler.generate(model, *batch, jax.random.key(8), temperature=0.7, top_p=0.9, max_new_tokens=2)
    assert sampler.num_traces == traces


def test_lower_compiles_from_abstract_arguments(model, sampler, batch):
    """`lower` takes `jax.ShapeDtypeStruct`s: the program compiles with no weight."""
    graphdef, state = nnx.split(model)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    tokens, mask = (jax.ShapeDtypeStruct(x.shape, x.dtype) for x in batch)
    key = jax.eval_shape(lambda: jax.random.key(0))
    compiled = sampler.lower(graphdef, abstract, tokens, mask, key, temperature=0.5).compile()
    assert compiled.memory_analysis().argument_size_in_bytes > 0
