"""A researcher's own data and rewards: JSONL tasks and rewards by import path.

**JSONL tasks** (``get_task("jsonl:PATH")``): one JSON object a line with the fields
``prompt`` and ``answer``, optionally ``system`` (written before the prompt, a blank line
between; no chat template is applied here), and any others, which stay in the example and
reach the reward. Splits: ``jsonl:TRAIN_PATH,TEST_PATH`` names both files; with one path,
the last tenth of its lines (at least one) is the ``test`` split and the rest ``train``.
The default reward is `gac_jax.tasks.rewards.lenient_match`.

The examples are read into memory (a list of dicts) each time a split is opened, not
prepared through tfds: the file *is* the dataset, so there is nothing to convert, no
prepared copy under ``data_dir`` that could go stale when the file is edited, and the
loop only needs ``len`` and indexing, which a list gives.

**Rewards by name** (`resolve_reward`): ``"package.module:function"``, a function taking
``(completion, example)`` and returning a float, or a short name of
`gac_jax.tasks.rewards.MATCHERS` (``boxed``, ``hashes``, ``answer_tag``, ``last_number``,
``lenient``). `GuardedReward` wraps one for a run: a call that raises (or returns
something that is not a finite number) counts as 0.0, and the first such failure is logged
with its traceback, the later ones only counted.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import math
import os
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from gac_jax.tasks.rewards import MATCHERS, lenient_match

__all__ = ["GuardedReward", "load_jsonl", "jsonl_splits", "resolve_reward"]

logger = logging.getLogger(__name__)

JSONL_PREFIX = "jsonl:"
# Share of a single file held out as the test split (its last lines).
TEST_FRACTION = 0.1


def jsonl_splits(spec: str) -> tuple[Path, Path | None]:
    """(train file, test file or None) of ``"TRAIN_PATH"`` or ``"TRAIN_PATH,TEST_PATH"``.

    Raises:
      ValueError: if a file does not exist.
    """
    parts = [p.strip() for p in spec.split(",")]
    if len(parts) > 2 or not all(parts):
        raise ValueError(f"expected jsonl:TRAIN_PATH or jsonl:TRAIN_PATH,TEST_PATH, got {spec!r}.")
    paths = [Path(p).expanduser() for p in parts]
    for path in paths:
        if not path.is_file():
            raise ValueError(f"no JSONL file {str(path)!r}.")
    return paths[0], paths[1] if len(paths) == 2 else None


def load_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The examples of a JSONL task file, every field kept.

    Raises:
      ValueError: naming the file and line of a line that is not a JSON object with a
        string ``prompt`` and an ``answer`` (``system``, if present, a string).
    """
    examples = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{os.fspath(path)}:{number}"
            try:
                example = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{where}: not JSON ({error}).") from None
            if not isinstance(example, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(example).__name__}.")
            missing = [k for k in ("prompt", "answer") if k not in example]
            if missing:
                raise ValueError(f"{where}: missing field(s) {missing}.")
            for key in ("prompt", "system"):
                if key in example and not isinstance(example[key], str):
                    raise ValueError(f"{where}: field {key!r} must be a string.")
            examples.append(example)
    if not examples:
        raise ValueError(f"{os.fspath(path)}: no examples.")
    return examples


def _split(spec: str, split: str) -> list[dict[str, Any]]:
    train_path, test_path = jsonl_splits(spec)
    if split not in ("train", "test"):
        raise ValueError(f"Unknown split {split!r} of jsonl:{spec}; known: ['test', 'train'].")
    if test_path is not None:
        return load_jsonl(train_path if split == "train" else test_path)
    examples = load_jsonl(train_path)
    if len(examples) < 2:
        raise ValueError(
            f"{str(train_path)!r} has one example: a single file needs two or more to hold "
            "out a test split (or name a test file: jsonl:TRAIN_PATH,TEST_PATH)."
        )
    held_out = max(1, int(len(examples) * TEST_FRACTION))
    return examples[:-held_out] if split == "train" else examples[-held_out:]


def jsonl_prompt(example: Mapping[str, Any]) -> str:
    """The prompt of a JSONL example: its ``system`` text, a blank line, its ``prompt``."""
    system = example.get("system")
    return f"{system}\n\n{example['prompt']}" if system else example["prompt"]


@dataclasses.dataclass(frozen=True)
class JsonlSource:
    """``data_source(split, data_dir=...)`` of a JSONL task (`data_dir` is unused)."""

    spec: str

    def __call__(self, split: str, *, data_dir=None) -> list[dict[str, Any]]:
        del data_dir  # The file is the data: nothing is prepared.
        return _split(self.spec, split)


def resolve_reward(spec: str) -> Callable[[str, Mapping[str, Any]], float]:
    """The reward function `spec` names: a `MATCHERS` short name or ``"module:function"``.

    Raises:
      ValueError: one line saying why `spec` names no callable.
    """
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"expected a reward name or 'package.module:function', got {spec!r}.")
    if spec in MATCHERS:
        return MATCHERS[spec]
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(
            f"{spec!r} is neither a built-in reward ({', '.join(MATCHERS)}) nor "
            "'package.module:function'."
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # ImportError, or the module's own error on import
        raise ValueError(
            f"cannot import module {module_name!r} ({type(error).__name__}: {error})."
        ) from None
    function: Any = module
    for name in attribute.split("."):
        try:
            function = getattr(function, name)
        except AttributeError:
            raise ValueError(f"module {module_name!r} has no attribute {attribute!r}.") from None
    if not callable(function):
        raise ValueError(f"{spec!r} is not callable.")
    return function


class GuardedReward:
    """A run's reward: `function`, with failures counted as 0.0 and logged once.

    Attributes:
      name: what the log line calls the reward.
      failures: calls that raised or returned no finite number.
    """

    def __init__(self, function: Callable[[str, Mapping[str, Any]], float], name: str):
        self.function = function
        self.name = name
        self.failures = 0
        self._lock = threading.Lock()  # Async runs score from several worker threads.

    def __call__(self, completion: str, example: Mapping[str, Any]) -> float:
        try:
            value = float(self.function(completion, example))
            if not math.isfinite(value):
                raise ValueError(f"returned {value}, not a finite number")
            return value
        except Exception:
            with self._lock:
                self.failures += 1
                first = self.failures == 1
            if first:
                logger.warning(
                    "reward %s failed (counted as 0.0; later failures are not logged) on "
                    "completion %r",
                    self.name,
                    completion[:200],
                    exc_info=True,
                )
            return 0.0


def default_reward() -> Callable[[str, Mapping[str, Any]], float]:
    """The reward of a JSONL task unless the run names one."""
    return lenient_match
