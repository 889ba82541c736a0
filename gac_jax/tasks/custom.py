"""A researcher's own data and rewards: JSONL files, Hugging Face datasets saved to disk,
and rewards by import path.

**JSONL tasks** (``get_task("jsonl:PATH")``): one JSON object a line with the fields
``prompt`` and ``answer``, optionally ``system`` (written before the prompt, a blank line
between; under a chat template, the system message: `gac_jax.tasks.chat`), and any
others, which stay in the example and reach the reward. Splits:
``jsonl:TRAIN_PATH,TEST_PATH`` names both files; with one path, the last tenth of its
lines (at least one) is the ``test`` split and the rest ``train``.
The default reward is `gac_jax.tasks.rewards.lenient_match`.

The examples are read into memory (a list of dicts) each time a split is opened, not
prepared through tfds: the file *is* the dataset, so there is nothing to convert, no
prepared copy under ``data_dir`` that could go stale when the file is edited, and the
loop only needs ``len`` and indexing, which a list gives.

**Hugging Face datasets saved to disk** (``get_task("hf:PATH[:TRAIN[,TEST]]")``): what
``datasets.Dataset.save_to_disk`` or ``DatasetDict.save_to_disk`` wrote, with the same
columns as a JSONL file (``ds.rename_column("question", "prompt")`` first if needed).
``hf:PATH`` of a `DatasetDict` trains on its ``train`` split and evaluates on ``test``;
``hf:PATH:TRAIN,TEST`` names the splits; one split named (or a single `Dataset` at PATH)
holds out its last tenth as the test split, as a single JSONL file does. Read with
``datasets.load_from_disk`` (memory-mapped Arrow, random access, nothing copied or
converted; the optional extra ``gac_jax[datasets]``), for the same reasons as JSONL.

**Rewards by name** (`resolve_reward`): ``"package.module:function"``, a function taking
``(completion, example)`` and returning a float, or a short name of
`gac_jax.tasks.rewards.MATCHERS` (``boxed``, ``hashes``, ``answer_tag``, ``last_number``,
``lenient``). `GuardedReward` wraps one for a run, with a timeout and its failures
scored and counted (`RewardGuardConfig`).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import logging
import math
import numbers
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from gac_jax.tasks.rewards import MATCHERS

__all__ = ["GuardedReward", "RewardGuardConfig", "RewardScores", "hf_splits", "jsonl_splits",
           "load_jsonl", "resolve_reward", "score_group"]  # fmt: skip

logger = logging.getLogger(__name__)

JSONL_PREFIX = "jsonl:"
HF_PREFIX = "hf:"
REQUIRED_FIELDS = ("prompt", "answer")
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
            missing = [k for k in REQUIRED_FIELDS if k not in example]
            if missing:
                raise ValueError(f"{where}: missing field(s) {missing}.")
            for key in ("prompt", "system"):
                if key in example and not isinstance(example[key], str):
                    raise ValueError(f"{where}: field {key!r} must be a string.")
            examples.append(example)
    if not examples:
        raise ValueError(f"{os.fspath(path)}: no examples.")
    return examples


def _check_split(name: str, split: str) -> None:
    if split not in ("train", "test"):
        raise ValueError(f"Unknown split {split!r} of {name}; known: ['test', 'train'].")


def _hold_out(examples, split: str, what: str, how: str):
    """`split` of one sequence of examples: its last `TEST_FRACTION` (at least one) is
    ``test``, the rest ``train``. Lists are sliced, `datasets.Dataset`\\ s selected."""
    n = len(examples)
    if n < 2:
        raise ValueError(
            f"{what} has {n} example(s): holding out a test split needs two or more ({how})."
        )
    held_out = max(1, int(n * TEST_FRACTION))
    start, stop = (0, n - held_out) if split == "train" else (n - held_out, n)
    if isinstance(examples, list):
        return examples[start:stop]
    return examples.select(range(start, stop))


def _split(spec: str, split: str) -> list[dict[str, Any]]:
    train_path, test_path = jsonl_splits(spec)
    _check_split(f"{JSONL_PREFIX}{spec}", split)
    if test_path is not None:
        return load_jsonl(train_path if split == "train" else test_path)
    how = "or name a test file: jsonl:TRAIN_PATH,TEST_PATH"
    return _hold_out(load_jsonl(train_path), split, repr(str(train_path)), how)


def jsonl_prompt(example: Mapping[str, Any]) -> str:
    """The prompt of a JSONL example: its ``system`` text, a blank line, its ``prompt``."""
    system = example.get("system")
    return f"{system}\n\n{example['prompt']}" if system else example["prompt"]


def jsonl_messages(example: Mapping[str, Any]) -> list[dict[str, str]]:
    """The chat messages of a JSONL example: its ``system`` (if any), then its ``prompt``."""
    messages = [{"role": "user", "content": example["prompt"]}]
    system = example.get("system")
    return [{"role": "system", "content": system}, *messages] if system else messages


@dataclasses.dataclass(frozen=True)
class JsonlSource:
    """``data_source(split, data_dir=...)`` of a JSONL task (`data_dir` is unused)."""

    spec: str

    def __call__(self, split: str, *, data_dir=None) -> list[dict[str, Any]]:
        del data_dir  # The file is the data: nothing is prepared.
        return _split(self.spec, split)


def hf_splits(spec: str) -> tuple[Path, tuple[str, ...]]:
    """(directory, named splits) of ``"PATH"`` or ``"PATH:TRAIN[,TEST]"``.

    Raises:
      ValueError: if PATH is not a dataset saved by ``save_to_disk``, or the ``datasets``
        package is missing.
    """
    path, splits = Path(spec).expanduser(), ()
    if not path.is_dir() and ":" in spec:
        head, _, tail = spec.rpartition(":")
        path, splits = Path(head).expanduser(), tuple(s.strip() for s in tail.split(","))
        if len(splits) > 2 or not all(splits):
            raise ValueError(f"expected hf:PATH or hf:PATH:TRAIN[,TEST], got {spec!r}.")
    saved = ("dataset_dict.json", "state.json")
    if not any((path / name).is_file() for name in saved):
        raise ValueError(
            f"{str(path)!r} is not a dataset saved by save_to_disk (no {' or '.join(saved)})."
        )
    if importlib.util.find_spec("datasets") is None:
        raise ValueError("hf: tasks need the datasets package: pip install 'gac_jax[datasets]'.")
    return path, splits


def _load_hf(spec: str, split: str):
    import datasets

    path, splits = hf_splits(spec)
    name = f"{HF_PREFIX}{spec}"
    _check_split(name, split)
    loaded = datasets.load_from_disk(os.fspath(path))
    how = "or name a test split: hf:PATH:TRAIN,TEST"
    if isinstance(loaded, datasets.Dataset):
        if splits:
            raise ValueError(f"{name}: {str(path)!r} holds one dataset, not named splits.")
        data = _hold_out(loaded, split, repr(str(path)), how)
    else:
        names = splits or ("train", "test")
        missing = [s for s in names if s not in loaded]
        if missing:
            raise ValueError(f"{name}: no split(s) {missing}; the dataset has {sorted(loaded)}.")
        if len(names) == 2:
            data = loaded[names[0] if split == "train" else names[1]]
        else:
            data = _hold_out(loaded[names[0]], split, f"split {names[0]!r}", how)
    missing = [k for k in REQUIRED_FIELDS if k not in data.column_names]
    if missing:
        raise ValueError(
            f"{name}: no column(s) {missing} (columns: {data.column_names}); rename them "
            "before save_to_disk (Dataset.rename_column)."
        )
    return data


@dataclasses.dataclass(frozen=True)
class HfSource:
    """``data_source(split, data_dir=...)`` of a saved Hugging Face dataset (`data_dir` is
    unused): a `datasets.Dataset` (memory-mapped; ``len`` and indexing give dicts)."""

    spec: str

    def __call__(self, split: str, *, data_dir=None):
        del data_dir  # The saved dataset is the data: nothing is prepared.
        return _load_hf(self.spec, split)


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


@dataclasses.dataclass(frozen=True)
class RewardGuardConfig:
    """How a run treats its own reward function (`reward=`) when it misbehaves.

    Attributes:
      timeout: seconds one call may take; a call still running then scores
        `failure_score` and is counted in ``reward/timeouts`` (the thread is abandoned:
        Python cannot stop it).
      failure_score: the score of a call that raised, returned something that is not a
        finite number (a string such as "0.5" included), or timed out.
      max_failure_fraction: stop the run (one line, exit 1) when at least this share of a
        batch's completions failed or timed out; None never stops. The default, 1.0, stops
        a run whose reward fails on every completion of a batch, which would otherwise
        train at `failure_score` and look like a hard task.
    """

    timeout: float = 30.0
    failure_score: float = 0.0
    max_failure_fraction: float | None = 1.0

    def validate(self) -> None:
        if not (isinstance(self.timeout, int | float) and self.timeout > 0):
            raise ValueError(f"timeout={self.timeout!r} must be a number of seconds > 0.")
        if not math.isfinite(self.failure_score):
            raise ValueError(f"failure_score={self.failure_score!r} must be finite.")
        fraction = self.max_failure_fraction
        if fraction is not None and not 0 < fraction <= 1:
            raise ValueError(f"max_failure_fraction={fraction!r} must be in (0, 1] or null.")


class RewardScores(NamedTuple):
    """The scores of one group's completions, with how many calls failed or timed out."""

    rewards: np.ndarray  # [G] float32.
    failures: int
    timeouts: int


class GuardedReward:
    """A run's own reward: `function`, called with a timeout, its failures scored as
    configured and counted by kind, the first of each kind named in one warning line (the
    first call that raised with its traceback).

    Attributes:
      name: what the warnings call the reward.
      failures: calls that raised or returned no finite number, over the run.
      timeouts: calls that took longer than the timeout, over the run.
    """

    def __init__(
        self,
        function: Callable[[str, Mapping[str, Any]], float],
        name: str,
        config: RewardGuardConfig = RewardGuardConfig(),
    ):
        self.function = function
        self.name = name
        self.config = config
        self.failures = 0
        self.timeouts = 0
        self._traced = False  # Whether a call's traceback was logged.
        self._lock = threading.Lock()  # Async runs score from several worker threads.

    def __call__(self, completion: str, example: Mapping[str, Any]) -> float:
        return float(self.score_group([completion], example).rewards[0])

    def score_group(self, completions: Sequence[str], example: Mapping[str, Any]) -> RewardScores:
        """Scores `completions` of one prompt, each call in its own daemon thread against
        one deadline, so a group takes at most `timeout` however many calls hang."""
        results: list[Any] = [None] * len(completions)

        def call(i: int, completion: str) -> None:
            try:
                results[i] = ("ok", self.function(completion, example))
            except Exception as error:  # User code: any failure is scored, not raised.
                results[i] = ("error", error)

        threads = [
            threading.Thread(target=call, args=(i, c), daemon=True, name="gac_jax-reward")
            for i, c in enumerate(completions)
        ]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + self.config.timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        rewards = np.full(len(completions), self.config.failure_score, np.float32)
        failures = timeouts = 0
        for i, (thread, result) in enumerate(zip(threads, results, strict=True)):
            if thread.is_alive() or result is None:
                timeouts += 1
                self._note("timeout", f"took longer than {self.config.timeout:g} s")
                continue
            kind, value = result
            error = value if kind == "error" else None
            problem = f"raised {type(error).__name__}: {error}" if error else _not_a_score(value)
            if problem is None:
                rewards[i] = float(value)
            else:
                failures += 1
                self._note("failure", problem, error)
        return RewardScores(rewards, failures, timeouts)

    def _note(self, kind: str, problem: str, error: BaseException | None = None) -> None:
        """Counts a failure or timeout; the first of each kind is one warning line, and the
        first call that raised is logged with its traceback (the file and line that raised)."""
        counter = "timeouts" if kind == "timeout" else "failures"
        with self._lock:
            count = getattr(self, counter) + 1
            setattr(self, counter, count)
            trace = error is not None and not self._traced
            self._traced |= trace
        if count == 1 or trace:
            logger.warning(
                "reward %s %s; scored %g and counted in reward/%ss (later ones are only counted)",
                self.name, " ".join(problem.split())[:200], self.config.failure_score, kind,
                exc_info=error if trace else None,
            )  # fmt: skip


def _not_a_score(value) -> str | None:
    """Why `value` is not a reward (None if it is one): only real numbers are, a string
    that looks like one included."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real | np.number):
        return f"returned {value!r} ({type(value).__name__}), not a number"
    if not math.isfinite(float(value)):
        return f"returned {value!r}, not a finite number"
    return None


def score_group(reward, completions: Sequence[str], example: Mapping[str, Any]) -> RewardScores:
    """A group's scores under a task's reward: guarded (`GuardedReward`) or, for the
    library's own rewards, called directly."""
    if isinstance(reward, GuardedReward):
        return reward.score_group(completions, example)
    return RewardScores(np.asarray([reward(c, example) for c in completions], np.float32), 0, 0)
