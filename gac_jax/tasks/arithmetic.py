"""Multi-digit arithmetic: ``37+48=`` -> ``85``, optionally with a scratchpad.

Operators are ``+``, ``-`` and ``*`` on operands of a fixed number of digits. Subtraction
keeps the first operand at least as large as the second (no negative results).

The scratchpad is one line of steps separated by ``;`` whose last item is the answer,
written digit by digit as a person would on paper:

* addition, column by column from the right with the carry: ``37+48`` ->
  ``7+8=15;3+4+1=8;85``;
* subtraction, column by column with borrowing (a borrowed column shows its top digit
  plus ten): ``52-17`` -> ``12-7=5;4-1=3;35``;
* multiplication, one partial product per non-zero digit of the second operand, then
  their sum: ``37*48`` -> ``37*8=296;37*40=1480;296+1480=1776;1776``.

Answers are read up to the first newline and scored by `gac_jax.tasks.rewards`
(the last number on that line, or an explicit ``#### N`` / ``answer is N``).
"""

from __future__ import annotations

import operator
import random
from typing import NamedTuple

from gac_jax.tasks.rewards import numeric_reward

__all__ = ["OPERATORS", "ArithmeticProblem", "arithmetic_reward", "format_prompt",
           "sample_problem", "scratchpad"]  # fmt: skip

#: The supported operators.
OPERATORS = ("+", "-", "*")
_APPLY = {"+": operator.add, "-": operator.sub, "*": operator.mul}


class ArithmeticProblem(NamedTuple):
    """One arithmetic problem."""

    a: int  # first operand
    op: str  # one of OPERATORS
    b: int  # second operand
    answer: int  # a op b


def sample_problem(rng: random.Random, *, op: str, digits: int) -> ArithmeticProblem:
    """Draws operands of exactly `digits` (>= 1) digits each, uniformly from `rng`; for ``-``
    the larger operand comes first. ValueError on an unknown `op` or digits < 1."""
    if op not in OPERATORS:
        raise ValueError(f"Unknown operator {op!r}; expected one of {OPERATORS}.")
    if digits < 1:
        raise ValueError(f"digits must be >= 1, got {digits}.")
    low, high = 10 ** (digits - 1), 10**digits - 1
    a, b = rng.randint(low, high), rng.randint(low, high)
    if op == "-" and a < b:
        a, b = b, a
    return ArithmeticProblem(a, op, b, _APPLY[op](a, b))


def format_prompt(a: int, op: str, b: int) -> str:
    """The task prompt, e.g. ``"37+48="``."""
    return f"{int(a)}{op}{int(b)}="


def _digits_lsb(n: int, width: int) -> list[int]:
    return [(n // 10**i) % 10 for i in range(width)]


def _add_steps(a: int, b: int) -> list[str]:
    width = max(len(str(a)), len(str(b)))
    steps, carry = [], 0
    for x, y in zip(_digits_lsb(a, width), _digits_lsb(b, width), strict=True):
        total = x + y + carry
        steps.append(f"{x}+{y}+{carry}={total}" if carry else f"{x}+{y}={total}")
        carry = total // 10
    return steps


def _sub_steps(a: int, b: int) -> list[str]:
    width = len(str(a))
    steps, borrow = [], 0
    for x, y in zip(_digits_lsb(a, width), _digits_lsb(b, width), strict=True):
        top = x - borrow
        borrow = int(top < y)
        top += 10 * borrow
        steps.append(f"{top}-{y}={top - y}")
    return steps


def _mul_steps(a: int, b: int) -> list[str]:
    partials, steps = [], []
    for i, y in enumerate(_digits_lsb(b, len(str(b)))):
        if y:
            factor = y * 10**i
            partials.append(a * factor)
            steps.append(f"{a}*{factor}={a * factor}")
    if len(partials) > 1:
        steps.append("+".join(map(str, partials)) + f"={sum(partials)}")
    return steps


def scratchpad(a: int, op: str, b: int) -> str:
    """The worked single-line solution of ``a op b``: steps separated by ``;``, the last item
    the answer (module docstring). ValueError on an unknown operator, a negative operand, or
    a < b for ``-``."""
    a, b = int(a), int(b)
    if a < 0 or b < 0:
        raise ValueError(f"Operands must be non-negative, got a={a}, b={b}.")
    if op == "-" and a < b:
        raise ValueError(f"Subtraction needs a >= b, got a={a}, b={b}.")
    steps = {"+": _add_steps, "-": _sub_steps, "*": _mul_steps}.get(op)
    if steps is None:
        raise ValueError(f"Unknown operator {op!r}; expected one of {OPERATORS}.")
    return ";".join([*steps(a, b), str(_APPLY[op](a, b))])


def arithmetic_reward(completion: str, answer: int) -> float:
    """1.0 if the number a completion ends its first line with equals `answer`, else 0.0
    (non-text too). Never raises on any completion."""
    try:
        if isinstance(completion, bytes):
            completion = completion.decode("utf-8", errors="replace")
        if not isinstance(completion, str):
            return 0.0
        first_line = completion.strip().split("\n", 1)[0]
        return numeric_reward(first_line, int(answer), rel_tol=0.0)
    except Exception:  # model output must never crash a reward
        return 0.0
