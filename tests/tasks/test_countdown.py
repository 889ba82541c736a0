"""Countdown: search, generation, parser and verifier.

The rule under test: exact rational arithmetic, non-integer intermediates allowed, each
given number used at most as often as given, the value must equal the target exactly.
"""

import ast
import itertools
import random
import re
import time
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gac_jax.tasks.countdown import (
    MAX_DEPTH,
    ExpressionError,
    check_countdown,
    countdown_reward,
    evaluate_expression,
    extract_countdown_answer,
    format_prompt,
    parse_expression,
    reachable,
    sample_problem,
    solve,
)

# --------------------------------------------------------------- independent references


def _ast_value(text):
    """Python's own parser with Fraction arithmetic: the reference evaluator."""
    ops = {
        ast.Add: lambda a, b: a + b,
        ast.Sub: lambda a, b: a - b,
        ast.Mult: lambda a, b: a * b,
        ast.Div: lambda a, b: a / b,
    }

    def walk(node):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            return ops[type(node.op)](walk(node.left), walk(node.right))
        raise ValueError(f"not a countdown expression: {ast.dump(node)}")

    return walk(ast.parse(text, mode="eval"))


def _brute_force_values(numbers, integer_only):
    """Every value reachable by repeatedly combining two of the remaining numbers (the
    classic 24-game search, without memoisation or subsets)."""
    seen = set()

    def combine(a, b):
        out = [a + b, a * b, a - b, b - a]
        if b != 0:
            out.append(a / b)
        if a != 0:
            out.append(b / a)
        if integer_only:
            out = [v for v in out if v > 0 and v.denominator == 1]
        return out

    def visit(values):
        seen.update(values)
        for i, j in itertools.combinations(range(len(values)), 2):
            rest = [v for k, v in enumerate(values) if k not in (i, j)]
            for v in combine(values[i], values[j]):
                visit((*rest, v))

    visit(tuple(Fraction(n) for n in numbers))
    return seen


def _nesting(text):
    depth = deepest = 0
    for c in text:
        depth += (c == "(") - (c == ")")
        deepest = max(deepest, depth)
    return deepest


# ------------------------------------------------------------------------------ search


def test_solve_finds_the_example_of_the_design():
    solution = solve([3, 5, 7], 22)
    assert _ast_value(solution) == 22
    assert check_countdown(solution, [3, 5, 7], 22).correct


def test_solve_returns_none_when_unreachable():
    assert solve([1, 1], 5) is None
    assert solve([2, 3], 7, integer_only=False) is None


def test_solve_uses_the_fewest_numbers():
    assert solve([5, 4, 100, 3], 9) in ("5+4", "4+5")


def test_integer_only_search_misses_targets_that_need_fractions():
    # 6 / (1 - 6/8) = 24 is the only way, and it needs a non-integer intermediate.
    assert solve([1, 6, 6, 8], 24) is None
    solution = solve([1, 6, 6, 8], 24, integer_only=False)
    assert solution is not None
    assert _ast_value(solution) == 24
    assert check_countdown(solution, [1, 6, 6, 8], 24).correct


@settings(max_examples=15)
@given(
    st.lists(st.integers(1, 12), min_size=1, max_size=4),
    st.booleans(),
)
def test_reachable_matches_brute_force_and_every_expression_verifies(numbers, integer_only):
    values = reachable(numbers, integer_only=integer_only)
    assert set(values) == _brute_force_values(numbers, integer_only)
    for value, expression in values.items():
        assert _ast_value(expression) == value
        if Fraction(value).denominator == 1:
            assert check_countdown(expression, numbers, int(value)).correct, expression


@pytest.mark.parametrize(
    "bad", [[], [1, 2, 3, 4, 5, 6], [0, 3], [-2, 5]], ids=["empty", "six", "zero", "negative"]
)
def test_reachable_rejects_bad_numbers(bad):
    with pytest.raises(ValueError, match="Countdown"):
        reachable(bad)


# -------------------------------------------------------------------------- generation


@pytest.mark.parametrize(
    ("n", "max_number", "target_range", "min_used"),
    [(3, 20, (10, 100), 2), (4, 50, (10, 300), 3), (5, 100, (100, 999), 4)],
)
def test_sample_problem_respects_its_ranges(n, max_number, target_range, min_used):
    rng = random.Random(0)
    for _ in range(10):
        problem = sample_problem(
            rng,
            num_numbers=n,
            min_number=1,
            max_number=max_number,
            min_target=target_range[0],
            max_target=target_range[1],
            min_used=min_used,
        )
        assert len(problem.numbers) == n
        assert all(1 <= x <= max_number for x in problem.numbers)
        assert target_range[0] <= problem.target <= target_range[1]
        assert problem.target not in problem.numbers
        assert _ast_value(problem.solution) == problem.target
        assert check_countdown(problem.solution, problem.numbers, problem.target).correct
        # No sub-multiset of fewer than min_used numbers makes the target.
        for size in range(1, min_used):
            for subset in itertools.combinations(problem.numbers, size):
                assert problem.target not in _brute_force_values(subset, integer_only=False)


def test_sample_problem_is_deterministic():
    kwargs = dict(num_numbers=4, min_number=1, max_number=20, min_target=10, max_target=200)
    a = [sample_problem(random.Random(7), **kwargs) for _ in range(3)]
    b = [sample_problem(random.Random(7), **kwargs) for _ in range(3)]
    assert a == b


def test_sample_problem_rejects_bad_ranges_and_impossible_targets():
    rng = random.Random(0)
    with pytest.raises(ValueError, match="min_number"):
        sample_problem(rng, num_numbers=3, min_number=5, max_number=2, min_target=1, max_target=9)
    with pytest.raises(ValueError, match="num_numbers"):
        sample_problem(rng, num_numbers=6, min_number=1, max_number=9, min_target=1, max_target=9)
    with pytest.raises(ValueError, match="No target"):
        sample_problem(
            rng,
            num_numbers=2,
            min_number=1,
            max_number=2,
            min_target=100,
            max_target=200,
            max_tries=20,
        )


def test_prompt_format():
    assert format_prompt([3, 5, 7], 22) == "Use 3 5 7 to make 22: "


# ---------------------------------------------------------------------- the verifier

NUMBERS, TARGET = [3, 5, 7], 22


@pytest.mark.parametrize(
    "completion",
    [
        "5*3+7",
        "7+3*5",
        " 5 * 3 + 7 ",
        "\n5*3+7\n",  # surrounding whitespace is stripped before the first line is taken
        "(5*3)+7",
        "((5)*(3))+7",
        "5*3+7 = 22",
        "5*3+7=22",
        "5*3+7\nsome text after the newline",
        "<answer>5*3+7</answer>",
        "thinking 1+1... <answer>4</answer> no wait <answer> 5*3+7 </answer>",
        b"5*3+7",
    ],
)
def test_correct_answers(completion):
    verdict = check_countdown(completion, NUMBERS, TARGET)
    assert verdict.correct, verdict
    assert verdict.value == TARGET
    assert countdown_reward(completion, NUMBERS, TARGET) == 1.0


@pytest.mark.parametrize(
    ("numbers", "target", "completion", "reason"),
    [
        # Division by zero anywhere is wrong, not an error.
        ([3, 3, 5], 5, "5/(3-3)", "division by zero"),
        ([2, 2, 2, 5], 0, "5*(2/(2-2))", "division by zero"),
        # A number used more often than given, or not given at all.
        ([3, 5, 7], 22, "5*5-3", "number used too often: 5"),
        ([3, 5, 7], 10, "5+5", "number used too often: 5"),
        ([3, 5, 7], 22, "4*5+2", "number not given: 4"),
        ([3, 5, 7], 15, "15", "number not given: 15"),
        # The value must be exact: no rounding of a non-integer result.
        ([7, 2], 3, "7/2", "makes 7/2, target is 3"),
        ([7, 2], 4, "7/2", "makes 7/2, target is 4"),
        ([3, 5, 7], 22, "3*5+5", "number used too often"),
        ([3, 5, 7], 22, "3*7+5", "makes 26, target is 22"),
        # A claimed result must be the target.
        ([3, 5, 7], 22, "5*3+7 = 23", "claims 23, target is 22"),
    ],
)
def test_wrong_but_well_formed_answers(numbers, target, completion, reason):
    verdict = check_countdown(completion, numbers, target)
    assert not verdict.correct
    assert verdict.well_formed
    assert reason in verdict.reason
    assert countdown_reward(completion, numbers, target) == 0.0
    assert countdown_reward(completion, numbers, target, format_score=0.1) == 0.1


def test_non_integer_intermediates_are_allowed():
    assert check_countdown("8/3*3", [8, 3, 3], 8).correct
    assert check_countdown("4/6*3", [3, 4, 6], 2).correct
    assert check_countdown("8/(3-8/3)", [3, 3, 8, 8], 24).correct
    assert check_countdown("(1/2+3)*8", [1, 2, 3, 8], 28).correct


def test_duplicated_given_numbers_may_each_be_used_once():
    assert check_countdown("5*5-3", [5, 5, 3], 22).correct
    assert not check_countdown("5*5*5", [5, 5, 3], 125).correct


def test_unused_numbers_are_allowed():
    assert check_countdown("5*3+7", [3, 5, 7, 9, 11], 22).correct


@pytest.mark.parametrize(
    "completion",
    [
        "",
        "   ",
        "so:\n5*3+7",  # the answer stops at the first newline
        "5*",
        "*5",
        "(5+3",
        "5+3)",
        "5 3",
        "()",
        "-5+27",  # no unary minus
        "+5*3+7",
        "5**3",
        "5^3",
        "5.0*3+7",
        "five times three plus seven",
        "5*3+7 = twenty-two",
        "5*3+7 = 22 = 22",
        "5×3+7",
        "<answer></answer>",
        "(" * (MAX_DEPTH + 1) + "5" + ")" * (MAX_DEPTH + 1) + "*3+7",
        "9" * 30 + "-" + "9" * 30,
        None,
        22,
        ["5*3+7"],
    ],
)
def test_malformed_answers_score_zero(completion):
    verdict = check_countdown(completion, NUMBERS, TARGET)
    assert not verdict.correct
    assert not verdict.well_formed
    assert countdown_reward(completion, NUMBERS, TARGET, format_score=0.1) == 0.0


def test_nesting_up_to_the_limit_parses():
    text = "(" * MAX_DEPTH + "5" + ")" * MAX_DEPTH + "*3+7"
    assert check_countdown(text, NUMBERS, TARGET).correct


@pytest.mark.parametrize(
    "completion",
    [
        "1+" * 500_000 + "1",
        "(" * 500_000 + "5" + ")" * 500_000,
        "9" * 1_000_000,
        "5*3+7" + " " * 1_000_000,  # trailing whitespace is stripped
        "x" * 1_000_000 + "\n5*3+7",
    ],
    ids=["long-sum", "deep-parens", "long-literal", "long-whitespace", "long-junk"],
)
def test_very_long_output_is_rejected_quickly(completion):
    start = time.perf_counter()
    verdict = check_countdown(completion, NUMBERS, TARGET)
    assert time.perf_counter() - start < 1.0
    assert verdict.correct == completion.startswith("5*3+7")


def test_extract_countdown_answer():
    assert extract_countdown_answer("  5*3+7 = 22\nmore") == "5*3+7 = 22"
    assert extract_countdown_answer("a <answer>1+2</answer> b <answer>\n3+4\n</answer>") == "3+4"


def test_parse_expression_trees_and_errors():
    assert parse_expression("1+2*3") == ("+", ("num", 1), ("*", ("num", 2), ("num", 3)))
    assert parse_expression("8-2-1") == ("-", ("-", ("num", 8), ("num", 2)), ("num", 1))
    assert evaluate_expression(parse_expression("8/(4-2)/2")) == 2
    with pytest.raises(ExpressionError, match="empty"):
        parse_expression(" ")
    with pytest.raises(ExpressionError, match="deeper"):
        parse_expression("(" * 40 + "1" + ")" * 40)
    with pytest.raises(ExpressionError, match="longer"):
        parse_expression("1+" * 200 + "1")
    with pytest.raises(ExpressionError, match="unexpected character"):
        parse_expression("1+a")
    with pytest.raises(ZeroDivisionError):
        evaluate_expression(parse_expression("1/(2-2)"))


# ---------------------------------------------------------------------- property tests


@settings(max_examples=300)
@given(st.text(max_size=300), st.floats(0.0, 1.0))
def test_random_text_never_raises(completion, format_score):
    reward = countdown_reward(completion, NUMBERS, TARGET, format_score=format_score)
    assert isinstance(reward, float)
    assert reward in (0.0, format_score, 1.0)


@settings(max_examples=500)
@given(st.text(alphabet="0123456789+-*/() =\n<>answer", max_size=120))
def test_expression_alphabet_strings_never_raise(completion):
    verdict = check_countdown(completion, [1, 2, 3, 5, 8], 13)
    assert isinstance(verdict.correct, bool)
    assert countdown_reward(completion, [1, 2, 3, 5, 8], 13) in (0.0, 1.0)


@settings(max_examples=500)
@given(st.text(alphabet="123456789+-*/()", min_size=1, max_size=60))
def test_parser_agrees_with_pythons_parser(text):
    # Without 0 there are no leading zeros, which Python rejects and the parser reads.
    try:
        tree = parse_expression(text)
    except ExpressionError:
        accepted = False
    else:
        accepted = True
    try:
        expected = _ast_value(text)
        python_accepts = True
    except ZeroDivisionError:
        expected = ZeroDivisionError
        python_accepts = True
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        python_accepts = False
    if accepted:
        assert python_accepts, text
        try:
            value = evaluate_expression(tree)
        except ZeroDivisionError:
            value = ZeroDivisionError
        assert value == expected, text
    elif python_accepts:
        # The only reasons to refuse what Python reads: a unary sign, which the countdown
        # grammar does not have, and the nesting and literal-length limits.
        unary = text.lstrip("(").startswith(("-", "+")) or any(
            f"{op}{sign}" in text for op in "+-*/(" for sign in "+-"
        )
        too_deep = _nesting(text) > MAX_DEPTH
        too_long_literal = any(len(run) > 9 for run in re.findall(r"\d+", text))
        assert unary or too_deep or too_long_literal, text
