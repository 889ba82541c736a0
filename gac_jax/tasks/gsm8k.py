"""GSM8K (Cobbe et al., arXiv 2110.14168): prompt and reward.

The data comes from `gac_jax.tasks.builders.Gsm8k`, tfds's ``gsm8k`` builder extended to
prepare from the original release files offline. Each example has ``question``,
``answer`` (the worked solution ending in ``#### N``), ``annotation`` (the solution
without that line) and ``short_answer`` (N, e.g. ``"1,080"`` or ``"-3"``).
"""

from __future__ import annotations

from gac_jax.tasks.rewards import DEFAULT_REL_TOL, numeric_reward

__all__ = ["GSM8K_FILES", "format_prompt", "gsm8k_reward"]

#: The release files the offline builder reads, by split.
GSM8K_FILES = {"train": "train.jsonl", "test": "test.jsonl"}


def format_prompt(question: str) -> str:
    """The task prompt: ``"Question: <question>\\nAnswer: "``."""
    return f"Question: {question.strip()}\nAnswer: "


def gsm8k_reward(completion: str, short_answer, *, rel_tol: float = DEFAULT_REL_TOL) -> float:
    """1.0 if the final number of `completion` equals the gold answer, else 0.0.

    The final number is found by `gac_jax.tasks.rewards.extract_numeric_answer`
    (``#### N``, ``\\boxed{N}``, ``answer is N``, else the last number), so both the gold
    solution text and the bare number score 1.0.

    Args:
      completion: model output.
      short_answer: the gold number, as in the ``short_answer`` field (e.g. ``"1,080"``).
      rel_tol: relative tolerance of the comparison.

    Returns:
      1.0 or 0.0. Never raises on any completion.
    """
    return numeric_reward(completion, short_answer, rel_tol=rel_tol)
