"""`Rollout`: one GRPO group of completions, tagged with the policy version that made it."""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from gac_jax.rollout.staleness import staleness


@dataclasses.dataclass(frozen=True)
class Rollout:
    """G completions of one prompt, the atomic unit the buffer stores and the learner trains on.

    Host-side NumPy arrays, G completions of padded length L:

    Attributes:
      prompt_id: index of the prompt in its task split.
      group_id: unique id of this group (the GRPO group the advantages normalise over).
      prompt_tokens: [P] int32, the prompt (unpadded).
      completion_tokens: [G, L] int32.
      completion_mask: [G, L] bool, True on generated tokens (up to and including EOS).
      behaviour_logp: [G, L] float32, log-probability of each sampled token under the
        temperature-1 policy that sampled it (0 where masked).
      rewards: [G] float32.
      policy_version: version of the params that sampled the group (the oldest one if a
        weight update landed mid-generation, see `token_versions`).
      token_versions: optional [G, L] int32, the version that sampled each token, for
        completions that span a weight update; None when one version made everything.
      generate_seconds: wall time spent sampling the group.
      score_seconds: wall time spent computing the rewards.
      reward_failures: completions whose reward call raised or returned no number (scored
        as the run's `reward_guard.failure_score`).
      reward_timeouts: completions whose reward call timed out.
      created_at: `time.monotonic()` when the group was finished.
      observation_mask: multi-turn episodes: [G, L] bool, the environment's tokens between
        the policy's turns: context, never trained on (disjoint from `completion_mask`).
      turns: multi-turn episodes: [G] int, the policy turns that called the environment.
      tool_calls, tool_errors, tool_timeouts: environment steps of the group, those that
        raised or returned no observation, those that timed out.
      tool_seconds: summed latency of the steps that answered in time.
      truncated: [G] bool, the completions the length limit cut (every column used, no
        end of sequence, stop string or episode end); all False when not given.
    """

    prompt_id: int
    group_id: int
    prompt_tokens: np.ndarray
    completion_tokens: np.ndarray
    completion_mask: np.ndarray
    behaviour_logp: np.ndarray
    rewards: np.ndarray
    policy_version: int
    token_versions: np.ndarray | None = None
    generate_seconds: float = 0.0
    score_seconds: float = 0.0
    reward_failures: int = 0
    reward_timeouts: int = 0
    created_at: float = dataclasses.field(default_factory=time.monotonic)
    observation_mask: np.ndarray | None = None
    turns: np.ndarray | None = None
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    tool_seconds: float = 0.0
    truncated: np.ndarray | None = None

    def __post_init__(self):
        g, l = np.shape(self.completion_tokens)
        if self.truncated is None:
            object.__setattr__(self, "truncated", np.zeros(g, bool))
        expected = {"completion_mask": (g, l), "behaviour_logp": (g, l), "rewards": (g,)}
        expected["truncated"] = (g,)
        for name in ("token_versions", "observation_mask"):
            if getattr(self, name) is not None:
                expected[name] = (g, l)
        for name, shape in expected.items():
            if np.shape(getattr(self, name)) != shape:
                raise ValueError(
                    f"Rollout.{name} has shape {np.shape(getattr(self, name))}, expected {shape}."
                )
        if self.observation_mask is not None and np.any(
            self.observation_mask & self.completion_mask
        ):
            raise ValueError(
                "Rollout.observation_mask and completion_mask overlap: a token is either the "
                "policy's or the environment's."
            )
        if self.policy_version < 0:
            raise ValueError(f"Rollout.policy_version={self.policy_version} must be >= 0.")
        if self.token_versions is not None and self.completion_mask.any():
            oldest = int(np.min(self.token_versions[self.completion_mask]))
            if oldest != self.policy_version:
                raise ValueError(
                    f"Rollout.policy_version={self.policy_version} must be the oldest token "
                    f"version, {oldest}."
                )

    @property
    def group_size(self) -> int:
        return int(np.shape(self.completion_tokens)[0])

    def staleness(self, learner_version: int) -> int:
        """Policy-version gap between the learner and the oldest token of this group."""
        return staleness(learner_version, self.policy_version)
