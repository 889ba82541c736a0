"""Argument checks shared by the transformation factories and the objectives. Numbers are
checked only when concrete (not traced arrays from `optax.inject_hyperparams`); strings and
other static choices always are.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable

import numpy as np


def concrete_number(value) -> float | None:
    """The value as a Python float if it is a concrete scalar, else None (e.g. a tracer)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Real):
        return float(value)
    try:
        array = np.asarray(value)  # Raises for tracers.
    except Exception:  # noqa: BLE001 - any failure means "not concrete"
        return None
    if array.shape == () and np.issubdtype(array.dtype, np.number):
        return float(array)
    return None


def check_range(name: str, value, low: float, high: float, *, low_open=False, high_open=False):
    """Raises ValueError if a concrete `value` lies outside the interval [low, high]."""
    number = concrete_number(value)
    if number is None:
        return
    too_low = number <= low if low_open else number < low
    too_high = number >= high if high_open else number > high
    if too_low or too_high or np.isnan(number):
        left = "(" if low_open else "["
        right = ")" if high_open else "]"
        raise ValueError(f"{name}={value!r} is outside {left}{low}, {high}{right}.")


def check_choice(name: str, value, choices: Iterable[str]):
    """Raises ValueError naming the valid choices if `value` is not one of them."""
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"{name}={value!r} is unknown; expected one of {sorted(choices)}.")


def check_int(name: str, value, low: int | None = None, *, allow_none: bool = False, note=""):
    """Raises ValueError unless `value` is an int (a bool is not one) and at least `low`,
    or None where `allow_none`: the one check of the configs' integer fields."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or (low is not None and value < low):
        bound = "an int" if low is None else f"an int >= {low}"
        others = " or None" if allow_none else ""
        raise ValueError(f"{name}={value!r} must be {bound}{others}{note}.")


def check_bool(name: str, value, *, allow_none: bool = False):
    """Raises ValueError unless `value` is True or False (or None where `allow_none`)."""
    if not isinstance(value, bool) and not (value is None and allow_none):
        raise ValueError(
            f"{name}={value!r} must be true or false{' or null' if allow_none else ''}."
        )
