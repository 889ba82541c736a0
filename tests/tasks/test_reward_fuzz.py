"""Every task's reward on hostile text: no exception, a reward in [0, 1], and time linear in
the text (at most 20 ms per call up to 100 kB, on a loaded machine).

10,000 strings in all: 8,000 from a seeded generator (random text, tag and marker soups,
adversarial runs at 1 kB to 100 kB) and 2,000 drawn by hypothesis (derandomized), plus a
few 1 MB strings. Each string is scored by one task of each reward family, rotating
through the registered tasks, so every task in `TASK_NAMES` is exercised.
"""

import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gac_jax.tasks import TASK_NAMES, get_task

# Per call, for texts up to _BOUNDED_CHARS. The worst texts take 3-4 ms alone and up to
# 10.4 ms (best of three) while another test worker shares the two cores; the quadratic
# parsers this guards against took 26-60 ms.
_BOUND_S = 0.020
_BOUNDED_CHARS = 100_000

# Plain examples (the registry accepts Python values as well as data-source dicts).
_EXAMPLES = {
    "countdown": {"numbers": [3, 5, 7], "target": 22, "solution": "5*3+7"},
    "arithmetic": {"a": 37, "op": "+", "b": 48, "answer": 85, "scratchpad": "7+8=15;3+4+1=8;85"},
    "gsm8k": {"question": "q", "answer": "2*540=1080\n#### 1,080", "short_answer": "1,080"},
    "calculator": {"a": 347, "b": 29, "op": "+", "c": 18, "answer": 10081},
}
_TASKS = [get_task(name) for name in TASK_NAMES]
_FAMILIES = {family: [t for t in _TASKS if t.name.split("/")[0] == family] for family in _EXAMPLES}

_PIECES = [
    "<answer>",
    "</answer>",
    "<answer",
    "answer>",
    "</",
    "<",
    ">",
    "####",
    "#",
    "\\boxed{",
    "\\boxed",
    "{",
    "}",
    "answer is",
    "Answer:",
    "ANSWER IS",
    "1,080",
    "1,000,000",
    "-3",
    "$18.",
    "0.5",
    "3/4",
    " / ",
    "/0",
    "(",
    ")",
    "+",
    "-",
    "*",
    "=",
    "22",
    "5*3+7",
    "85",
    "\n",
    " ",
    "**",
    "٣",
    "ſ",
    "\u200b",
    "é",
    "🙂",
    "\ud800",
    "1e9",
    "999999999999",
]
_ALPHABET = "abcxyzABC0123456789 \t\n+-*/=()[]{}<>#$%.,:;!?\\'\"_^|~" + "éßſK٣١二\u200b🙂\ud800"


def _adversarial(size: int) -> list[str]:
    """Runs that break backtracking parsers, each about `size` characters."""
    k = max(1, size // 8)
    return [
        "<answer>" * k,
        "<answer>" * k + "5*3+7</answer>",
        "</answer>" * k,
        "<answer>" * (k // 2) + "</answer>" * (k // 2),
        "<answer><answer>1</answer>" * (k // 3),
        "<answer>1" * k + "</answer",
        "9" * size,
        "1," * (size // 2),
        "1,234" * (size // 5),
        ",123" * (size // 4),
        "(" * size,
        "(" * (size // 2) + ")" * (size // 2),
        "+-*/" * (size // 4),
        "((1+2)*3-4)/" * (size // 12),
        "1/2/" * (size // 4),
        "1.1." * (size // 4),
        "1 / " * (size // 4),
        "-$" * (size // 2),
        "-" * size + "5",
        "#" * size + "5",
        "#### " * (size // 5),
        "\\boxed{" * (size // 7),
        "\\boxed{" + "1" * size + "}",
        "answer is " * (size // 10),
        "answer" + " " * size + "is 5",
        "٣" * size,
        "🙂" * size,
        " " * size + "85",
    ]


def _random_text(rng: random.Random) -> str:
    n = int(2 ** rng.uniform(0, 11))
    if rng.random() < 0.5:
        return "".join(rng.choice(_ALPHABET) for _ in range(n))
    return "".join(rng.choice(_PIECES) for _ in range(max(1, n // 4)))


def _corpus() -> list[str]:
    rng = random.Random(16)
    strings = [s for size in (1_000, 10_000, 100_000) for s in _adversarial(size)]
    while len(strings) < 8_000:
        strings.append(_random_text(rng))
    return strings


def _call_time(reward, completion, example) -> tuple[float, float]:
    start = time.perf_counter()
    value = reward(completion, example)
    return value, time.perf_counter() - start


def _check(completion: str, index: int) -> None:
    for family, tasks in _FAMILIES.items():
        task = tasks[index % len(tasks)]
        value, seconds = _call_time(task.reward, completion, _EXAMPLES[family])
        assert isinstance(value, float) and 0.0 <= value <= 1.0, (task.name, completion[:80])
        if seconds > _BOUND_S and len(completion) <= _BOUNDED_CHARS:
            # A noisy shared machine: only the best of three repeats counts.
            seconds = min(_call_time(task.reward, completion, _EXAMPLES[family])[1] for _ in "abc")
            assert seconds <= _BOUND_S, (task.name, len(completion), completion[:80], seconds)


def test_rewards_are_correct_on_the_reference_completions():
    """The fuzzing below calls real rewards: each scores its reference completion 1.0."""
    for task in _TASKS:
        example = _EXAMPLES[task.name.split("/")[0]]
        assert task.reward(task.reference_completion(example), example) == 1.0, task.name


def test_seeded_corpus():
    corpus = _corpus()
    assert len(corpus) == 8_000
    for index, completion in enumerate(corpus):
        _check(completion, index)


@settings(derandomize=True, max_examples=1_000, deadline=None, database=None)
@given(st.text(max_size=400))
def test_hypothesis_text(completion):
    _check(completion, len(completion))


@settings(derandomize=True, max_examples=1_000, deadline=None, database=None)
@given(st.lists(st.sampled_from(_PIECES), max_size=60).map("".join))
def test_hypothesis_tag_soup(completion):
    _check(completion, len(completion))


@pytest.mark.parametrize(
    "completion",
    [
        "<answer>" * 125_000,
        "9" * 1_000_000,
        "1/2/" * 250_000,
        "".join(random.Random(1).choice(_PIECES) for _ in range(200_000))[:1_000_000],
    ],
    ids=["open-tags", "digits", "slash-chain", "soup"],
)
def test_one_megabyte(completion):
    """No time bound per call here, only a generous one that quadratic parsing misses."""
    for family, tasks in _FAMILIES.items():
        value, seconds = _call_time(tasks[0].reward, completion, _EXAMPLES[family])
        assert 0.0 <= value <= 1.0
        assert seconds < 1.0, (family, seconds)


@pytest.mark.parametrize("unit", ["\\boxed{1/0}", "#### 0/0 ", "answer is 1/0 "])
def test_markers_without_valid_numbers_stay_within_the_bound(unit):
    """Markers each followed by an invalid number (a zero denominator): only the last
    `_MAX_MARKERS` of a kind are tried, so 100 kB of them stays within 10 ms a call."""
    gsm8k = _FAMILIES["gsm8k"][0]
    for size in (10_000, 100_000):
        text = unit * (size // len(unit))
        value, _ = _call_time(gsm8k.reward, text, _EXAMPLES["gsm8k"])
        assert value == 0.0
        best = min(_call_time(gsm8k.reward, text, _EXAMPLES["gsm8k"])[1] for _ in "abc")
        assert best < _BOUND_S, (unit, size, best)
