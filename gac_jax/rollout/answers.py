"""Single answers as episodes with no environment: `AnswerRunner` is `EpisodeRunner`'s
interface (`sample`, `items`, `score`) for a task without one (countdown, GSM8K, a user's
reward function), so rollouts and evaluation take one path for every task."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from gac_jax.models import Sampler
from gac_jax.models.tokenizers import Tokenizer
from gac_jax.rollout.episodes import EpisodeRows, cut_by_length
from gac_jax.rollout.sampling import cut_at_stop, generate
from gac_jax.tasks.custom import score_group


class AnswerRunner:
    """One completion per row, cut at the stop strings, scored by the task's reward. Its
    rows have no observation, turn or tool fields (None): a single-turn rollout. `reward`
    is `task.reward` (`(completions, example) -> rewards`, guarded when the run guards it);
    a completion ends at the first of the `stop` strings it holds (`cut_at_stop`).
    """

    def __init__(self, sampler: Sampler, tokenizer: Tokenizer, reward, stop: Sequence[str] = ()):
        self.sampler = sampler
        self.tokenizer = tokenizer
        self.reward = reward
        self.stop = tuple(stop)

    def sample(self, graphdef, params_fn, prompts, examples, key, settings) -> EpisodeRows:
        """One completion per prompt (`generate`), with `EpisodeRunner.sample`'s arguments;
        `examples` are not needed."""
        del examples
        out = generate(
            self.sampler,
            graphdef,
            params_fn,
            prompts,
            key,
            pad_id=self.tokenizer.pad_id,
            settings=settings,
        )
        versions = getattr(out, "token_versions", None)
        tokens, mask = np.array(out.tokens, np.int32), np.array(out.completion_mask, bool)
        return EpisodeRows(  # Copies: `items` cuts them in place.
            tokens=tokens,
            policy_mask=mask,
            policy_logps=np.array(out.policy_logps, np.float32),
            token_versions=None if versions is None else np.asarray(versions),
            transcripts=[None] * len(out.tokens),  # Decoded by `items`, as scoring's work.
            truncated=cut_by_length(tokens, mask, self.sampler.eos_ids),  # Until a stop cut.
        )

    def items(self, rows: EpisodeRows) -> list[str]:
        """What `score` takes for each row: its completion's text, cut at a stop string
        (`cut_at_stop`); a cut row's mask is shortened in place, the tokens after it
        padded and their log-probabilities zeroed."""
        for row, mask in enumerate(rows.policy_mask):
            rows.transcripts[row], kept = cut_at_stop(
                self.tokenizer, rows.tokens[row], mask, self.stop
            )
            if kept is not mask:  # A stop string ended it.
                rows.truncated[row] = False
                rows.policy_mask[row] = kept
                rows.tokens[row, ~kept] = self.tokenizer.pad_id
                rows.policy_logps[row, ~kept] = 0.0
        return list(rows.transcripts)

    def score(self, items: Sequence[str], example):
        """The rewards of one group's completions (`score_group`: scored together)."""
        return score_group(self.reward, list(items), example)
