"""Every task's reward on hostile text: no exception, a reward in [0, 1], no call that hangs,
and time linear in the text.

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

# Per call, for texts up to _BOUNDED_CHARS: a hang (catastrophic backtracking), not a speed
# goal. The worst texts take 3-4 ms alone and 23 ms was seen in CI on a loaded machine.
_BOUND_S = 0.5
_BOUNDED_CHARS = 100_000
# Linearity is judged by scaling, which a loaded machine does not change: the same
# adversarial run at 4x the length may take at most _MAX_GROWTH times as long (linear: 4,
# quadratic: 16), unless the long one is still under _FLOOR_S (too short to time reliably).
# Times are the thread's CPU time. Today's rewards: 2-7 ms at 100 kB, growth 4.0-4.1; the
# quadratic parsers this guards against took 26-60 ms at 100 kB.
_SCALE = 4
_MAX_GROWTH = 8.0
_FLOOR_S = 0.003

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
    """The reward and the CPU seconds the call took on this thread (a loaded machine delays
    a call, it does not add to its CPU time)."""
    start = time.thread_time()
    value = reward(completion, example)
    return value, time.thread_time() - start


def _check(completion: str, index: int) -> None:
    for family, tasks in _FAMILIES.items():
        task = tasks[index % len(tasks)]
        value, seconds = _call_time(task.reward, completion, _EXAMPLES[family])
        assert isinstance(value, float) and 0.0 <= value <= 1.0, (task.name, completion[:80])
        if seconds > _BOUND_S and len(completion) <= _BOUNDED_CHARS:
            # A noisy shared machine: only the best of three repeats counts.
            seconds = min(_call_time(task.reward, completion, _EXAMPLES[family])[1] for _ in "abc")
            assert seconds <= _BOUND_S, (task.name, len(completion), completion[:80], seconds)


def _superlinear(reward, make_text, example, size: int = 25_000) -> tuple[float, float] | None:
    """(short, long) best-of-three seconds when `reward` grows faster than linearly from
    `make_text(size)` to `make_text(_SCALE * size)`, else None."""
    texts = make_text(size), make_text(_SCALE * size)
    # Interleaved, best of five: a busy spell of the machine slows both lengths alike.
    pairs = [[_call_time(reward, text, example)[1] for text in texts] for _ in range(5)]
    short, long = (min(column) for column in zip(*pairs, strict=True))
    if long > _FLOOR_S and long > _MAX_GROWTH * short:
        return short, long
    return None


def test_the_scaling_check_flags_a_quadratic_reward():
    """The check below can fail: a reward that rescans the text from each position is flagged,
    one that scans it once is not."""

    def quadratic(text, example):
        return float(sum(text.find("x", i) for i in range(0, len(text), 2)) == 0)

    def linear(text, example):
        return float(text.count(",") == 0)

    assert _superlinear(quadratic, lambda n: ",123" * (n // 4), {}) is not None
    assert _superlinear(linear, lambda n: ",123" * (n // 4), {}) is None


def test_time_is_linear_in_the_text():
    """Every adversarial run, scored by one task of each family (rotating), at 25 kB and
    100 kB."""
    runs = len(_adversarial(8))
    for index in range(runs):
        make_text = lambda n, index=index: _adversarial(n)[index]  # noqa: E731
        for family, tasks in _FAMILIES.items():
            task = tasks[index % len(tasks)]
            flagged = _superlinear(task.reward, make_text, _EXAMPLES[family])
            assert flagged is None, (task.name, make_text(16)[:16], flagged)


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
    `_MAX_MARKERS` of a kind are tried, so the time stays linear in the text."""
    gsm8k = _FAMILIES["gsm8k"][0]
    make_text = lambda size: unit * (size // len(unit))  # noqa: E731
    assert gsm8k.reward(make_text(100_000), _EXAMPLES["gsm8k"]) == 0.0
    flagged = _superlinear(gsm8k.reward, make_text, _EXAMPLES["gsm8k"])
    assert flagged is None, (unit, flagged)
