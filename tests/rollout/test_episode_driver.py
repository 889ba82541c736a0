"""EpisodeSampler: multi-turn episodes whose observations are appended to a slot's cache.

References are independent of the sampler's decode loop: teacher-forced log-probs of the
whole transcript (prompt, policy turns and observations) through the decoder's plain
forward pass, and environments that record what they were asked and when.
"""

import concurrent.futures
import threading
import time

import jax
import numpy as np
import pytest
from flax import nnx

from gac_jax.models import Sampler, create_model, get_config, left_pad
from gac_jax.models.scoring import per_token_logps
from gac_jax.rollout.episode_driver import EpisodeSampler, EpisodeSettings

EOS, PAD = 2, 0
PROMPT_LEN, BUDGET, K = 6, 40, 5
ROWS, SLOTS = 6, 4  # Refills as well as turns.
# Two token ids in three end a turn: a random model ends turns often, and turns still
# run to several tokens.
TURN_END = [i for i in range(3, 128) if i % 3 != 0]


@pytest.fixture(scope="module")
def model():
    model = create_model(get_config("tiny"), seed=0)
    nnx.update(model, jax.tree.map(lambda x: x * 2.0 if x.ndim > 1 else x, nnx.state(model)))
    return model


@pytest.fixture(scope="module")
def episodes(model):
    sampler = Sampler(model.config, max_new_tokens=BUDGET, eos_ids=EOS, pad_id=PAD, slots=SLOTS)
    return EpisodeSampler(sampler)


def _prompts(seed=0):
    rng = np.random.RandomState(seed)
    prompts = [
        rng.randint(3, 100, size=rng.randint(2, PROMPT_LEN + 1)).tolist() for _ in range(ROWS)
    ]
    tokens, mask = left_pad(prompts, PAD, PROMPT_LEN)
    return np.asarray(tokens), np.asarray(mask)


def _sample(episodes, model, seed, key, respond, params_fn=None, sampling=None, **kwargs):
    """`episodes.sample` of `_prompts(seed)` with the model's params (or `params_fn`), the
    module's turn ends, K and 16 chunk steps unless `kwargs` (`EpisodeSettings` fields) say
    otherwise."""
    prompt_tokens, prompt_mask = _prompts(seed)
    graphdef, state = nnx.split(model)
    defaults = {"turn_end_ids": TURN_END, "max_observation_tokens": K, "chunk_steps": 16}
    settings = EpisodeSettings(**{**defaults, **kwargs})
    return episodes.sample(
        graphdef,
        params_fn or (lambda: (state, 0)),
        prompt_tokens,
        prompt_mask,
        jax.random.key(key),
        respond=respond,
        settings=settings,
        sampling=sampling,
    )


class Environment:
    """Answers a turn with 1..K tokens drawn from the turn's length (deterministic), after
    `delay(row)` seconds in its own thread; records every call."""

    def __init__(self, delay=lambda row: 0.0):
        self.delay = delay
        self.calls = []  # (row, transcript length, observation, called at, answered at)
        self.lock = threading.Lock()

    def observation(self, row, transcript):
        rng = np.random.RandomState(len(transcript) * 31 + row)
        return rng.randint(40, 100, size=rng.randint(1, K + 1)).tolist()

    def __call__(self, row, transcript):
        future = concurrent.futures.Future()
        called = time.monotonic()
        tokens = self.observation(row, transcript)

        def answer():
            time.sleep(self.delay(row))
            with self.lock:
                self.calls.append((row, len(transcript), tokens, called, time.monotonic()))
            future.set_result(tokens)

        threading.Thread(target=answer, daemon=True).start()
        return future


def _teacher_forced(model, prompt_tokens, prompt_mask, out):
    """log p of every transcript token under the plain forward pass of the whole row."""
    context = np.asarray(out.completion_mask) | np.asarray(out.observation_mask)
    tokens = np.concatenate([prompt_tokens, np.where(context, np.asarray(out.tokens), 0)], 1)
    mask = np.concatenate([prompt_mask, context], 1)
    graphdef, state = nnx.split(model)
    logp = jax.jit(lambda s, t, m: per_token_logps(nnx.merge(graphdef, s), t, m))(
        state, tokens, mask
    )
    return np.asarray(logp)[:, PROMPT_LEN:]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_policy_logps_equal_teacher_forced_logps_of_the_whole_transcript(
    model, episodes, temperature
):
    prompt_tokens, prompt_mask = _prompts()
    env = Environment()
    out = _sample(episodes, model, 0, 1, env, chunk_steps=4, sampling={"temperature": temperature})
    policy = np.asarray(out.completion_mask)
    observed = np.asarray(out.observation_mask)
    assert not (policy & observed).any()
    assert observed.any() and (out.turns >= 2).sum() >= 2, out.turns
    reference = _teacher_forced(model, prompt_tokens, prompt_mask, out)
    np.testing.assert_allclose(
        np.asarray(out.policy_logps)[policy], reference[policy], atol=2e-4, rtol=1e-4
    )
    # Observations carry no log-prob and no version; what the environment said, in order.
    assert np.all(np.asarray(out.policy_logps)[observed] == 0)
    assert np.all(np.asarray(out.token_versions)[observed] == -1)
    tokens = np.asarray(out.tokens)
    for row, length, said, _, _ in env.calls:
        if length + len(said) < BUDGET:  # Observations that fit were appended after the turn.
            assert tokens[row, length : length + len(said)].tolist() == said
            assert observed[row, length : length + len(said)].all()
    # Each turn that ended waiting was handed to the environment once.
    per_row = np.bincount([c[0] for c in env.calls], minlength=ROWS)
    np.testing.assert_array_equal(per_row, out.turns)
    # The context is contiguous: policy and observation tokens fill the first positions.
    context = policy | observed
    lengths = np.asarray(out.episode_lengths)
    assert all(
        context[r, : lengths[r]].all() and not context[r, lengths[r] :].any() for r in range(ROWS)
    )


def test_no_prefix_is_prefilled_again(model, episodes):
    env = Environment()
    out = _sample(episodes, model, 3, 2, env, chunk_steps=8)
    appended = int(np.asarray(out.observation_mask).any(axis=1).sum())
    assert appended and len(env.calls) >= appended
    blocks = sum(1 for row, length, said, _, _ in env.calls if length + len(said) < BUDGET)
    # Every prompt once, every observation block once: the prefixes are never fed again.
    assert out.prefill_tokens == ROWS * PROMPT_LEN + blocks * K


def test_a_slow_environment_stalls_only_its_own_slot(model, episodes):
    env = Environment(delay=lambda row: 1.0 if row == 0 else 0.0)
    out = _sample(episodes, model, 5, 3, env, chunk_steps=4)
    slow = [c for c in env.calls if c[0] == 0]
    assert slow, "row 0 never ended a turn"
    called, answered = slow[0][3], slow[0][4]
    others = [c for c in env.calls if c[0] != 0 and called < c[3] < answered]
    assert others, "no other episode went on while row 0 waited for its environment"
    assert np.asarray(out.completion_mask)[0].any()


def test_tokens_keep_non_decreasing_versions_across_turns(model, episodes):
    state = nnx.state(model)
    published = iter(range(10**6))

    def params_fn():  # A new version at every look: every chunk decodes with a newer one.
        return state, next(published)

    out = _sample(episodes, model, 7, 4, Environment(), params_fn, chunk_steps=2)
    policy = np.asarray(out.completion_mask)
    versions = np.asarray(out.token_versions)
    spanned = 0
    for r in range(ROWS):
        v = versions[r][policy[r]]
        assert np.all(v >= 0) and np.all(np.diff(v) >= 0), v
        spanned += len(np.unique(v)) > 1
    assert spanned >= 2


def test_the_turn_limit_ends_episodes_without_asking_the_environment(model, episodes):
    env = Environment()
    out = _sample(episodes, model, 9, 5, env, max_turns=2)
    assert out.turns.max() == 2 and np.all(out.turns <= 2)
    per_row = np.bincount([c[0] for c in env.calls], minlength=ROWS)
    np.testing.assert_array_equal(per_row, np.minimum(out.turns, 1))


def test_a_turn_end_that_is_also_eos_ends_the_turn_and_the_environment_ends_the_episode(
    model,
):
    """A chat template's end of turn (Qwen3's ``<|im_end|>``) is EOS too: it ends a turn,
    and the episode ends only when `respond` says None (here at the second turn)."""
    chat_eos = [i for i in range(3, 128) if i % 4 == 0]
    sampler = Sampler(model.config, max_new_tokens=BUDGET, eos_ids=chat_eos, pad_id=PAD, slots=2)
    seen = {}

    def respond(row, transcript):
        seen[row] = seen.get(row, 0) + 1
        future = concurrent.futures.Future()
        future.set_result([50, 51] if seen[row] == 1 else None)
        return future

    out = _sample(EpisodeSampler(sampler), model, 3, 8, respond, turn_end_ids=chat_eos)
    tokens, policy = np.asarray(out.tokens), np.asarray(out.completion_mask)
    observed = np.asarray(out.observation_mask)
    two_turns = 0
    for row in range(ROWS):
        ends = [c for c in np.flatnonzero(policy[row]) if tokens[row, c] in chat_eos]
        if out.turns[row] == 2:  # Ended by the environment at the second end of turn.
            two_turns += 1
            assert len(ends) == 2 and ends[1] == np.flatnonzero(policy[row] | observed[row])[-1]
            np.testing.assert_array_equal(tokens[row, ends[0] + 1 : ends[0] + 3], [50, 51])
            assert observed[row, ends[0] + 1 : ends[0] + 3].all()
        else:  # The token budget ran out first.
            assert out.turns[row] < 2 and len(ends) == out.turns[row]
    assert two_turns >= ROWS // 2, out.turns


def test_bad_arguments_raise_one_line(model, episodes):
    with pytest.raises(ValueError, match="turn_end_ids is empty"):
        _sample(episodes, model, 0, 0, Environment(), turn_end_ids=[])
    with pytest.raises(ValueError, match="holds an empty sequence"):
        _sample(episodes, model, 0, 0, Environment(), turn_end_ids=[[3, 4], []])


def test_an_observation_longer_than_k_is_refused_not_cut(model):
    """The driver cuts nothing: an observation's cut is its producer's (the episode runner
    keeps a chat template's frame), so one over K tokens is an error naming both."""

    def flood(row, transcript):
        future = concurrent.futures.Future()
        future.set_result(list(range(40, 40 + K + 1)))
        return future

    sampler = Sampler(model.config, max_new_tokens=BUDGET, eos_ids=EOS, pad_id=PAD, slots=SLOTS)
    with pytest.raises(
        ValueError, match=f"observation of {K + 1} tokens; max_observation_tokens={K}"
    ):
        _sample(EpisodeSampler(sampler), model, 11, 6, flood)


def test_an_empty_observation_appends_nothing_and_the_episode_goes_on(model, episodes):
    def silent(row, transcript):
        future = concurrent.futures.Future()
        future.set_result([])
        return future

    out = _sample(episodes, model, 11, 6, silent, chunk_steps=4)
    assert not np.asarray(out.observation_mask).any()
    assert (out.turns >= 2).any(), out.turns  # Turns went on after an empty reply.


def test_a_turn_ends_where_the_policy_writes_a_turn_end_sequence(model, episodes):
    """Turn ends of two tokens (every pair of multiples of 3) beside one of one token (4):
    each turn ends at the first place its policy tokens end with one of them, never before,
    and a pair never spans an observation."""
    pairs = [[a, b] for a in range(3, 128, 3) for b in range(3, 128, 3)]
    out = _sample(episodes, model, 4, 9, Environment(), turn_end_ids=[*pairs, 4])
    tokens, policy = np.asarray(out.tokens), np.asarray(out.completion_mask)
    observed = np.asarray(out.observation_mask)

    def ends(turn, i):  # Whether turn[: i + 1] ends with a turn end (0 is in no pair).
        pair = i >= 1 and all(t > 0 and t % 3 == 0 for t in turn[i - 1 : i + 1])
        return pair or turn[i] == 4

    pair_ends = 0
    for row in range(ROWS):
        columns = np.flatnonzero(policy[row] | observed[row])
        runs = np.split(columns, np.flatnonzero(np.diff(observed[row][columns])) + 1)
        turns = [tokens[row, run] for run in runs if policy[row, run[0]]]
        for index, turn in enumerate(turns):
            first = next((i for i in range(len(turn)) if ends(turn, i)), None)
            if index < len(turns) - 1:  # Answered: it ended exactly at its first turn end.
                assert first == len(turn) - 1, (row, turn)
                pair_ends += turn[-1] != 4
            else:  # The last turn ended on EOS, the budget, or a turn end at its end.
                assert first is None or first == len(turn) - 1, (row, turn)
    assert pair_ends >= 3 and out.turns.sum() >= ROWS
