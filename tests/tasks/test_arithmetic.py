"""Arithmetic: sampling, the scratchpad and the reward."""

import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gac_jax.tasks.arithmetic import (
    arithmetic_reward,
    format_prompt,
    sample_problem,
    scratchpad,
)


@pytest.mark.parametrize(
    ("a", "op", "b", "expected"),
    [
        (37, "+", 48, "7+8=15;3+4+1=8;85"),
        (95, "+", 17, "5+7=12;9+1+1=11;112"),
        (52, "-", 17, "12-7=5;4-1=3;35"),
        (100, "-", 1, "10-1=9;9-0=9;0-0=0;99"),
        (37, "*", 48, "37*8=296;37*40=1480;296+1480=1776;1776"),
        (37, "*", 40, "37*40=1480;1480"),
    ],
)
def test_scratchpad_examples(a, op, b, expected):
    assert scratchpad(a, op, b) == expected


def _check_step(step):
    """Each step is `x op y [op z]=w` with a true equation (evaluated here by hand)."""
    lhs, rhs = step.split("=")
    terms = re.split(r"([+\-*])", lhs)
    value = int(terms[0])
    for op, term in zip(terms[1::2], terms[2::2], strict=True):
        value = {"+": value + int(term), "-": value - int(term), "*": value * int(term)}[op]
    assert value == int(rhs), step


@settings(max_examples=200)
@given(st.integers(0, 10**6), st.sampled_from("+-*"), st.integers(0, 10**6))
def test_scratchpad_steps_are_true_and_end_in_the_answer(a, op, b):
    if op == "-" and a < b:
        a, b = b, a
    text = scratchpad(a, op, b)
    assert "\n" not in text
    *steps, answer = text.split(";")
    for step in steps:
        _check_step(step)
    assert int(answer) == {"+": a + b, "-": a - b, "*": a * b}[op]
    assert arithmetic_reward(text, int(answer)) == 1.0
    # Every step of +/- is one column: single digits in, at most two digits out.
    if op in "+-":
        assert len(steps) == len(str(max(a, b)))


def test_scratchpad_rejects_bad_input():
    with pytest.raises(ValueError, match="a >= b"):
        scratchpad(3, "-", 5)
    with pytest.raises(ValueError, match="Unknown operator"):
        scratchpad(3, "/", 5)
    with pytest.raises(ValueError, match="non-negative"):
        scratchpad(-3, "+", 5)


@pytest.mark.parametrize("op", ["+", "-", "*"])
@pytest.mark.parametrize("digits", [1, 2, 5])
def test_sample_problem(op, digits):
    rng = random.Random(0)
    for _ in range(50):
        p = sample_problem(rng, op=op, digits=digits)
        assert len(str(p.a)) == digits and len(str(p.b)) == digits
        assert p.answer == {"+": p.a + p.b, "-": p.a - p.b, "*": p.a * p.b}[op]
        assert p.answer >= 0


def test_sample_problem_rejects_bad_arguments():
    with pytest.raises(ValueError, match="Unknown operator"):
        sample_problem(random.Random(0), op="/", digits=2)
    with pytest.raises(ValueError, match="digits"):
        sample_problem(random.Random(0), op="+", digits=0)


def test_prompt_format():
    assert format_prompt(37, "+", 48) == "37+48="


@pytest.mark.parametrize(
    ("completion", "reward"),
    [
        ("85", 1.0),
        (" 85 ", 1.0),
        ("85.", 1.0),
        ("85\n86", 1.0),  # only the first line counts
        ("7+8=15;3+4+1=8;85", 1.0),
        ("7+8=15;3+4+1=8;84", 0.0),
        ("85.5", 0.0),  # exact: no tolerance for integers
        ("84", 0.0),
        ("86\n85", 0.0),
        ("", 0.0),
        ("eighty-five", 0.0),
        (None, 0.0),
        (b"85", 1.0),
    ],
)
def test_arithmetic_reward(completion, reward):
    assert arithmetic_reward(completion, 85) == reward


@settings(max_examples=300)
@given(st.text(max_size=200))
def test_arithmetic_reward_never_raises(completion):
    assert arithmetic_reward(completion, 85) in (0.0, 1.0)
