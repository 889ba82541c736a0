"""Single-answer rollouts as episodes with no environment: `AnswerRunner`.

A task without an environment (countdown, GSM8K, a user's reward function) samples one
completion per row, cuts it at the run's stop strings (`cut_at_stop`) and scores a group
with the task's reward. `AnswerRunner` does that behind `EpisodeRunner`'s interface
(`sample` -> `EpisodeRows`, `items`, `score`, `scores`), so the rollout generator
(`TaskGroupGenerator`) and the evaluation (`evaluate_policy`) have one path for every task;
the rows it returns have no observation, turn or tool fields (None), which is how a
rollout says it is single-turn.

Sampling is `generate`'s: the sampler's one on-device program, or its in-flight chunks
when `inflight` (the newest params at every `chunk_steps` decode steps).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from gac_jax.models import Sampler
from gac_jax.models.tokenizers import Tokenizer
from gac_jax.rollout.episodes import EpisodeRows
from gac_jax.rollout.sampling import SampleSettings, cut_at_stop, generate
from gac_jax.tasks.custom import score_group


class AnswerRunner:
    """One completion per row, scored by the task's reward.

    Args:
      sampler: the run's `Sampler`.
      tokenizer: decodes the completions.
      reward: the task's reward (`task.reward`: `(completions, example) -> rewards`, the run's
        guard around it when it has one).
      stop: stop strings: a completion ends at the first it holds (`cut_at_stop`).
    """

    def __init__(self, sampler: Sampler, tokenizer: Tokenizer, reward, stop: Sequence[str] = ()):
        self.sampler = sampler
        self.tokenizer = tokenizer
        self.reward = reward
        self.stop = tuple(stop)

    def sample(
        self,
        graphdef,
        params_fn: Callable[[], tuple[Any, int]],
        prompts: Sequence[Sequence[int]],
        examples: Sequence[Mapping[str, Any]],
        key,
        settings: SampleSettings,
    ) -> EpisodeRows:
        """One completion per prompt (`examples` are not needed to sample one); in flight
        (`settings.inflight`) the sampler asks `params_fn` before its first chunk and again
        every `chunk_steps` decode steps, else it is asked once."""
        del examples
        out = generate(
            self.sampler, graphdef, params_fn, prompts, key,
            pad_id=self.tokenizer.pad_id, settings=settings,
        )  # fmt: skip
        tokens = np.array(out.tokens, np.int32)
        mask = np.array(out.completion_mask, bool)
        logps = np.array(out.policy_logps, np.float32)
        versions = getattr(out, "token_versions", None)
        return EpisodeRows(
            tokens=tokens,
            policy_mask=mask,
            policy_logps=logps,
            token_versions=None if versions is None else np.asarray(versions),
            transcripts=[None] * len(tokens),  # Decoded and cut when scored (`_cut`).
        )

    def _cut(self, rows: EpisodeRows, row_slice: slice) -> None:
        """Decodes the rows of `row_slice` not yet decoded into `rows.transcripts`; a row that
        holds a stop string is cut in place (mask shortened, the tokens after it padded,
        their log-probabilities zeroed). Done at scoring, so that its time is scoring's."""
        for row in range(*row_slice.indices(len(rows.tokens))):
            if rows.transcripts[row] is not None:
                continue
            mask = rows.policy_mask[row]
            text, kept = cut_at_stop(self.tokenizer, rows.tokens[row], mask, self.stop)
            if not np.array_equal(kept, mask):
                rows.policy_mask[row] = kept
                rows.tokens[row, ~kept] = self.tokenizer.pad_id
                rows.policy_logps[row, ~kept] = 0.0
            rows.transcripts[row] = text

    def items(self, rows: EpisodeRows) -> list[str]:
        """What `score` takes for each row: its completion's text (cut at a stop string)."""
        self._cut(rows, slice(None))
        return list(rows.transcripts)

    def score(self, items: Sequence[str], example):
        """The rewards of one group's completions (`score_group`: scored together)."""
        return score_group(self.reward, list(items), example)

    def scores(self, rows: EpisodeRows, row_slice: slice, example):
        """The rewards of the rows in `row_slice` (one group), cut at the stop strings."""
        self._cut(rows, row_slice)
        return self.score(rows.transcripts[row_slice], example)
