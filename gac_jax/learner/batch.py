"""`TrainBatch`: rollout groups laid out as the arrays a train step consumes.

`gac_jax.rollout.collate` builds its fields from rollout groups, as a dict keyed by the
field names: `TrainBatch(**collate(rollouts, prompt_length))`. The learner does not import
rollout (DESIGN.md: arrows point down only).
"""

from __future__ import annotations

import dataclasses

import jax


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
