"""tfds dataset builders: the embedded synthetic tasks and GSM8K.

* `Countdown`, `Arithmetic` and `Calculator` generate their data locally, from a seed in
  their `tfds.core.BuilderConfig`: one seeded stream of problems, duplicates removed
  (``37+48`` and ``48+37`` are one problem), whose first ``num_test`` distinct problems
  form ``test`` and the next ``num_train`` ``train``. So the splits are disjoint and
  growing ``num_train`` leaves the test split unchanged.
* `Gsm8k` is tfds's own ``gsm8k`` builder that also prepares offline from the original
  JSONL release files.

All write array_record files, read back with ``builder.as_data_source(split=...)``;
`prepare_source` does both steps.

Example::

    builder = Countdown(config="n3_max20", data_dir="/tmp/tfds")
    test = prepare_source(builder, "test")
    test[0]  # e.g. {'numbers': array([3, 5, 7], dtype=int32), 'target': 22, 'solution': b'5*3+7'}
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
import sys
from collections.abc import Hashable, Iterator, Sequence
from pathlib import Path

import numpy as np
import tensorflow_datasets as tfds
from tensorflow_datasets.text.gsm8k import gsm8k as _tfds_gsm8k

from gac_jax._locks import exclusive_lock
from gac_jax._quiet import absl_records_dropped
from gac_jax.tasks import arithmetic, calculator, countdown
from gac_jax.tasks.gsm8k import GSM8K_FILES

__all__ = ["Arithmetic", "ArithmeticConfig", "Countdown", "CountdownConfig", "Gsm8k",
           "prepare_source"]  # fmt: skip

_FILE_FORMAT = "array_record"


def _unprepared_notice(record: logging.LogRecord) -> bool:
    """tfds's "Variant folder ... has no dataset_info.json" warning, logged for a dataset
    not prepared yet: on a first run the expected state, not a problem."""
    return record.msg == "Variant folder %s has no %s" and "dataset_info" in str(record.args)


class _LocalBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Shared by the synthetic builders. A subclass states its `DESCRIPTION` and `FEATURES`
    (each feature's numpy dtype, `str` for text), draws a problem with `_sample`, and may
    override `_key` (when two problems are the same), `_features` and `_example`."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release."}
    DESCRIPTION: str
    FEATURES: dict

    def __init__(self, *, file_format: str | None = _FILE_FORMAT, **kwargs):
        with absl_records_dropped(_unprepared_notice):
            super().__init__(file_format=file_format, **kwargs)

    def _info(self) -> tfds.core.DatasetInfo:
        return self.dataset_info_from_configs(
            description=f"{self.DESCRIPTION} Generated locally and deterministically.",
            features=tfds.features.FeaturesDict(self._features()),
            supervised_keys=None,
        )

    def _features(self) -> dict:
        return {
            name: tfds.features.Text() if dtype is str else tfds.features.Scalar(dtype=dtype)
            for name, dtype in self.FEATURES.items()
        }

    def _sample(self, rng: random.Random):
        raise NotImplementedError

    def _key(self, problem) -> Hashable:
        return problem

    def _problems(self) -> list:
        """``num_test + num_train`` problems with distinct keys, drawn in order from
        ``random.Random(seed)``."""
        config = self.builder_config
        count = config.num_train + config.num_test
        rng = random.Random(config.seed)
        problems: dict = {}  # By key, the first problem drawn with it.
        draws = 50 * count + 1000
        for _ in range(draws):
            problem = self._sample(rng)
            problems.setdefault(self._key(problem), problem)
            if len(problems) == count:
                return list(problems.values())
        raise ValueError(
            f"{self.name}/{config.name}: found only {len(problems)} distinct problems "
            f"in {draws} draws, {count} requested; lower num_train/num_test or widen "
            "the ranges."
        )

    # Instead of tfds's "Downloading and preparing dataset ..." and "downloaded and prepared"
    # lines: nothing is downloaded for an embedded task.
    def _log_download_bytes(self) -> None:
        print(
            f"preparing the embedded task data {self.info.full_name} in {self.data_dir} "
            "(once; nothing is downloaded)",
            file=sys.stderr,
            flush=True,
        )

    def _log_download_done(self) -> None:
        pass

    def _example(self, problem) -> dict:
        return problem._asdict()

    def _split_generators(self, dl_manager):
        del dl_manager  # Generated locally: nothing to download.
        config = self.builder_config
        if config.num_train < 1 or config.num_test < 1:
            raise ValueError(
                f"Config {config.name!r}: num_train and num_test must be >= 1, "
                f"got num_train={config.num_train}, num_test={config.num_test}."
            )
        problems = self._problems()
        return {
            "test": self._generate_examples(problems[: config.num_test]),
            "train": self._generate_examples(problems[config.num_test :]),
        }

    def _generate_examples(self, problems):
        for i, problem in enumerate(problems):
            yield i, self._example(problem)


@dataclasses.dataclass(kw_only=True)
class CountdownConfig(tfds.core.BuilderConfig):
    """A Countdown difficulty and data size (`gac_jax.tasks.countdown.sample_problem`'s
    arguments, the splits' sizes and the problem stream's seed)."""

    num_numbers: int = 3  # Numbers per problem, 1 to 5.
    min_number: int = 1
    max_number: int = 20
    min_target: int = 10
    max_target: int = 100
    min_used: int = 2  # Fewest numbers the shortest solution needs.
    num_train: int = 10_000
    num_test: int = 500
    seed: int = 0


# The `CountdownConfig` fields that are arguments of `countdown.sample_problem`.
_SAMPLE_ARGS = ("num_numbers", "min_number", "max_number", "min_target", "max_target", "min_used")


def _countdown_configs() -> list[CountdownConfig]:
    specs = [
        # name, numbers, max number, target range, fewest numbers used, train, test
        ("n3_max20", 3, 20, (10, 100), 2, 10_000, 500),
        ("n4_max20", 4, 20, (10, 200), 3, 20_000, 1_000),
        ("n4_max50", 4, 50, (10, 300), 3, 20_000, 1_000),
        ("n5_max100", 5, 100, (100, 999), 4, 20_000, 1_000),
    ]
    return [
        CountdownConfig(
            name=name,
            description=(
                f"{n} numbers in [1, {max_number}], targets in [{lo}, {hi}] that need at "
                f"least {used} of them."
            ),
            num_numbers=n,
            max_number=max_number,
            min_target=lo,
            max_target=hi,
            min_used=used,
            num_train=train,
            num_test=test,
        )
        for name, n, max_number, (lo, hi), used, train, test in specs
    ]


class Countdown(_LocalBuilder):
    """Countdown problems: numbers, a target, and a reference solution found by search."""

    name = "countdown"
    BUILDER_CONFIGS = _countdown_configs()
    DESCRIPTION = (
        "Countdown: make the target from the given numbers (each at most once) "
        "with + - * / and parentheses."
    )
    FEATURES = {"target": np.int32, "solution": str}

    def _features(self) -> dict:
        shape = (self.builder_config.num_numbers,)
        return {"numbers": tfds.features.Tensor(shape=shape, dtype=np.int32), **super()._features()}

    def _sample(self, rng: random.Random) -> countdown.CountdownProblem:
        config = self.builder_config
        return countdown.sample_problem(rng, **{k: getattr(config, k) for k in _SAMPLE_ARGS})

    def _key(self, problem: countdown.CountdownProblem) -> Hashable:
        return tuple(sorted(problem.numbers)), problem.target

    def _example(self, problem: countdown.CountdownProblem) -> dict:
        return {**problem._asdict(), "numbers": np.asarray(problem.numbers, dtype=np.int32)}


@dataclasses.dataclass(kw_only=True)
class ArithmeticConfig(tfds.core.BuilderConfig):
    """An arithmetic difficulty, the splits' sizes and the problem stream's seed."""

    op: str = "+"  # "+", "-" or "*".
    digits: int = 2  # Of each operand.
    # Whether the reference completion is the scratchpad (the data holds both either way).
    scratchpad: bool = False
    num_train: int = 20_000
    num_test: int = 1_000
    seed: int = 0


_OP_NAMES = {"+": "add", "-": "sub", "*": "mul"}


def _arithmetic_configs() -> list[ArithmeticConfig]:
    return [
        ArithmeticConfig(
            name=f"{_OP_NAMES[op]}{digits}" + ("_scratch" if scratch else ""),
            description=(
                f"{digits}-digit a{op}b" + (", answered with a scratchpad" if scratch else "") + "."
            ),
            op=op,
            digits=digits,
            scratchpad=scratch,
            # Two-digit operands allow only 4,095 distinct problems per operator.
            num_train=3_000 if digits == 2 else 20_000,
            num_test=500 if digits == 2 else 1_000,
        )
        for op, all_digits in (("+", (2, 3, 4, 5)), ("-", (2, 3, 4, 5)), ("*", (2, 3)))
        for digits in all_digits
        for scratch in (False, True)
    ]


class Arithmetic(_LocalBuilder):
    """Multi-digit arithmetic problems with their answer and a worked scratchpad."""

    name = "arithmetic"
    BUILDER_CONFIGS = _arithmetic_configs()
    DESCRIPTION = "Multi-digit arithmetic (a op b) with the answer and a one-line scratchpad."
    FEATURES = {"a": np.int64, "op": str, "b": np.int64, "answer": np.int64, "scratchpad": str}

    def _problems(self) -> list[arithmetic.ArithmeticProblem]:
        config = self.builder_config
        if config.op not in arithmetic.OPERATORS:
            raise ValueError(
                f"Config {config.name!r}: unknown op {config.op!r}; "
                f"expected one of {arithmetic.OPERATORS}."
            )
        return super()._problems()

    def _sample(self, rng: random.Random) -> arithmetic.ArithmeticProblem:
        config = self.builder_config
        return arithmetic.sample_problem(rng, op=config.op, digits=config.digits)

    def _key(self, problem: arithmetic.ArithmeticProblem) -> Hashable:
        a, b = problem.a, problem.b
        return (min(a, b), max(a, b)) if problem.op in "+*" else (a, b)

    def _example(self, problem: arithmetic.ArithmeticProblem) -> dict:
        return {**problem._asdict(), "scratchpad": arithmetic.scratchpad(*problem[:3])}


@dataclasses.dataclass(kw_only=True)
class CalculatorConfig(tfds.core.BuilderConfig):
    """The calculator task's split sizes and seed (`gac_jax.tasks.calculator`)."""

    num_train: int = 20_000
    num_test: int = 1_000
    seed: int = 0


class Calculator(_LocalBuilder):
    """``a*b+c`` / ``a*b-c`` problems answered with a calculator tool (multi-turn)."""

    name = "calculator"
    BUILDER_CONFIGS = [
        CalculatorConfig(name="muladd", description="a*b+c or a*b-c with a calculator tool.")
    ]
    DESCRIPTION = (
        "a*b+c and a*b-c (a of 2-3 digits, b of 1-2, c of 1-3) for a policy with a calculator tool."
    )
    FEATURES = {"a": np.int64, "b": np.int64, "op": str, "c": np.int64, "answer": np.int64}

    def _sample(self, rng: random.Random) -> calculator.CalculatorProblem:
        return calculator.sample_problem(rng)

    def _example(self, problem: calculator.CalculatorProblem) -> dict:
        return {**problem._asdict(), "answer": problem.answer}


class Gsm8k(_tfds_gsm8k.Gsm8k, skip_registration=True):
    """tfds's ``gsm8k`` builder that also prepares offline from the original JSONL files.

    Same name, version and features as `tfds.text.gsm8k.Gsm8k`, so data prepared by either
    builder is read by both. If the manual directory (by default
    ``<data_dir>/downloads/manual``) holds the release files `GSM8K_FILES` (the ones tfds
    downloads), only the ``train`` and ``test`` splits are made from them; otherwise tfds
    downloads all four splits, the socratic ones included.
    """

    name = "gsm8k"
    MANUAL_DOWNLOAD_INSTRUCTIONS = (
        "Put the original GSM8K release files train.jsonl and test.jsonl (repository "
        "openai/grade-school-math, folder grade_school_math/data) in the manual directory."
    )

    def __init__(self, *, file_format: str | None = _FILE_FORMAT, **kwargs):
        with absl_records_dropped(_unprepared_notice):
            super().__init__(file_format=file_format, **kwargs)

    def _split_generators(self, dl_manager: tfds.download.DownloadManager):
        try:
            manual_dir = Path(dl_manager.manual_dir)
        except AssertionError:  # No manual directory, or an empty one.
            manual_dir = None
        if manual_dir is not None and all((manual_dir / f).is_file() for f in GSM8K_FILES.values()):
            return {
                split: self._generate_examples(manual_dir / filename)
                for split, filename in GSM8K_FILES.items()
            }
        try:
            return super()._split_generators(dl_manager)
        except Exception as e:
            raise RuntimeError(
                "Could not download GSM8K. On a machine without internet access, prepare it "
                f"from the release files {sorted(GSM8K_FILES.values())} in a directory: "
                "Gsm8k(...).download_and_prepare(download_config="
                "tfds.download.DownloadConfig(manual_dir=DIR)), or "
                "get_task('gsm8k', manual_dir=DIR)."
            ) from e


@contextlib.contextmanager
def _preparation_lock(builder: tfds.core.DatasetBuilder) -> Iterator[None]:
    """Holds an exclusive lock on `builder`'s (local) data directory while it is prepared:
    processes of one sweep prepare the same dataset at once, and without the lock the
    second to finish fails to rename its copy over the first."""
    root = str(builder.data_dir_root)
    if "://" in root:
        yield
        return
    with exclusive_lock(Path(builder.data_dir).parent / ".prepare.lock"):
        yield


def prepare_source(
    builder: tfds.core.DatasetBuilder,
    split: str,
    *,
    download_config: tfds.download.DownloadConfig | None = None,
) -> Sequence[dict]:
    """Prepares `builder` (array_record files) unless it is already prepared, then opens
    `split` (a name, or a tfds split expression such as ``"train[:100]"``) as a random-access
    sequence of examples (dicts of numpy values; text as bytes). `download_config` goes to
    ``download_and_prepare``. ValueError if `split` is not a split of the prepared data."""
    with absl_records_dropped(_unprepared_notice), _preparation_lock(builder):
        if not builder.is_prepared():
            builder.download_and_prepare(download_config=download_config)
        elif not builder.info.splits:  # Another process prepared it while this one waited.
            builder.info.read_from_directory(builder.data_dir)
    splits = sorted(builder.info.splits.keys())
    for part in split.split("+"):
        if part.split("[", 1)[0].strip() not in splits:
            raise ValueError(
                f"Unknown split {split!r} of {builder.info.full_name}; known: {splits}."
            )
    return builder.as_data_source(split=split)
