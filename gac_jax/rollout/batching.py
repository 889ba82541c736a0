"""`collate`: rollout groups laid out as the host-side arrays a train step consumes.

It returns a plain dict keyed by `gac_jax.learner.TrainBatch`'s fields
(`TrainBatch(**collate(...))`), so neither package imports the other (DESIGN.md). The
module is not named `collate`: the function `gac_jax.rollout.collate` would shadow it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from gac_jax._validation import check_int
from gac_jax.rollout.record import Rollout

# The keys of `collate`'s dict, in `TrainBatch`'s field order.
BATCH_KEYS = (
    "tokens",
    "attention_mask",
    "loss_mask",
    "behaviour_logp",
    "rewards",
    "group_ids",
    "versions",
)


@dataclasses.dataclass(frozen=True)
class OverlongConfig:
    """DAPO's overlong reward shaping (Yu et al., arXiv 2503.14476, Sec. 3.4), applied by
    `collate`: the rollouts keep the task's rewards; the learner's batch (and its
    ``reward`` and ``accuracy``) holds the shaped ones.

    Attributes:
      filter: overlong filtering: a completion the length limit cut (`Rollout.truncated`)
        is not trained on (none of its tokens is in the loss, and ``response_length``
        counts it as 0); its reward still counts in its group's baseline.
      buffer: soft overlong punishment: a completion of l tokens (policy and observation)
        longer than L - `buffer`, L = `max_new_tokens`, gets
        ``-penalty * (l - (L - buffer)) / buffer`` added to its reward, ``-penalty`` at L
        (verl's DAPO reward manager, ``overlong_buffer.len``); 0 turns it off.
      penalty: the punishment at the limit (verl's ``overlong_buffer.penalty_factor``).
    """

    filter: bool = False
    buffer: int = 0
    penalty: float = 1.0

    def validate(self, max_new_tokens: int) -> None:
        """Raises ValueError naming a bad field (`max_new_tokens` bounds `buffer`)."""
        check_int("overlong.buffer", self.buffer, 0)
        if self.buffer > max_new_tokens:
            raise ValueError(
                f"overlong.buffer={self.buffer} must be <= max_new_tokens={max_new_tokens}."
            )
        if isinstance(self.penalty, bool) or not self.penalty >= 0:
            raise ValueError(f"overlong.penalty={self.penalty!r} must be a number >= 0.")

    def punishment(self, lengths: np.ndarray, limit: int) -> np.ndarray:
        """[N] float32, the (non-positive) reward added to completions of `lengths` tokens
        under a limit of `limit` tokens."""
        if not self.buffer:
            return np.zeros(np.shape(lengths), np.float32)
        over = (np.asarray(lengths) - (limit - self.buffer)) / self.buffer
        return (-self.penalty * np.clip(over, 0.0, 1.0)).astype(np.float32)


def collate(
    rollouts: Sequence[Rollout], prompt_length: int, overlong: OverlongConfig = OverlongConfig()
) -> dict[str, np.ndarray]:
    """Stacks groups into N = groups x G rows of length T = prompt_length + completion length.

    Each row is the left-padded prompt followed by the completion, exactly as the sampler
    laid it out, so teacher-forced log-probabilities line up with the behaviour ones. The
    groups share group size and completion length; longer prompts are an error.

    Returns a dict with the keys `BATCH_KEYS`: tokens int32 [N, T] (0 where padded);
    attention_mask bool [N, T] (prompt, completion, observations); loss_mask bool [N, T]
    (the policy's tokens trained on: no observation, no truncated completion under
    `overlong.filter`); behaviour_logp float32 [N, T] (0 off the completion); rewards
    float32 [N] (with `overlong`'s punishment); group_ids int32 [N] (the rollout's index
    in `rollouts`); versions int32 [N] (the policy version of each row's group).
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
        context = r.completion_mask
        if r.observation_mask is not None:
            context = context | r.observation_mask
        tokens[rows_i, prompt_length:] = np.where(context, r.completion_tokens, 0)
        attention[rows_i, prompt_length:] = context
        trained = ~(overlong.filter & r.truncated)
        loss_mask[rows_i, prompt_length:] = r.completion_mask & trained[:, None]
        behaviour[rows_i, prompt_length:] = np.where(r.completion_mask, r.behaviour_logp, 0.0)
        rewards[rows_i] = r.rewards + overlong.punishment(context.sum(axis=1), l)
        group_ids[rows_i] = i
        versions[rows_i] = r.policy_version
    arrays = (tokens, attention, loss_mask, behaviour, rewards, group_ids, versions)
    return dict(zip(BATCH_KEYS, arrays, strict=True))
