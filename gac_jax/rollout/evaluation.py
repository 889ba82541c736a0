"""Held-out evaluation of a policy on a task: greedy pass@1 and sampled pass@k."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from gac_jax.models.tokenizers import Tokenizer
from gac_jax.rollout.answers import AnswerRunner
from gac_jax.rollout.episodes import EpisodeRunner
from gac_jax.rollout.sampling import SampleSettings, encode_prompt
from gac_jax.tasks import Task


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    r"""Unbiased pass@k from n samples with c correct (Chen et al., arXiv 2107.03374, Eq. 1):
    :math:`1 - \binom{n-c}{k} / \binom{n}{k}`."""
    if not 1 <= k <= num_samples:
        raise ValueError(f"k={k} must lie in [1, num_samples={num_samples}].")
    if num_samples - num_correct < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(num_samples - num_correct + 1, num_samples + 1)))


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    """How much a held-out evaluation samples (`evaluate_policy`).

    Attributes:
      prompt_length: prompts are left-padded to it.
      num_problems: how many problems (the first of the split).
      num_samples: n samples per problem at temperature 1; pass@k for k = 1 and n.
      batch_rows: most rows per sampler call.
      progress: told each sampler call as it starts (a long evaluation says where it is).
    """

    prompt_length: int
    num_problems: int
    num_samples: int = 8
    batch_rows: int = 256
    progress: Callable[[str], None] | None = None


def evaluate_policy(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    runner: EpisodeRunner | AnswerRunner,
    task: Task,
    examples: Sequence[Any],
    tokenizer: Tokenizer,
    settings: EvalSettings,
    *,
    key: jax.Array,
) -> dict[str, float]:
    """Greedy accuracy, mean sampled reward and pass@1 / pass@k on the first problems.

    Args:
      graphdef, params: the policy.
      runner: how a sample is made and scored, as the rollouts do
        (`TaskGroupGenerator.runner`): an `AnswerRunner` or an `EpisodeRunner`. Its sampler
        may have any `max_new_tokens`.
      task, examples, tokenizer: the task and its held-out split.
      settings: how many problems and samples (`EvalSettings`).
      key: sampling key.

    Returns:
      `{"greedy_accuracy", "sampled_reward", "pass@1", f"pass@{n}"}`.
    """
    prompt_length, num_samples = settings.prompt_length, settings.num_samples
    num_problems = min(settings.num_problems, len(examples))
    if num_problems < 1:
        raise ValueError(f"num_problems={num_problems} must be >= 1 (split has {len(examples)}).")
    problems = [examples[i] for i in range(num_problems)]
    prompts = [
        encode_prompt(tokenizer, task.prompt(ex), prompt_length, f"test problem {i}")
        for i, ex in enumerate(problems)
    ]

    def rewards_of(r: int, temperature: float, call_key) -> np.ndarray:
        """[problems, r] rewards of r samples a problem at `temperature`."""
        rows = [p for p in prompts for _ in range(r)]
        row_examples = [ex for ex in problems for _ in range(r)]
        items = []
        for start in range(0, len(rows), settings.batch_rows):
            chunk = slice(start, start + settings.batch_rows)
            if settings.progress is not None:
                what = "greedy answers" if temperature == 0 else f"{r} samples a problem"
                end = min(start + settings.batch_rows, len(rows))
                settings.progress(f"{what}: rows {start + 1}-{end} of {len(rows)}")
            call_key, sub = jax.random.split(call_key)
            sampling = SampleSettings(prompt_length, {"temperature": temperature})
            out = runner.sample(
                graphdef, lambda: (params, 0), rows[chunk], row_examples[chunk], sub, sampling
            )
            items += runner.items(out)
        # Each problem's samples scored together, as training scores a group (a run's
        # own reward then gets one deadline per problem, not one per completion).
        return np.stack(
            [runner.score(items[i * r : (i + 1) * r], ex).rewards for i, ex in enumerate(problems)]
        )

    greedy_key, sample_key = jax.random.split(key)
    greedy = rewards_of(1, 0.0, greedy_key)[:, 0]
    sampled = rewards_of(num_samples, 1.0, sample_key)
    correct = (sampled >= 1.0).sum(axis=1)
    return {
        "greedy_accuracy": float(np.mean(greedy >= 1.0)),
        "sampled_reward": float(np.mean(sampled)),
        "pass@1": float(np.mean([pass_at_k(num_samples, int(c), 1) for c in correct])),
        f"pass@{num_samples}": float(
            np.mean([pass_at_k(num_samples, int(c), num_samples) for c in correct])
        ),
    }
