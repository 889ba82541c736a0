"""`TrainBatch`: rollout groups laid out as the arrays a train step consumes."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from gac_jax.rollout import Rollout


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainBatch:
    """N = groups x G sequences of length T = prompt_length + completion length.

    Each row is the left-padded prompt followed by the completion, exactly as the sampler
    laid it out, so teacher-forced log-probabilities line up with the behaviour ones.
    """

    tokens: jax.Array  # int32 [N, T].
    attention_mask: jax.Array  # bool [N, T]: real tokens (prompt and completion).
    loss_mask: jax.Array  # bool [N, T]: completion tokens, the ones trained on.
    behaviour_logp: jax.Array  # f32 [N, T]: behaviour log-prob on completion tokens, else 0.
    rewards: jax.Array  # f32 [N].
    group_ids: jax.Array  # int32 [N]: GRPO groups (one per prompt).
    versions: jax.Array  # int32 [N]: policy version that sampled each sequence.

    @property
    def num_sequences(self) -> int:
        return int(self.tokens.shape[0])


def collate(rollouts: Sequence[Rollout], prompt_length: int) -> TrainBatch:
    """Stacks groups into a host-side (NumPy) `TrainBatch`.

    Args:
      rollouts: groups with equal group size and completion length.
      prompt_length: the left-padded prompt length (longer prompts are an error).
    """
    if not rollouts:
        raise ValueError("collate needs at least one rollout group.")
    g, l = rollouts[0].completion_tokens.shape
    rows, width = len(rollouts) * g, prompt_length + l
    tokens = np.zeros((rows, width), np.int32)
    attention = np.zeros((rows, width), bool)
    loss_mask = np.zeros((rows, width), bool)
    behaviour = np.zeros((rows, width), np.float32)
    rewards = np.zeros(rows, np.float32)
    group_ids = np.zeros(rows, np.int32)
    versions = np.zeros(rows, np.int32)
    for i, r in enumerate(rollouts):
        if r.completion_tokens.shape != (g, l):
            raise ValueError(
                f"rollout group {r.group_id} has completions of shape "
                f"{r.completion_tokens.shape}, expected {(g, l)}."
            )
        p = len(r.prompt_tokens)
        if p > prompt_length:
            raise ValueError(
                f"rollout group {r.group_id} has a {p}-token prompt, longer than "
                f"prompt_length={prompt_length}."
            )
        rows_i = slice(i * g, (i + 1) * g)
        tokens[rows_i, prompt_length - p : prompt_length] = r.prompt_tokens
        attention[rows_i, prompt_length - p : prompt_length] = True
        tokens[rows_i, prompt_length:] = np.where(r.completion_mask, r.completion_tokens, 0)
        attention[rows_i, prompt_length:] = r.completion_mask
        loss_mask[rows_i, prompt_length:] = r.completion_mask
        behaviour[rows_i, prompt_length:] = np.where(r.completion_mask, r.behaviour_logp, 0.0)
        rewards[rows_i] = r.rewards
        group_ids[rows_i] = i
        versions[rows_i] = r.policy_version
    return TrainBatch(tokens, attention, loss_mask, behaviour, rewards, group_ids, versions)
