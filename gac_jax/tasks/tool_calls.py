"""Tool calls in a chat model's turn, and an environment of Python functions that answers them.

Chat models whose template lists ``tools`` (Qwen2.5, Qwen3, Hermes and others) write a call
as the template writes an assistant message's ``tool_calls``::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "347*29"}}
    </tool_call>

`parse_tool_calls` reads the calls of a turn back (one that is not a JSON object with a
string ``name`` and an object ``arguments`` is a `MalformedCall`, answered with an error,
never raised). `ToolEnvironment` is an environment (`gac_jax.tasks.environments`) that
answers each call with its Python function's result as a ``tool`` message and ends the
episode at a turn that calls none; its turns end where the chat template ends an assistant
message (an empty `turn_end`). `gac_jax.tasks.calculator.CalculatorTool` is one.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gac_jax.tasks.environments import Observation

__all__ = ["MalformedCall", "ToolCall", "ToolEnvironment", "function_schema",
           "parse_tool_calls"]  # fmt: skip

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One call: the tool's name and its arguments."""

    name: str
    arguments: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class MalformedCall:
    """A ``<tool_call>`` block that is not a call, and why."""

    text: str
    reason: str


def parse_tool_calls(turn: str) -> list[ToolCall | MalformedCall]:
    """The calls of `turn`, in order: each ``<tool_call>...</tool_call>`` block holding a
    JSON object ``{"name": str, "arguments": object}`` (``arguments`` may also be a JSON
    string of an object, as some templates write it). Never raises."""
    return [_parse_call(match.group(1).strip()) for match in _CALL.finditer(turn)]


def _parse_call(text: str) -> ToolCall | MalformedCall:
    """One ``<tool_call>`` block's stripped content read as a call (`parse_tool_calls`)."""
    try:
        value = json.loads(text)
    except ValueError:
        return MalformedCall(text, "not JSON")
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return MalformedCall(text, "no name")
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            arguments = None
    if not isinstance(arguments, dict):
        return MalformedCall(text, "arguments are not an object")
    return ToolCall(value["name"], arguments)


def function_schema(name: str, description: str, parameters: Mapping[str, str]) -> dict:
    """The JSON schema of a function whose parameters are all required strings
    (`parameters`: name -> description), in the form chat templates take as ``tools``."""
    properties = {key: {"type": "string", "description": text} for key, text in parameters.items()}
    schema = {"type": "object", "properties": properties, "required": list(parameters)}
    function = {"name": name, "description": description, "parameters": schema}
    return {"type": "function", "function": function}


class ToolEnvironment:
    """An environment whose tools are Python functions, called by a chat model.

    Each call of a turn is answered, in order, by a ``tool`` message: ``str`` of the result
    of `functions[name](**arguments)`, or ``error: <what>`` for a call that names no
    function, has arguments the function refuses, or raises (the episode goes on). `tools`
    are the JSON schemas for the chat template (`function_schema`); `reward(transcript,
    example)` scores a finished episode.
    """

    turn_end: tuple[str, ...] = ()

    def __init__(
        self,
        functions: Mapping[str, Callable[..., Any]],
        tools: Sequence[Mapping[str, Any]],
        reward: Callable[[str, Mapping[str, Any]], float],
    ):
        self.functions = dict(functions)
        self.tools = [dict(tool) for tool in tools]
        self._reward = reward

    def start(self, example: Mapping[str, Any]) -> None:
        return None

    def step(self, state: None, turn: str) -> Observation:
        calls = parse_tool_calls(turn)
        if not calls:
            return Observation(done=True)
        return Observation(tuple(self.answer(call) for call in calls), role="tool")

    def answer(self, call: ToolCall | MalformedCall) -> str:
        """One call's result, or ``error: ...``."""
        if isinstance(call, MalformedCall):
            return f"error: malformed call ({call.reason})"
        function = self.functions.get(call.name)
        if function is None:
            return f"error: no tool {call.name!r}"
        try:
            return str(function(**call.arguments))
        except TypeError as error:
            return f"error: bad arguments ({error})"
        except Exception as error:  # noqa: BLE001 - the tool's own failure, as its answer
            return f"error: {type(error).__name__}"

    def reward(self, state: None, transcript: str, example: Mapping[str, Any]) -> float:
        return self._reward(transcript, example)
