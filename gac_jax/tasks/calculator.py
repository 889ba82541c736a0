"""Arithmetic with a calculator tool: a multi-turn task the tiny policy can learn offline.

A problem is ``a*b+c`` or ``a*b-c`` (a of 2-3 digits, b of 1-2, c of 1-3): too much for a
tiny character model to multiply in its head, easy with a calculator. The policy calls the
tool by writing one operation in angle brackets; the environment (`Calculator`) answers
with the value; the policy writes the final answer after ``=`` and ends the episode::

    prompt       347*29+18?
    policy       <347*29>
    calculator   10063
    policy        <10063+18>
    calculator   10081
    policy        =10081<eos>

`reference_turns` gives that transcript, for the supervised warm start. The reward is 1
when the text ends with ``=N`` and N is the answer, else 0: calling the tool is never
rewarded by itself. `CalculatorTool` is the same calculator as a chat model's tool
(``env=gac_jax.tasks.calculator:CalculatorTool``, `gac_jax.tasks.tool_calls`).
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from typing import Any, NamedTuple

from gac_jax.tasks.environments import Observation
from gac_jax.tasks.tool_calls import ToolEnvironment, function_schema

__all__ = ["Calculator", "CalculatorProblem", "CalculatorTool", "calculator_reward", "evaluate",
           "format_prompt", "reference_turns", "sample_problem"]  # fmt: skip

TOOL_OPEN, TOOL_CLOSE = "<", ">"
_OPERATION = re.compile(r"^\s*(-?\d{1,9})\s*([-+*])\s*(-?\d{1,9})\s*$")
_NUMBER = re.compile(r"^\s*(-?\d{1,12})\s*$")
_FINAL = re.compile(r"=\s*(-?\d+)\s*$")


class CalculatorProblem(NamedTuple):
    a: int
    b: int
    op: str  # "+" or "-": the operation applied to a*b and c.
    c: int

    @property
    def answer(self) -> int:
        product = self.a * self.b
        return product + self.c if self.op == "+" else product - self.c


def sample_problem(rng: random.Random) -> CalculatorProblem:
    """One problem: a in [10, 999], b in [2, 99], c in [1, 999], op + or -."""
    return CalculatorProblem(
        rng.randint(10, 999), rng.randint(2, 99), rng.choice("+-"), rng.randint(1, 999)
    )


def _problem(example: Mapping[str, Any]) -> CalculatorProblem:
    op = example["op"]
    op = op.decode() if isinstance(op, bytes) else str(op)
    return CalculatorProblem(int(example["a"]), int(example["b"]), op, int(example["c"]))


def format_prompt(example: Mapping[str, Any]) -> str:
    p = _problem(example)
    return f"{p.a}*{p.b}{p.op}{p.c}?"


def reference_turns(example: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The worked transcript as ("policy" | "tool", text) turns: two tool calls, then the
    answer."""
    p = _problem(example)
    product = p.a * p.b
    return [
        ("policy", f"{TOOL_OPEN}{p.a}*{p.b}{TOOL_CLOSE}"),
        ("tool", str(product)),
        ("policy", f" {TOOL_OPEN}{product}{p.op}{p.c}{TOOL_CLOSE}"),
        ("tool", str(p.answer)),
        ("policy", f" ={p.answer}"),
    ]


def evaluate(expression: str) -> str:
    """The calculator: one integer operation (+, -, *) or one integer, evaluated exactly;
    anything else is ``"error: syntax"``."""
    match = _OPERATION.match(expression)
    if match:
        x, op, y = int(match[1]), match[2], int(match[3])
        return str(x + y if op == "+" else x - y if op == "-" else x * y)
    match = _NUMBER.match(expression)
    return str(int(match[1])) if match else "error: syntax"


def calculator_reward(transcript: str, answer: int) -> float:
    """1.0 if the transcript ends with ``=N`` and N == answer, else 0.0. N is compared as
    digits (leading zeros dropped), never converted: a number of any length is scored."""
    match = _FINAL.search(transcript)
    if match is None:
        return 0.0
    negative, digits = match[1].startswith("-"), match[1].lstrip("-").lstrip("0") or "0"
    written = "-" + digits if negative and digits != "0" else digits
    return float(written == str(int(answer)))


class Calculator:
    """The calculator environment: a turn ending in ``>`` is a tool call; the text after
    its last ``<`` is evaluated (`evaluate`) and the value is the observation."""

    turn_end = (TOOL_CLOSE,)

    def start(self, example: Mapping[str, Any]) -> None:
        return None

    def step(self, state: None, turn: str) -> Observation:
        call = turn[turn.rfind(TOOL_OPEN) + 1 : -len(TOOL_CLOSE)] if TOOL_OPEN in turn else ""
        return Observation(evaluate(call))

    def reward(self, state: None, transcript: str, example: Mapping[str, Any]) -> float:
        return calculator_reward(transcript, _problem(example).answer)


class CalculatorTool(ToolEnvironment):
    """The calculator as a chat model's tool (`gac_jax.tasks.tool_calls`): one function,
    ``calculator(expression)``; the episode ends at a turn without a call, and the reward
    is `calculator_reward` of the transcript (its final ``=N``)."""

    def __init__(self):
        super().__init__(
            {"calculator": evaluate},
            tools=[
                function_schema(
                    "calculator",
                    "Evaluates one integer operation a+b, a-b or a*b exactly.",
                    {"expression": "the operation, for example 347*29"},
                )
            ],
            reward=lambda transcript, example: calculator_reward(
                transcript, _problem(example).answer
            ),
        )
