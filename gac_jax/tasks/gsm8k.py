"""GSM8K (Cobbe et al., arXiv 2110.14168): prompt and reward.

The data comes from `gac_jax.tasks.builders.Gsm8k`, tfds's ``gsm8k`` builder extended to
prepare from the original release files offline. Each example has ``question``,
``answer`` (the worked solution ending in ``#### N``), ``annotation`` (the solution
without that line) and ``short_answer`` (N, e.g. ``"1,080"`` or ``"-3"``). Offline, the
release files `GSM8K_FILES` go in `gsm8k_manual_dir`, which the CLI checks
(`require_gsm8k_offline`) before anything could try a download.
"""

from __future__ import annotations

import os
from pathlib import Path

from tensorflow_datasets.core.utils import file_utils as _tfds_file_utils
from tensorflow_datasets.text.gsm8k import gsm8k as _tfds_gsm8k

from gac_jax.tasks.rewards import DEFAULT_REL_TOL, numeric_reward

__all__ = ["GSM8K_FILES", "format_prompt", "gsm8k_manual_dir", "gsm8k_reward",
           "require_gsm8k_offline"]  # fmt: skip

#: The release files the offline builder reads, by split.
GSM8K_FILES = {"train": "train.jsonl", "test": "test.jsonl"}


def format_prompt(question: str) -> str:
    """The task prompt: ``"Question: <question>\\nAnswer: "``."""
    return f"Question: {question.strip()}\nAnswer: "


def gsm8k_reward(completion: str, short_answer, *, rel_tol: float = DEFAULT_REL_TOL) -> float:
    """`gac_jax.tasks.rewards.numeric_reward` against `short_answer`, the gold number as in
    the ``short_answer`` field (e.g. ``"1,080"``): the gold solution text (``#### N``) and
    the bare number both score 1.0."""
    return numeric_reward(completion, short_answer, rel_tol=rel_tol)


def _gsm8k_dirs(data_dir: str | os.PathLike | None) -> tuple[Path, Path]:
    """``(data_dir root, prepared dataset dir)`` as `gac_jax.tasks.builders.Gsm8k` resolves
    them (tfds's default data dir, or the one GSM8K is already prepared in, when `data_dir`
    is None)."""
    root, dataset_dir = _tfds_file_utils.get_data_dir_and_dataset_dir(
        given_data_dir=None if data_dir is None else os.fspath(data_dir),
        builder_name=_tfds_gsm8k.Gsm8k.name,
        config_name=None,
        version=_tfds_gsm8k.Gsm8k.VERSION,
    )
    return Path(root), Path(dataset_dir)


def gsm8k_manual_dir(data_dir: str | os.PathLike | None = None) -> Path:
    """Where the GSM8K release files go for offline preparation: tfds's manual directory,
    ``<data_dir>/downloads/manual`` (``~/tensorflow_datasets/downloads/manual`` by default,
    or under ``$TFDS_DATA_DIR``)."""
    return _gsm8k_dirs(data_dir)[0] / "downloads" / "manual"


def require_gsm8k_offline(data_dir: str | os.PathLike | None = None) -> None:
    """Checks that GSM8K is prepared in `data_dir` or that `gsm8k_manual_dir` holds the
    release files, so it can be read without a download. Only paths are checked, so a
    machine without network fails at once (FileNotFoundError, one line naming the
    directory and the missing files) rather than after tfds's download retries."""
    _, dataset_dir = _gsm8k_dirs(data_dir)
    if (dataset_dir / "dataset_info.json").is_file():
        return
    manual_dir = gsm8k_manual_dir(data_dir)
    missing = [f for f in GSM8K_FILES.values() if not (manual_dir / f).is_file()]
    if missing:
        raise FileNotFoundError(
            f"task=gsm8k: GSM8K is not prepared and {' and '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not in "
            f"{manual_dir}: copy the release files train.jsonl and test.jsonl there (from "
            "github.com/openai/grade-school-math, grade_school_math/data), or set data_dir= "
            "to a directory whose downloads/manual holds them."
        )
