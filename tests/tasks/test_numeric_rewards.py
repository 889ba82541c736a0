"""Tolerant numeric answer extraction and the exact-match reward."""

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gac_jax.tasks.rewards import (
    extract_numeric_answer,
    find_numbers,
    numbers_match,
    numeric_reward,
    parse_number,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("18", Fraction(18)),
        ("1,080", Fraction(1080)),
        ("109,200,000", Fraction(109_200_000)),
        ("$18.", Fraction(18)),
        ("It costs $1,234.50.", Fraction(246_900, 200)),
        ("-3", Fraction(-3)),
        ("#### -10", Fraction(-10)),
        ("0.50", Fraction(1, 2)),
        ("3/4", Fraction(3, 4)),
        ("50%", Fraction(50)),
        ("#### 18", Fraction(18)),
        ("so #### 18\nthen 99 more words 7", Fraction(18)),
        ("The answer is 18 dollars, not 20", Fraction(18)),
        ("the answer is: $2,125.", Fraction(2125)),
        ("Answer: 42", Fraction(42)),
        ("The answer is **42**.", Fraction(42)),
        ("Answer: Janet has 16 eggs and makes 18.", Fraction(18)),
        ("The answer is not 5 but 7", Fraction(7)),
        ("#### $1,000", Fraction(1000)),
        ("so x = \\boxed{17} and 3 more", Fraction(17)),
        ("He has 5 apples and eats 2, so 3 remain.", Fraction(3)),
        ("x = 10 - 3", Fraction(3)),  # a binary minus, not a negative number
        ("5-3", Fraction(3)),
        ("the result is -3.", Fraction(-3)),
        ("(-3)", Fraction(-3)),
        ("", None),
        ("no numbers here", None),
        ("#### ", None),
        ("1/0", None),
        ("9" * 5000, None),  # absurdly long digit runs are not numbers
    ],
)
def test_extract_numeric_answer(text, expected):
    assert extract_numeric_answer(text) == expected


def test_precedence_hashes_over_boxed_over_answer_is_over_last_number():
    text = "The answer is 1. \\boxed{2} #### 3 and finally 4"
    assert extract_numeric_answer(text) == 3
    assert extract_numeric_answer("The answer is 1. \\boxed{2} and finally 4") == 2
    assert extract_numeric_answer("The answer is 1, and finally 4") == 1
    assert extract_numeric_answer("first 1, and finally 4") == 4
    # A marker without a number falls through to the next rule.
    assert extract_numeric_answer("#### unknown, but 12") == 12


def test_find_numbers_and_parse_number():
    assert find_numbers("3,5 and 1,000 or 2.5") == [3, 5, 1000, Fraction(5, 2)]
    assert parse_number(" 1,080 ") == 1080
    assert parse_number(b"-3") == -3
    assert parse_number(7) == 7
    assert parse_number(0.25) == Fraction(1, 4)
    assert parse_number(float("nan")) is None
    assert parse_number(True) is None
    assert parse_number("none") is None


def test_numbers_match_exact_and_tolerant():
    third = Fraction(1, 3)
    assert numbers_match(Fraction(1, 3), third)
    assert numbers_match(Fraction("0.3333333333"), third)  # within 1e-6 relative
    assert not numbers_match(Fraction("0.333"), third)
    assert not numbers_match(Fraction("0.3333333333"), third, rel_tol=0.0)
    assert numbers_match(Fraction("18.00"), Fraction(18), rel_tol=0.0)
    # Integer gold answers are compared exactly, however large.
    assert not numbers_match(Fraction(2_880_001), Fraction(2_880_000))
    assert not numbers_match(Fraction("18.0000001"), Fraction(18))


@pytest.mark.parametrize(
    ("completion", "gold", "reward"),
    [
        ("#### 1,080", "1,080", 1.0),
        ("The total is $1080.", "1,080", 1.0),
        ("1080.0", 1080, 1.0),
        ("1081", "1080", 0.0),
        ("The answer is 1/2", "0.5", 1.0),
        ("-10", "-10", 1.0),
        ("10", "-10", 0.0),
        ("", "3", 0.0),
        ("I don't know", "3", 0.0),
        (None, "3", 0.0),
        (b"#### 3", "3", 1.0),
        ([3], "3", 0.0),  # not text
    ],
)
def test_numeric_reward(completion, gold, reward):
    assert numeric_reward(completion, gold) == reward


def test_numeric_reward_rejects_gold_without_a_number():
    with pytest.raises(ValueError, match="holds no number"):
        numeric_reward("3", "three")


@settings(max_examples=300)
@given(st.text(max_size=300), st.integers(-(10**6), 10**6))
def test_numeric_reward_never_raises_on_text(completion, gold):
    assert numeric_reward(completion, gold) in (0.0, 1.0)


@settings(max_examples=300)
@given(st.text(alphabet="0123456789,.$-/%# \nanswerisboxed{}\\:", max_size=200))
def test_numeric_reward_never_raises_on_number_like_text(completion):
    reward = numeric_reward(completion, "12")
    assert reward in (0.0, 1.0)
    value = extract_numeric_answer(completion)
    assert value is None or isinstance(value, Fraction)
