"""EpisodeSampler.sample_inflight: chunked decode that swaps to newly published params.

The references here are independent of the sampler: a Python simulation of the slot
schedule (which global decode step samples each token, hence its chunk and version), and
teacher-forced forwards of the decoder over each row, one segment per params version.
"""

import heapq
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gac_jax.models import (
    InflightSampleOutput,
    Sampler,
    create_model,
    get_config,
    init_cache,
    left_pad,
)
from gac_jax.models.scoring import per_token_logps
from gac_jax.rollout.episode_driver import EpisodeSampler

N_NEW = 12
EOS = 2
PAD = 0
PROMPT_LEN = 8
ROWS = 16
SLOTS = 8  # 16 rows through 8 slots: refills, then the tail is compacted to 4 slots.


@pytest.fixture(scope="module")
def model():
    model = create_model(get_config("tiny"), seed=0)
    # A sharper-than-default init so distributions are far from uniform.
    nnx.update(model, jax.tree.map(lambda x: x * 2.0 if x.ndim > 1 else x, nnx.state(model)))
    return model


@pytest.fixture(scope="module")
def versions(model):
    """Two params versions: the model's, and a perturbed copy (another policy)."""
    graphdef, params_a = nnx.split(model)
    leaves, treedef = jax.tree.flatten(params_a)
    keys = jax.random.split(jax.random.key(42), len(leaves))
    params_b = jax.tree.unflatten(
        treedef,
        [
            x + 0.03 * jax.random.normal(k, x.shape, x.dtype) if x.ndim > 1 else x
            for x, k in zip(leaves, keys, strict=True)
        ],
    )
    return graphdef, params_a, params_b


@pytest.fixture(scope="module")
def sampler(model):
    # One sampler and one set of shapes for the module: each program compiles once.
    return Sampler(model.config, max_new_tokens=N_NEW, eos_ids=EOS, pad_id=PAD, slots=SLOTS)


def _prompts(rows, seed):
    rng = np.random.RandomState(seed)
    prompts = [
        rng.randint(3, 128, size=rng.randint(1, PROMPT_LEN + 1)).tolist() for _ in range(rows)
    ]
    return prompts, left_pad(prompts, PAD, PROMPT_LEN)


def _limits(rows, seed):
    rng = np.random.RandomState(seed)
    return np.clip(np.rint(rng.lognormal(np.log(3.0), 1.0, size=rows)), 1, N_NEW).astype(np.int32)


def _schedule(lengths, slots):
    """Global decode step at which each row samples its first token, and the total number
    of decode steps: rows take the earliest free slot in row order; a slot freed by a
    row's last token at step t serves the next row from step t + 1."""
    free = [0] * min(slots, len(lengths))
    starts = []
    for length in lengths:
        start = heapq.heappop(free)
        starts.append(start)
        heapq.heappush(free, start + int(length))
    return np.asarray(starts), max(s + int(n) for s, n in zip(starts, lengths, strict=True))


class _Publisher:
    """params_fn: call i returns `published[i]` (the last one from then on)."""

    def __init__(self, published):
        self.published, self.calls = published, 0

    def __call__(self):
        out = self.published[min(self.calls, len(self.published) - 1)]
        self.calls += 1
        return out


def _expected_versions(out, starts, chunk_steps, version_of_chunk):
    """[R, N]: the version of the chunk of the global step that samples each token; -1."""
    lengths = np.asarray(out.lengths)
    want = np.full((len(lengths), N_NEW), -1, np.int64)
    for r, (start, length) in enumerate(zip(starts, lengths, strict=True)):
        want[r, :length] = [version_of_chunk((start + j) // chunk_steps) for j in range(length)]
    return want


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0, top_k=20)])
@pytest.mark.parametrize("chunk_steps", [1, 3, 100])
def test_constant_params_equal_the_one_program_sampler(model, sampler, sampling, chunk_steps):
    """Same params every chunk: `__call__`'s tokens and log-probs, bit for bit (refills
    and tail compaction included), one params_fn call per chunk of the simulated
    schedule, every token tagged with the one version."""
    _, batch = _prompts(ROWS, seed=0)
    limits = _limits(ROWS, seed=0)
    graphdef, state = nnx.split(model)
    key = jax.random.key(3)
    want = sampler(graphdef, state, *batch, key, max_new_tokens=limits, **sampling)
    publisher = _Publisher([(state, 5)])
    got = EpisodeSampler(sampler).sample_inflight(
        graphdef, publisher, *batch, key, chunk_steps=chunk_steps, max_new_tokens=limits, **sampling
    )
    assert isinstance(got, InflightSampleOutput)
    for name in ("tokens", "completion_mask", "lengths", "logps", "policy_logps"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
    mask = np.asarray(got.completion_mask)
    assert mask.sum() > 50
    np.testing.assert_array_equal(got.token_versions, np.where(mask, 5, -1))
    _, decode_steps = _schedule(np.asarray(got.lengths), SLOTS)
    assert publisher.calls == math.ceil(decode_steps / chunk_steps)


def test_params_fn_called_once_per_chunk(model, sampler):
    """A new version (same params) before every chunk: params_fn runs once per chunk,
    ceil(D / chunk_steps) times for D decode steps; token j of a row that starts at step
    s carries the version of chunk (s + j) // chunk_steps; and feeding each slot's last
    token again under the "new" params changes nothing (log-probs to float tolerance).
    New chunk sizes and versions reuse the compiled chunk programs."""
    _, batch = _prompts(ROWS, seed=1)
    limits = _limits(ROWS, seed=1)
    graphdef, state = nnx.split(model)
    key = jax.random.key(4)
    want = sampler(graphdef, state, *batch, key, max_new_tokens=limits)
    for chunk_steps in (1, 2, 5):
        publisher = _Publisher([(state, 100 + i) for i in range(64)])
        got = EpisodeSampler(sampler).sample_inflight(
            graphdef, publisher, *batch, key, chunk_steps=chunk_steps, max_new_tokens=limits
        )
        starts, decode_steps = _schedule(np.asarray(got.lengths), SLOTS)
        assert decode_steps > 2 * chunk_steps
        assert publisher.calls == math.ceil(decode_steps / chunk_steps), chunk_steps
        want_versions = _expected_versions(got, starts, chunk_steps, lambda c: 100 + c)
        np.testing.assert_array_equal(got.token_versions, want_versions)
        assert np.unique(want_versions).size == publisher.calls + 1  # All chunks, and -1.
        np.testing.assert_array_equal(got.tokens, want.tokens)
        np.testing.assert_allclose(got.policy_logps, want.policy_logps, atol=1e-5, rtol=0)
        np.testing.assert_allclose(got.logps, want.logps, atol=1e-5, rtol=0)
    assert sampler.compiled_programs()["chunk"] == 2  # One program per width (8 and 4).


SEGMENT = PROMPT_LEN + N_NEW  # Room for any run of one version in a row.


@jax.jit
def _segment_logits(graphdef, params, tokens_t, positions_t, mask_t, cache):
    """One teacher-forced forward of a padded segment, appended to `cache`."""
    decoder = nnx.merge(graphdef, params)
    hidden, cache = decoder.hidden_states(tokens_t[None], positions_t[None], mask_t[None], cache)
    return decoder.logits(hidden)[0], cache


def _mixed_cache_logps(graphdef, params_of, prompt, completion, position_versions):
    """float64 [L]: log-probs of `completion` after `prompt`, each from a decoder whose
    cache was written segment by segment, each run of positions of one version by that
    version's params (teacher-forced multi-token forwards). Each segment is padded to
    SEGMENT tokens whose keys are masked out, so one compiled forward serves them all."""
    tokens = np.asarray(prompt + completion[:-1], np.int32)
    assert len(tokens) == len(position_versions)
    bounds = [0] + [
        i for i in range(1, len(tokens)) if position_versions[i] != position_versions[i - 1]
    ]
    bounds.append(len(tokens))
    config = nnx.merge(graphdef, params_of[position_versions[0]]).config
    cache = init_cache(config, 1, SEGMENT * (N_NEW + 1))  # At most N + 1 segments.
    logits = []
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        pad = SEGMENT - (end - start)
        seg_logits, cache = _segment_logits(
            graphdef,
            params_of[position_versions[start]],
            jnp.asarray(np.pad(tokens[start:end], (0, pad))),
            jnp.asarray(np.pad(np.arange(start, end, dtype=np.int32), (0, pad))),
            jnp.asarray(np.arange(SEGMENT) < end - start),
            cache,
        )
        logits.append(np.asarray(seg_logits, np.float64)[: end - start])
    z = np.concatenate(logits)[len(prompt) - 1 :]
    z = z - z.max(axis=-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    return logp[np.arange(len(completion)), completion]


@jax.jit
def _score(graphdef, state, tokens, mask):
    return per_token_logps(nnx.merge(graphdef, state), tokens, mask)


@pytest.mark.parametrize("swaps", ["once", "every_chunk"])
def test_swapped_params_sample_with_their_version(sampler, versions, swaps):
    """Version 3 (params A) for the first chunk, then 4 (params B) for good ("once"), or
    a new version every chunk, alternating A and B ("every_chunk").

    * Each token carries the version of the chunk of the step that sampled it (from the
      simulated schedule), -1 past the row's end; versions never decrease along a row.
    * Each token's log-prob is its version's decode over the mixed KV cache: prompt
      positions by the prefill's version, the position feeding token j by token j's
      version (a segment-by-segment teacher-forced forward, float tolerance).
    * Rows prefilled and completed within one version match a plain teacher-forced
      forward under it; rows spanning a swap do not (the stale cache matters, so the
      mixed-cache reference is not vacuous)."""
    graphdef, params_a, params_b = versions
    prompts, batch = _prompts(ROWS, seed=2)
    limits = _limits(ROWS, seed=2)
    chunk_steps = 3
    if swaps == "once":
        published = [(params_a, 3), (params_b, 4)]
    else:
        published = [((params_a, params_b)[i % 2], 3 + i) for i in range(64)]
    params_of = {v: p for p, v in published}
    publisher = _Publisher(published)

    def version_of_chunk(c):
        return published[min(c, len(published) - 1)][1]

    out = EpisodeSampler(sampler).sample_inflight(
        graphdef,
        publisher,
        *batch,
        jax.random.key(7),
        chunk_steps=chunk_steps,
        max_new_tokens=limits,
        temperature=1.0,
    )
    lengths, mask = np.asarray(out.lengths), np.asarray(out.completion_mask)
    token_versions, policy_logps = np.asarray(out.token_versions), np.asarray(out.policy_logps)
    starts, decode_steps = _schedule(lengths, SLOTS)
    assert publisher.calls == math.ceil(decode_steps / chunk_steps)
    np.testing.assert_array_equal(
        token_versions, _expected_versions(out, starts, chunk_steps, version_of_chunk)
    )
    assert (np.diff(np.where(mask, token_versions, 1 << 30), axis=1) >= 0).all()
    np.testing.assert_allclose(out.logps, np.where(mask, policy_logps, 0.0), atol=1e-5)

    full_tokens = jnp.concatenate([jnp.asarray(batch[0]), out.tokens], axis=1)
    full_mask = jnp.concatenate([jnp.asarray(batch[1]), out.completion_mask], axis=1)
    forward = {
        v: np.asarray(_score(graphdef, p, full_tokens, full_mask))[:, PROMPT_LEN:]
        for v, p in params_of.items()
    }
    kinds = {"pure": 0, "mixed": 0, "fresh_row_swapped": 0}
    for r in range(ROWS):
        n = lengths[r]
        tags = token_versions[r, :n].tolist()
        prefill = version_of_chunk((starts[r] - 1) // chunk_steps) if starts[r] else tags[0]
        position_versions = [prefill] * (len(prompts[r]) - 1) + tags
        completion = np.asarray(out.tokens[r, :n]).tolist()
        want = _mixed_cache_logps(graphdef, params_of, prompts[r], completion, position_versions)
        np.testing.assert_allclose(policy_logps[r, :n], want, atol=1e-5, rtol=0, err_msg=str(r))
        fresh = np.asarray([forward[v][r, j] for j, v in enumerate(tags)])
        if len(set(position_versions)) == 1:
            kinds["pure"] += 1
            np.testing.assert_allclose(policy_logps[r, :n], fresh, atol=1e-5, rtol=0)
        else:
            kinds["mixed"] += 1
            assert np.abs(policy_logps[r, :n] - fresh).max() > 1e-3, r
            kinds["fresh_row_swapped"] += prefill != tags[0]
    # Both kinds of rows, and a row refilled just before a swap: prefilled by the old
    # params, its first token sampled by the new ones.
    assert kinds["pure"] >= 2 and kinds["mixed"] >= 2 and kinds["fresh_row_swapped"] >= 1, kinds
    # Tokens after the first chunk come from B: they differ from what A alone samples.
    only_a = sampler(
        graphdef, params_a, *batch, jax.random.key(7), max_new_tokens=limits, temperature=1.0
    )
    assert not np.array_equal(only_a.tokens, out.tokens)


def test_bad_arguments_raise(model, sampler):
    _, batch = _prompts(3, seed=0)
    graphdef, state = nnx.split(model)
    for chunk_steps in (0, 2.0, True):
        with pytest.raises(ValueError, match=f"chunk_steps={chunk_steps!r}"):
            EpisodeSampler(sampler).sample_inflight(
                graphdef, lambda: (state, 0), *batch, jax.random.key(0), chunk_steps=chunk_steps
            )
    with pytest.raises(ValueError, match="version '1'"):
        EpisodeSampler(sampler).sample_inflight(
            graphdef, lambda: (state, "1"), *batch, jax.random.key(0), chunk_steps=2
        )
