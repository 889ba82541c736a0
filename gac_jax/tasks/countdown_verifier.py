"""The Countdown verifier: reads, parses and judges an answer, with no ``eval``.

The arithmetic rule: an answer is an expression over the four binary operators and
parentheses (no unary minus, no other literals) in which each given number appears at
most as many times as it was given; it is evaluated in exact rational arithmetic
(`fractions.Fraction`), so non-integer intermediates are allowed (``8/3*3`` makes 8); a
division by zero makes the answer wrong; the value must equal the target exactly.

The answer is read from a completion as follows: the content of the last
``<answer>...</answer>`` if there is one, else the whole completion; then, after
stripping surrounding whitespace, up to the first newline. An optional ``= N`` suffix is
accepted, and N must then equal the target.

The parser is a small tokenizer and a recursive descent with length and depth limits.
Problems, their generation and the reference search are in `gac_jax.tasks.countdown`.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from fractions import Fraction
from typing import NamedTuple

__all__ = ["MAX_ANSWER_CHARS", "MAX_DEPTH", "CountdownVerdict", "ExpressionError",
           "check_countdown", "countdown_reward", "evaluate_expression",
           "extract_countdown_answer", "parse_expression"]  # fmt: skip

#: Longest answer (in characters, after extraction) the parser reads.
MAX_ANSWER_CHARS = 200
#: Deepest nesting of parentheses the parser accepts.
MAX_DEPTH = 16
# Longest literal: bounds int() on adversarial digit runs; the given numbers are short.
_MAX_LITERAL_DIGITS = 9

_OPEN_TAG, _CLOSE_TAG = "<answer>", "</answer>"
# The binary operators; `Fraction` division raises ZeroDivisionError on a zero divisor.
_OPERATORS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}


class CountdownVerdict(NamedTuple):
    """The verifier's judgement of one completion."""

    correct: bool  # the answer makes the target under the rules
    well_formed: bool  # the answer parses as an expression
    reason: str  # "correct" or why not, for diagnostics
    value: Fraction | None  # the expression's value, when it has one


class ExpressionError(ValueError):
    """An answer that is not a well-formed Countdown expression."""


def extract_countdown_answer(completion: str) -> str:
    """The answer part of a completion: the last ``<answer>...</answer>`` content if any,
    else the completion; surrounding whitespace stripped, cut at the first newline."""
    tagged = _last_tagged(completion)
    text = completion if tagged is None else tagged
    return text.strip().split("\n", 1)[0].strip()


def _last_tagged(text: str) -> str | None:
    """The content of the last match of a left-to-right scan for ``<answer>(.*?)</answer>``
    (dot matching newlines), or None, in linear time (that regex is quadratic on thousands
    of unclosed ``<answer>`` tags). Each match pairs the first opening tag after the
    previous match with the first closing tag after it, so the last one closes at the first
    closing tag after the last opening tag that some closing tag follows, and opens at the
    first opening tag after the closing tag before that one."""
    last_close = text.rfind(_CLOSE_TAG)
    last_open = text.rfind(_OPEN_TAG, 0, max(last_close, 0))
    if last_close < 0 or last_open < 0:
        return None
    close = text.find(_CLOSE_TAG, last_open + len(_OPEN_TAG))
    previous_close = text.rfind(_CLOSE_TAG, 0, close)
    start = 0 if previous_close < 0 else previous_close + len(_CLOSE_TAG)
    return text[text.find(_OPEN_TAG, start) + len(_OPEN_TAG) : close]


def _tokenize(text: str) -> list[tuple[str, int | None]]:
    tokens: list[tuple[str, int | None]] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in " \t\r":
            i += 1
        elif c in "+-*/()":
            tokens.append((c, None))
            i += 1
        elif "0" <= c <= "9":
            j = i
            while j < n and "0" <= text[j] <= "9":
                j += 1
            if j - i > _MAX_LITERAL_DIGITS:
                raise ExpressionError(f"number too long at position {i}")
            tokens.append(("num", int(text[i:j])))
            i = j
        else:
            raise ExpressionError(f"unexpected character {c!r} at position {i}")
    return tokens


class _Parser:
    """Recursive descent over ``expr := term (("+"|"-") term)*``,
    ``term := atom (("*"|"/") atom)*``, ``atom := NUMBER | "(" expr ")"``.

    Trees are ``("num", n)`` or ``(op, left, right)``.
    """

    # The operators of `expr` (level 0) and of `term` (level 1); level 2 is `atom`.
    LEVELS = (("+", "-"), ("*", "/"))

    def __init__(self, tokens, max_depth: int):
        self.tokens = tokens
        self.pos = 0
        self.max_depth = max_depth

    def peek(self) -> str | None:
        return self.tokens[self.pos][0] if self.pos < len(self.tokens) else None

    def expr(self, depth: int, level: int = 0):
        """An ``expr`` (`level` 0) or a ``term`` (`level` 1): a left-associative chain of
        the level's operators over operands of the next level."""
        if level == len(self.LEVELS):
            return self.atom(depth)
        tree = self.expr(depth, level + 1)
        while (op := self.peek()) in self.LEVELS[level]:
            self.pos += 1
            tree = (op, tree, self.expr(depth, level + 1))
        return tree

    def atom(self, depth: int):
        kind = self.peek()
        if kind == "num":  # The token is the tree: ("num", n).
            self.pos += 1
            return self.tokens[self.pos - 1]
        if kind == "(":
            if depth >= self.max_depth:
                raise ExpressionError(f"parentheses nested deeper than {self.max_depth}")
            self.pos += 1
            tree = self.expr(depth + 1)
            if self.peek() != ")":
                raise ExpressionError("unbalanced parentheses")
            self.pos += 1
            return tree
        found = "end of input" if kind is None else repr(kind)
        raise ExpressionError(f"expected a number or '(' but found {found}")


def parse_expression(
    text: str, *, max_length: int = MAX_ANSWER_CHARS, max_depth: int = MAX_DEPTH
) -> tuple:
    """The tree (``("num", n)`` or ``(op, left, right)``, op one of ``+ - * /``) of an
    expression such as ``"(8-2)*4"`` over non-negative integer literals, + - * / and
    parentheses (no unary operators). ExpressionError if `text` is empty, longer than
    `max_length` characters, nested deeper than `max_depth` or malformed."""
    if len(text) > max_length:
        raise ExpressionError(f"answer longer than {max_length} characters")
    tokens = _tokenize(text)
    if not tokens:
        raise ExpressionError("empty answer")
    parser = _Parser(tokens, max_depth)
    tree = parser.expr(0)
    if parser.pos != len(tokens):
        raise ExpressionError(f"unexpected {tokens[parser.pos][0]!r} after a complete expression")
    return tree


def _literals(tree) -> list[int]:
    out, stack = [], [tree]
    while stack:
        node = stack.pop()
        if node[0] == "num":
            out.append(node[1])
        else:
            stack.extend((node[2], node[1]))
    return out


def evaluate_expression(tree) -> Fraction:
    """The exact value of a tree from `parse_expression` (ZeroDivisionError if it divides by
    zero)."""
    if tree[0] == "num":
        return Fraction(tree[1])
    op, left, right = tree
    return _OPERATORS[op](evaluate_expression(left), evaluate_expression(right))


def _verdict(completion, numbers: Sequence[int], target: int) -> CountdownVerdict:
    if isinstance(completion, bytes):
        completion = completion.decode("utf-8", errors="replace")
    if not isinstance(completion, str):
        return CountdownVerdict(False, False, "completion is not text", None)
    answer = extract_countdown_answer(completion)
    if not answer:
        return CountdownVerdict(False, False, "empty answer", None)
    if len(answer) > MAX_ANSWER_CHARS:
        return CountdownVerdict(False, False, "answer too long", None)
    claimed = None
    if "=" in answer:
        answer, _, rhs = answer.partition("=")
        rhs = rhs.strip()
        if not (rhs.isascii() and rhs.isdigit()) or len(rhs) > _MAX_LITERAL_DIGITS:
            return CountdownVerdict(False, False, f"malformed result after '=': {rhs!r}", None)
        claimed = int(rhs)
    try:
        tree = parse_expression(answer)
    except ExpressionError as e:
        return CountdownVerdict(False, False, f"malformed: {e}", None)
    available = list(numbers)
    for n in _literals(tree):
        if n in available:
            available.remove(n)
        elif n in numbers:
            return CountdownVerdict(False, True, f"number used too often: {n}", None)
        else:
            return CountdownVerdict(False, True, f"number not given: {n}", None)
    try:
        value = evaluate_expression(tree)
    except ZeroDivisionError:
        return CountdownVerdict(False, True, "division by zero", None)
    if claimed is not None and claimed != target:
        return CountdownVerdict(False, True, f"claims {claimed}, target is {target}", value)
    if value != target:
        return CountdownVerdict(False, True, f"makes {value}, target is {target}", value)
    return CountdownVerdict(True, True, "correct", value)


def check_countdown(completion: str, numbers: Sequence[int], target: int) -> CountdownVerdict:
    """The `CountdownVerdict` of a completion (anything: non-text is malformed) under the
    rules in this module's docstring. Never raises on any completion."""
    numbers = [int(n) for n in numbers]
    target = int(target)
    try:
        return _verdict(completion, numbers, target)
    except Exception as e:  # model output must never crash a reward
        return CountdownVerdict(False, False, f"unexpected {type(e).__name__}", None)


def countdown_reward(
    completion: str, numbers: Sequence[int], target: int, *, format_score: float = 0.0
) -> float:
    """1.0 for a correct answer, `format_score` (in [0, 1]) for a well-formed but wrong one
    (it parses as an expression, `check_countdown`), else 0.0. Never raises."""
    verdict = check_countdown(completion, numbers, target)
    if verdict.correct:
        return 1.0
    return float(format_score) if verdict.well_formed else 0.0
