"""`collate`: rollout groups as the host-side arrays of a train step, keyed by name."""

import numpy as np
import pytest

from gac_jax.rollout import BATCH_KEYS, Rollout, collate

G, L, PROMPT = 4, 6, 8


def _rollouts(num_groups=2, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(num_groups):
        mask = np.ones((G, L), bool)
        mask[1, 3:] = False  # A completion that ended early.
        out.append(
            Rollout(
                prompt_id=i,
                group_id=10 + i,
                prompt_tokens=rng.integers(3, 60, 3 + i % 3).astype(np.int32),
                completion_tokens=rng.integers(3, 60, (G, L)).astype(np.int32),
                completion_mask=mask,
                behaviour_logp=(-3.0 * rng.random((G, L))).astype(np.float32),
                rewards=rng.integers(0, 2, G).astype(np.float32),
                policy_version=5 + i,
            )
        )
    return out


def test_collate_returns_the_named_arrays_with_their_dtypes():
    batch = collate(_rollouts(2), PROMPT)
    assert tuple(batch) == BATCH_KEYS
    n, t = 2 * G, PROMPT + L
    expected = {
        "tokens": (np.int32, (n, t)),
        "attention_mask": (np.bool_, (n, t)),
        "loss_mask": (np.bool_, (n, t)),
        "behaviour_logp": (np.float32, (n, t)),
        "rewards": (np.float32, (n,)),
        "group_ids": (np.int32, (n,)),
        "versions": (np.int32, (n,)),
    }
    for key, (dtype, shape) in expected.items():
        assert isinstance(batch[key], np.ndarray), key
        assert batch[key].dtype == dtype and batch[key].shape == shape, key


def test_collate_lays_out_prompt_then_completion():
    rollouts = _rollouts(2)
    batch = collate(rollouts, PROMPT)
    for i, r in enumerate(rollouts):
        p = len(r.prompt_tokens)
        for j in range(G):
            row = i * G + j
            # Row by row, written out: left padding, prompt, then the masked completion.
            want_tokens = [0] * (PROMPT - p) + list(r.prompt_tokens)
            want_tokens += [
                int(x) if m else 0
                for x, m in zip(r.completion_tokens[j], r.completion_mask[j], strict=True)
            ]
            assert batch["tokens"][row].tolist() == want_tokens
            want_attention = [False] * (PROMPT - p) + [True] * p + r.completion_mask[j].tolist()
            assert batch["attention_mask"][row].tolist() == want_attention
            assert (
                batch["loss_mask"][row].tolist() == [False] * PROMPT + r.completion_mask[j].tolist()
            )
            want_logp = [0.0] * PROMPT + [
                float(x) if m else 0.0
                for x, m in zip(r.behaviour_logp[j], r.completion_mask[j], strict=True)
            ]
            np.testing.assert_array_equal(batch["behaviour_logp"][row], want_logp)
            assert batch["rewards"][row] == r.rewards[j]
            assert batch["group_ids"][row] == i  # Numbered from 0, not by group_id.
            assert batch["versions"][row] == r.policy_version
    assert not batch["loss_mask"][1, PROMPT + 3 :].any()  # The completion that ended early.


def test_collate_rejects_bad_groups():
    rollouts = _rollouts(2)
    with pytest.raises(ValueError, match="longer than prompt_length=2"):
        collate(rollouts, 2)
    with pytest.raises(ValueError, match="at least one"):
        collate([], PROMPT)
    short = Rollout(
        prompt_id=0,
        group_id=99,
        prompt_tokens=np.ones(2, np.int32),
        completion_tokens=np.ones((G, L - 1), np.int32),
        completion_mask=np.ones((G, L - 1), bool),
        behaviour_logp=np.zeros((G, L - 1), np.float32),
        rewards=np.zeros(G, np.float32),
        policy_version=0,
    )
    with pytest.raises(ValueError, match="group 99 has completions of shape"):
        collate([rollouts[0], short], PROMPT)
