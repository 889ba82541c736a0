"""DAPO's overlong handling (issue #63): the soft punishment against verl's formula in
float64, filtering as the loss mask of the truncated rows, and which rows are truncated
(the length limit reached with no EOS, stop string or episode end)."""

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gac_jax.models import CharTokenizer
from gac_jax.rollout import GenerationConfig, OverlongConfig, Rollout, collate
from gac_jax.rollout.answers import AnswerRunner
from gac_jax.rollout.episodes import EpisodeRows, cut_by_length

G, L, PROMPT = 3, 8, 4


def verl_punishment(length: int, max_resp_len: int, buffer: int, factor: float) -> float:
    """verl's DAPO reward manager (`verl/workers/reward_manager/dapo.py`), as written there."""
    expected_len = max_resp_len - buffer
    exceed_len = length - expected_len
    return min(-exceed_len / buffer * factor, 0)


@given(
    st.integers(1, 64).flatmap(
        lambda limit: st.tuples(
            st.just(limit),
            st.integers(1, limit),
            st.lists(st.integers(0, limit), min_size=1, max_size=16),
        )
    ),
    st.floats(0.0, 4.0),
)
def test_the_punishment_is_verls(limit_buffer_lengths, penalty):
    limit, buffer, lengths = limit_buffer_lengths
    got = OverlongConfig(buffer=buffer, penalty=penalty).punishment(np.asarray(lengths), limit)
    want = [verl_punishment(n, limit, buffer, penalty) for n in lengths]
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * max(1.0, penalty))
    assert np.all(got >= -penalty * (1 + 1e-6))  # -penalty at the limit, no lower.
    assert not OverlongConfig(penalty=penalty).punishment(np.asarray(lengths), limit).any()


def _rollouts(seed=0):
    """Two groups with completions of every kind: short, cut by the limit, ended by EOS on
    the last column, and an episode whose context holds observation tokens."""
    rng = np.random.default_rng(seed)
    lengths = [[3, L, L], [L, 5, 1]]
    truncated = [[False, True, False], [True, False, False]]
    out = []
    for i in range(2):
        mask = np.arange(L) < np.asarray(lengths[i])[:, None]
        observed = None
        if i == 1:  # An episode: row 0's columns 2-3 are the environment's.
            observed = np.zeros((G, L), bool)
            observed[0, 2:4] = True
            mask = mask & ~observed
        out.append(
            Rollout(
                prompt_id=i,
                group_id=i,
                prompt_tokens=rng.integers(3, 60, 2).astype(np.int32),
                completion_tokens=rng.integers(3, 60, (G, L)).astype(np.int32),
                completion_mask=mask,
                behaviour_logp=np.where(mask, -rng.random((G, L)), 0).astype(np.float32),
                rewards=rng.integers(0, 2, G).astype(np.float32),
                policy_version=0,
                observation_mask=observed,
                turns=None if observed is None else np.ones(G, int),
                truncated=np.asarray(truncated[i]),
            )
        )
    return out, np.asarray(lengths).ravel(), np.asarray(truncated).ravel()


@pytest.mark.parametrize("filter_", [False, True])
@pytest.mark.parametrize(("buffer", "penalty"), [(0, 1.0), (3, 0.5), (L, 2.0)])
def test_collate_punishes_by_context_length_and_filters_truncated_rows(filter_, buffer, penalty):
    rollouts, lengths, truncated = _rollouts()
    plain = collate(rollouts, PROMPT)
    shaped = collate(rollouts, PROMPT, OverlongConfig(filter_, buffer, penalty))
    tasks = np.concatenate([r.rewards for r in rollouts]).astype(np.float64)
    if buffer:
        want = tasks + [verl_punishment(n, L, buffer, penalty) for n in lengths]
    else:
        want = tasks
    np.testing.assert_allclose(shaped["rewards"], want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(plain["rewards"], tasks)
    kept = ~truncated if filter_ else np.ones_like(truncated)
    np.testing.assert_array_equal(shaped["loss_mask"], plain["loss_mask"] & kept[:, None])
    for key in ("tokens", "attention_mask", "behaviour_logp", "group_ids", "versions"):
        np.testing.assert_array_equal(shaped[key], plain[key], err_msg=key)


def test_cut_by_length_reads_the_last_column():
    tokens = np.array([[5, 6, 7], [5, 2, 0], [5, 6, 2], [5, 9, 9]])
    context = np.array([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 1]], bool)
    # Full without EOS; ended early; EOS on the last column; full, EOS 9 of another model.
    assert cut_by_length(tokens, context, (2,)).tolist() == [True, False, False, True]
    assert cut_by_length(tokens, context, (2, 9)).tolist() == [True, False, False, False]


def test_a_stop_string_ends_a_row_even_on_its_last_token():
    tok = CharTokenizer()
    texts = ["ab;cd", "abcde", "abcd;"]  # Stopped early; cut by the limit; stopped at the end.
    tokens = np.array([tok.encode(t) for t in texts], np.int32)
    sampler = SimpleNamespace(eos_ids=(tok.eos_id,))
    mask = np.ones(tokens.shape, bool)
    rows = EpisodeRows(
        tokens=tokens,
        policy_mask=mask,
        policy_logps=np.zeros(tokens.shape, np.float32),
        token_versions=None,
        transcripts=[None] * 3,
        truncated=cut_by_length(tokens, mask, sampler.eos_ids),
    )
    assert AnswerRunner(sampler, tok, reward=None, stop=[";"]).items(rows) == [
        "ab",
        "abcde",
        "abcd",
    ]
    assert rows.truncated.tolist() == [False, True, False]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("buffer", 9, "overlong.buffer=9 must be <= max_new_tokens=8."),
        ("buffer", -1, "overlong.buffer=-1 must be an int >= 0."),
        ("penalty", -0.5, "overlong.penalty=-0.5 must be a number >= 0."),
    ],
)
def test_bad_overlong_settings_are_named_in_one_line(field, value, message):
    config = GenerationConfig(max_new_tokens=8, overlong=OverlongConfig(**{field: value}))
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        config.validate()
