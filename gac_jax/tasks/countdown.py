"""Countdown: reach a target from a few given numbers with + - * / and parentheses.

* **Search** (`reachable`, `solve`): exhaustive over expression trees, memoised over
  sub-multisets of the numbers (at most `MAX_NUMBERS`); every value gets the expression
  that uses the fewest numbers.
* **Generation** (`sample_problem`): numbers drawn uniformly, the target among the
  reachable values in a range, the reference solution from the search.
* **Verification** (`check_countdown`, `countdown_reward`, re-exported here): in
  `gac_jax.tasks.countdown_verifier` (exact rationals, no ``eval``).

The reference search (``integer_only=True``, used for generation) follows the classic
game's stricter rule, every intermediate a positive integer, so every reference solution
passes the verifier; ``integer_only=False`` searches under the verifier's own rule.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from fractions import Fraction
from typing import NamedTuple

from gac_jax.tasks.countdown_verifier import (
    MAX_ANSWER_CHARS,
    MAX_DEPTH,
    CountdownVerdict,
    ExpressionError,
    check_countdown,
    countdown_reward,
    evaluate_expression,
    extract_countdown_answer,
    parse_expression,
)

__all__ = ["MAX_ANSWER_CHARS", "MAX_DEPTH", "MAX_NUMBERS", "CountdownProblem", "CountdownVerdict",
           "ExpressionError", "check_countdown", "countdown_reward", "evaluate_expression",
           "extract_countdown_answer", "format_prompt", "parse_expression", "reachable",
           "sample_problem", "solve"]  # fmt: skip

#: Most numbers a problem may have: the search is exhaustive and grows quickly.
MAX_NUMBERS = 5

# Operator precedence for printing with the fewest parentheses.
_PREC_ATOM, _PREC_MUL, _PREC_ADD = 3, 2, 1


class CountdownProblem(NamedTuple):
    """One Countdown problem."""

    numbers: tuple[int, ...]  # the given numbers, in the order they are shown
    target: int  # the value to make
    solution: str  # a reference expression that makes the target


def _check_numbers(numbers: Sequence[int]) -> tuple[int, ...]:
    numbers = tuple(int(n) for n in numbers)
    if not 1 <= len(numbers) <= MAX_NUMBERS:
        raise ValueError(f"Countdown takes 1 to {MAX_NUMBERS} numbers, got {len(numbers)}.")
    if any(n < 1 for n in numbers):
        raise ValueError(f"Countdown numbers must be positive integers, got {numbers}.")
    return numbers


def _combine(left: dict, right: dict, lkey, rkey, out: dict, integer_only: bool) -> None:
    """Adds to `out` every value of ``l op r`` for l in `left`, r in `right` (both orders
    for - and /), with a back-pointer ``(op, lkey, l, rkey, r)``; first one wins."""
    for a in left:
        for b in right:
            for value, back in (
                (a + b, ("+", lkey, a, rkey, b)),
                (a * b, ("*", lkey, a, rkey, b)),
                (a - b, ("-", lkey, a, rkey, b)),
                (b - a, ("-", rkey, b, lkey, a)),
            ):
                if integer_only and value <= 0:
                    continue
                if value not in out:
                    out[value] = back
            if integer_only:
                if a % b == 0 and a // b not in out:
                    out[a // b] = ("/", lkey, a, rkey, b)
                if b % a == 0 and b // a not in out:
                    out[b // a] = ("/", rkey, b, lkey, a)
            else:
                if b != 0 and (q := a / b) not in out:
                    out[q] = ("/", lkey, a, rkey, b)
                if a != 0 and (q := b / a) not in out:
                    out[q] = ("/", rkey, b, lkey, a)


class _Search:
    """Values of the expressions over each sub-multiset of `numbers` that use all of it."""

    def __init__(self, numbers: tuple[int, ...], integer_only: bool):
        self.numbers = numbers
        self.integer_only = integer_only
        self.exact: dict[tuple[int, ...], dict] = {}

    def key(self, mask: int) -> tuple[int, ...]:
        return tuple(sorted(n for i, n in enumerate(self.numbers) if mask >> i & 1))

    def values(self, mask: int) -> dict:
        key = self.key(mask)
        found = self.exact.get(key)
        if found is not None:
            return found
        if mask & (mask - 1) == 0:  # one number
            value = key[0] if self.integer_only else Fraction(key[0])
            found = {value: None}
        else:
            found = {}
            # Each unordered split {sub, rest} once: sub holds the lowest set bit.
            low = mask & -mask
            sub = (mask - 1) & mask
            while sub:
                if sub & low:
                    rest = mask ^ sub
                    left, right = self.values(sub), self.values(rest)
                    _combine(left, right, self.key(sub), self.key(rest), found, self.integer_only)
                sub = (sub - 1) & mask
        self.exact[key] = found
        return found

    def render(self, key: tuple[int, ...], value) -> tuple[str, int]:
        back = self.exact[key][value]
        if back is None:
            return str(int(value)), _PREC_ATOM
        op, lkey, lval, rkey, rval = back
        left, lprec = self.render(lkey, lval)
        right, rprec = self.render(rkey, rval)
        prec = _PREC_ADD if op in "+-" else _PREC_MUL
        # Left operands need brackets only below the operator's precedence; right operands
        # of - and / also at equal precedence (a-(b-c), a/(b*c)). Exact arithmetic makes
        # a+(b-c) == a+b-c and a*(b/c) == a*b/c, so + and * never bracket an equal one.
        if lprec < prec:
            left = f"({left})"
        if rprec < prec or (rprec == prec and op in "-/"):
            right = f"({right})"
        return f"{left}{op}{right}", prec


def _fewest_numbers(numbers: tuple[int, ...], integer_only: bool) -> tuple[_Search, dict]:
    """The search, and for each reachable value the smallest sub-multiset that makes it."""
    search = _Search(numbers, integer_only)
    masks = sorted(range(1, 1 << len(numbers)), key=lambda m: (m.bit_count(), m))
    where: dict = {}
    for mask in masks:
        key = search.key(mask)
        for value in search.values(mask):
            where.setdefault(value, key)
    return search, where


def reachable(numbers: Sequence[int], *, integer_only: bool = True) -> dict:
    """A dict from every value that an expression over some of `numbers` (1 to
    `MAX_NUMBERS` positive integers, each used at most once) reaches to an expression that
    makes it with as few numbers as possible. Values are ints, or `Fraction`s when not
    `integer_only` (the verifier's rule). ValueError on empty, too many or non-positive
    `numbers`."""
    search, where = _fewest_numbers(_check_numbers(numbers), integer_only)
    return {value: search.render(key, value)[0] for value, key in where.items()}


def solve(numbers: Sequence[int], target: int, *, integer_only: bool = True) -> str | None:
    """An expression over `numbers` (each at most once) that makes `target` using as few
    numbers as possible, or None; `numbers` and `integer_only` as in `reachable`."""
    search, where = _fewest_numbers(_check_numbers(numbers), integer_only)
    key = where.get(target)
    return None if key is None else search.render(key, target)[0]


def sample_problem(
    rng: random.Random,
    *,
    num_numbers: int,
    min_number: int,
    max_number: int,
    min_target: int,
    max_target: int,
    min_used: int = 2,
    max_tries: int = 1000,
) -> CountdownProblem:
    """Draws one problem: numbers uniform in [min_number, max_number] (repeats allowed),
    target uniform among the values in [min_target, max_target] that are reachable with
    whole-number intermediates and need at least `min_used` of the numbers.

    `num_numbers` is 1 to `MAX_NUMBERS`; `min_used` (1 to num_numbers) of 2 or more keeps
    the given numbers themselves from being targets. The reference solution uses as few
    numbers as possible. ValueError on bad ranges, or if `max_tries` draws of numbers found
    no target.
    """
    if not 1 <= num_numbers <= MAX_NUMBERS:
        raise ValueError(f"num_numbers must be in [1, {MAX_NUMBERS}], got {num_numbers}.")
    if not 1 <= min_number <= max_number:
        raise ValueError(
            f"Need 1 <= min_number <= max_number, got min_number={min_number}, "
            f"max_number={max_number}."
        )
    if min_target > max_target:
        raise ValueError(f"min_target={min_target} exceeds max_target={max_target}.")
    if not 1 <= min_used <= num_numbers:
        raise ValueError(f"min_used must be in [1, num_numbers={num_numbers}], got {min_used}.")
    for _ in range(max_tries):
        numbers = tuple(rng.randint(min_number, max_number) for _ in range(num_numbers))
        search, where = _fewest_numbers(numbers, integer_only=True)
        candidates = sorted(
            v for v, key in where.items() if min_target <= v <= max_target and len(key) >= min_used
        )
        if candidates:
            target = rng.choice(candidates)
            return CountdownProblem(numbers, target, search.render(where[target], target)[0])
    raise ValueError(
        f"No target in [{min_target}, {max_target}] needing {min_used} or more numbers is "
        f"reachable from {num_numbers} numbers in [{min_number}, {max_number}] after "
        f"{max_tries} draws."
    )


def format_prompt(numbers: Sequence[int], target: int) -> str:
    """The task prompt, e.g. ``"Use 3 5 7 to make 22: "``."""
    return f"Use {' '.join(str(int(n)) for n in numbers)} to make {int(target)}: "
