"""The task registry: every task by name, with its data, prompt and reward.

`TASK_NAMES` is the only list of valid names: ``countdown/<config>``, ``arithmetic/<config>`` and
``calculator/<config>`` (multi-turn, with a tool) for each builder config, and ``gsm8k``.
`TASK_FAMILIES` lists the names that take a parameter after their prefix:
``jsonl:TRAIN_PATH[,TEST_PATH]`` and ``hf:PATH[:TRAIN_SPLIT[,TEST_SPLIT]]`` (a researcher's own
data, see `gac_jax.tasks.custom`). `get_task` rejects any other name with an error that lists them.

Example::

    task = get_task("countdown/n3_max20")
    train = task.data_source("train", data_dir="/tmp/tfds")
    example = train[0]
    task.prompt(example)                # e.g. 'Use 3 5 7 to make 22: '
    task.reference_completion(example)  # e.g. '5*3+7'
    task.reward("7+3*5", example)       # 1.0 for that example
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

import tensorflow_datasets as tfds

from gac_jax.tasks import arithmetic, calculator, countdown, custom, gsm8k, rewards
from gac_jax.tasks.builders import Arithmetic, Calculator, Countdown, Gsm8k, prepare_source

__all__ = ["TASK_FAMILIES", "TASK_NAMES", "Task", "get_task"]


def _text(value) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8")
    item = getattr(value, "item", None)
    return _text(item()) if callable(item) and not isinstance(value, str) else str(value)


@dataclasses.dataclass(frozen=True)
class Task:
    """One task: where its data comes from, how to prompt, and how to score.

    Examples are the dicts a data source yields (numpy values, text as bytes); plain
    Python values (str, int, lists) work as well.
    """

    name: str  # The registry name, e.g. "countdown/n3_max20".
    # `make_builder(data_dir)` (None: tfds's default); None for a task whose data is not a
    # tfds dataset, whose `source(split, data_dir=...)` gives the examples instead.
    make_builder: Callable[[str | None], tfds.core.DatasetBuilder] | None
    prompt: Callable[[Mapping[str, Any]], str]  # The text the model continues.
    # A correct completion, for supervised warm starts and tests.
    reference_completion: Callable[[Mapping[str, Any]], str]
    # `reward(completion, example)`: never raises on any completion.
    reward: Callable[[str, Mapping[str, Any]], float]
    download_config: tfds.download.DownloadConfig | None = None  # For download_and_prepare.
    source: Callable[..., Sequence[Mapping[str, Any]]] | None = None
    # The prompt as chat messages for a chat template (`gac_jax.tasks.chat`); None: one
    # user message holding `prompt(example)`.
    messages: Callable[[Mapping[str, Any]], list[dict[str, Any]]] | None = None
    # Makes a multi-turn task's environment (`gac_jax.tasks.environments`), whose `reward`
    # scores the episode; None for single-answer tasks.
    environment: Callable[[], Any] | None = None
    # A worked multi-turn transcript, [(role "policy" or "tool", text)], for warm starts.
    reference_turns: Callable[[Mapping[str, Any]], list[tuple[str, str]]] | None = None

    def builder(self, data_dir: str | os.PathLike | None = None) -> tfds.core.DatasetBuilder:
        """The task's tfds builder (not prepared yet if it never was)."""
        if self.make_builder is None:
            raise ValueError(f"Task {self.name!r} is not a tfds dataset: it has no builder.")
        return self.make_builder(None if data_dir is None else os.fspath(data_dir))

    def data_source(
        self, split: str, *, data_dir: str | os.PathLike | None = None
    ) -> Sequence[Mapping[str, Any]]:
        """The examples of `split` (``"train"``, ``"test"`` or a tfds slice such as
        ``"test[:100]"``) as a random-access sequence, preparing the data in `data_dir`
        (None: tfds's default) first if needed. ValueError on an unknown split."""
        if self.source is not None:
            return self.source(split, data_dir=data_dir)
        return prepare_source(self.builder(data_dir), split, download_config=self.download_config)


def _countdown_task(config_name: str, /, *, format_score: float = 0.0) -> Task:
    if not 0.0 <= format_score <= 1.0:
        raise ValueError(f"format_score must be in [0, 1], got {format_score}.")

    def reward(completion, example) -> float:
        return countdown.countdown_reward(
            completion, list(example["numbers"]), int(example["target"]), format_score=format_score
        )

    return Task(
        name=f"countdown/{config_name}",
        make_builder=lambda data_dir: Countdown(config=config_name, data_dir=data_dir),
        prompt=lambda ex: countdown.format_prompt(list(ex["numbers"]), int(ex["target"])),
        reference_completion=lambda ex: _text(ex["solution"]),
        reward=reward,
    )


def _arithmetic_task(config_name: str, /) -> Task:
    config = Arithmetic.builder_configs[config_name]

    def reference(example) -> str:
        if config.scratchpad:
            return _text(example["scratchpad"])
        return str(int(example["answer"]))

    return Task(
        name=f"arithmetic/{config_name}",
        make_builder=lambda data_dir: Arithmetic(config=config_name, data_dir=data_dir),
        prompt=lambda ex: arithmetic.format_prompt(int(ex["a"]), _text(ex["op"]), int(ex["b"])),
        reference_completion=reference,
        reward=lambda completion, ex: arithmetic.arithmetic_reward(completion, int(ex["answer"])),
    )


def _gsm8k_task(*, manual_dir: str | os.PathLike | None = None) -> Task:
    download_config = None
    if manual_dir is not None:
        manual_dir = Path(manual_dir)
        missing = [f for f in gsm8k.GSM8K_FILES.values() if not (manual_dir / f).is_file()]
        if missing:
            raise FileNotFoundError(f"manual_dir {str(manual_dir)!r} lacks {missing}.")
        download_config = tfds.download.DownloadConfig(manual_dir=os.fspath(manual_dir))
    return Task(
        name="gsm8k",
        make_builder=lambda data_dir: Gsm8k(data_dir=data_dir),
        prompt=lambda ex: gsm8k.format_prompt(_text(ex["question"])),
        reference_completion=lambda ex: _text(ex["answer"]),
        reward=lambda completion, ex: gsm8k.gsm8k_reward(completion, _text(ex["short_answer"])),
        download_config=download_config,
    )


def _custom_task(prefix: str, check: Callable, source: Callable, spec: str, /) -> Task:
    """A JSONL or saved Hugging Face dataset task (`TASK_FAMILIES`)."""
    check(spec)  # Fails now, naming the file or directory, rather than when training starts.
    return Task(
        name=f"{prefix}{spec}",
        make_builder=None,
        prompt=custom.jsonl_prompt,
        reference_completion=lambda ex: _text(ex["answer"]),
        reward=rewards.lenient_match,  # Unless the run names one.
        source=source(spec),
        messages=custom.jsonl_messages,
    )


def _calculator_task(config_name: str, /) -> Task:
    return Task(
        name=f"calculator/{config_name}",
        make_builder=lambda data_dir: Calculator(config=config_name, data_dir=data_dir),
        prompt=calculator.format_prompt,
        reference_completion=lambda ex: "".join(t for _, t in calculator.reference_turns(ex)),
        # Of the text after the prompt, tools included.
        reward=lambda completion, ex: calculator.calculator_reward(completion, int(ex["answer"])),
        environment=calculator.Calculator,
        reference_turns=calculator.reference_turns,
    )


def _factories() -> dict[str, Callable[..., Task]]:
    factories: dict[str, Callable[..., Task]] = {}
    tasks = {Countdown: _countdown_task, Arithmetic: _arithmetic_task, Calculator: _calculator_task}
    for builder, task in tasks.items():
        for config in builder.BUILDER_CONFIGS:
            factories[f"{builder.name}/{config.name}"] = functools.partial(task, config.name)
    factories["gsm8k"] = _gsm8k_task
    return factories


_FACTORIES: Mapping[str, Callable[..., Task]] = MappingProxyType(_factories())

#: Every valid task name, sorted.
TASK_NAMES: tuple[str, ...] = tuple(sorted(_FACTORIES))

#: Task families by prefix: ``<prefix><parameter>`` names a task, e.g.
#: ``jsonl:data/train.jsonl,data/test.jsonl``.
TASK_FAMILIES: Mapping[str, Callable[..., Task]] = MappingProxyType(
    {
        prefix: functools.partial(_custom_task, prefix, check, source)
        for prefix, check, source in (
            (custom.JSONL_PREFIX, custom.jsonl_splits, custom.JsonlSource),
            (custom.HF_PREFIX, custom.hf_splits, custom.HfSource),
        )
    }
)
_FAMILY_FORMS = ("jsonl:TRAIN_PATH[,TEST_PATH]", "hf:PATH[:TRAIN_SPLIT[,TEST_SPLIT]]")


def _option_names(factory: Callable[..., Task]) -> list[str]:
    parameters = inspect.signature(factory).parameters.values()
    return sorted(p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY)


def get_task(name: str, **options) -> Task:
    """The task called `name`: one of `TASK_NAMES`, or a `TASK_FAMILIES` prefix and its
    parameter (``jsonl:TRAIN_PATH[,TEST_PATH]``, ``hf:PATH[:TRAIN_SPLIT[,TEST_SPLIT]]``).

    Options: ``format_score`` (countdown: reward of a well-formed wrong answer, default
    0.0); ``manual_dir`` (gsm8k: directory holding the original ``train.jsonl`` and
    ``test.jsonl``, read instead of downloading; FileNotFoundError if it lacks them).
    ValueError, in one line, if `name` is unknown (listing the known names), an option
    does not apply to the task or is invalid, or a JSONL file or saved dataset is missing.
    """
    factory = _FACTORIES.get(name)
    for prefix, family in TASK_FAMILIES.items():
        if factory is None and isinstance(name, str) and name.startswith(prefix):
            factory = functools.partial(family, name[len(prefix) :])
    if factory is None:
        forms = ", ".join([*TASK_NAMES, *_FAMILY_FORMS])
        raise ValueError(f"Unknown task {name!r}; known tasks: {forms}.")
    known = _option_names(factory)
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(
            f"Task {name!r} takes no option(s) {unknown}; its options: {known or 'none'}."
        )
    return factory(**options)
