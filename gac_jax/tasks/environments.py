"""Environments of multi-turn episodes: what answers a policy's turn, and how a run guards it.

An episode starts from a task example; the policy writes a turn, which ends with one of the
environment's `turn_end` strings (a tool call's closing tag) or with EOS (the episode's
end). At each turn's end the environment answers with an `Observation` (a tool's output,
feedback), which is appended to the context, or ends the episode (`done`). At the end,
`reward` scores the whole transcript. Environments are plain Python objects::

    class Calculator:
        turn_end = (">",)

        def start(self, example):          # An episode's own state (anything).
            return {}

        def step(self, state, turn):      # The turn's text, its turn_end included.
            return Observation(str(evaluate(turn[turn.rindex("<") + 1 : -1])))

        def reward(self, state, transcript, example):  # The text after the prompt.
            return float(final_answer(transcript) == example["answer"])

and are named by import path in a run (``env=package.module:Name``, like ``reward=``).

`GuardedEnvironment` is how the rollout side calls one, so that nothing a tool does stops
the run or blocks the decode loop.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import importlib
import logging
import threading
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

__all__ = ["ERROR_KINDS", "Environment", "GuardedEnvironment", "Observation", "environment_tools",
           "resolve_environment"]  # fmt: skip

logger = logging.getLogger(__name__)

ERROR_KINDS = ("raised", "timeout", "invalid")


@dataclasses.dataclass(frozen=True)
class Observation:
    """An environment's answer to a turn: `text` goes into the context (never trained on);
    `done` ends the episode instead (`text` is then ignored). With a chat template, `text`
    is the content of a message of `role` (``"tool"``: a tool's result; ``"user"``:
    feedback), rendered by the template (`gac_jax.tasks.chat_turns`); a tuple of texts is
    one message each (the results of a turn's several tool calls, as transformers renders
    them). Without a template, the text is appended as it is (a tuple's, one a line)."""

    text: str | tuple[str, ...] = ""
    done: bool = False
    role: str = "tool"

    @property
    def texts(self) -> tuple[str, ...]:
        """The messages' contents: `text` as a tuple (an empty tuple: one empty text)."""
        return (self.text,) if isinstance(self.text, str) else tuple(self.text) or ("",)

    @property
    def joined(self) -> str:
        """The plain text appended without a chat template."""
        return "\n".join(self.texts)


@runtime_checkable
class Environment(Protocol):
    """What a multi-turn task's environment provides (see the module docstring). It may
    also have `tools`, JSON schemas that a chat template writes into the prompt; with a chat
    template a turn also ends where the template ends an assistant message (``<|im_end|>``),
    so `turn_end` may be empty."""

    turn_end: tuple[str, ...]

    def start(self, example: Mapping[str, Any]) -> Any: ...

    def step(self, state: Any, turn: str) -> Observation | str: ...

    def reward(self, state: Any, transcript: str, example: Mapping[str, Any]) -> float: ...


def resolve_environment(spec: str) -> Environment:
    """An environment from ``"package.module:Name"`` (a class, instantiated with no
    arguments, or an object). Raises ValueError in one line naming what is wrong."""
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"env={spec!r} must be 'package.module:Name'.")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # noqa: BLE001 - user code: ImportError, SyntaxError, ...
        raise ValueError(
            f"env={spec!r}: cannot import {module_name!r} ({type(error).__name__}: {error})."
        ) from None
    try:
        target = getattr(module, attribute)
    except AttributeError:
        raise ValueError(f"env={spec!r}: {module_name!r} has no {attribute!r}.") from None
    try:
        env = target() if isinstance(target, type) else target
    except Exception as error:  # noqa: BLE001 - user code
        raise ValueError(
            f"env={spec!r}: {attribute}() raised {type(error).__name__}: {error} (an "
            "environment class is built with no arguments)."
        ) from None
    if not isinstance(env, Environment):
        raise ValueError(
            f"env={spec!r} is not an environment: it needs turn_end, start, step and reward."
        )
    check_turn_end(env.turn_end, spec)
    environment_tools(env, spec)
    return env


def check_turn_end(turn_end, name: str) -> tuple[str, ...]:
    """`turn_end` as a tuple of non-empty strings (empty: only a chat template's end of
    turn ends a turn); ValueError naming `name` otherwise."""
    if not isinstance(turn_end, tuple | list) or not all(
        isinstance(s, str) and s for s in turn_end
    ):
        raise ValueError(f"{name}: turn_end={turn_end!r} must be a list of non-empty strings.")
    return tuple(turn_end)


def environment_tools(env, name: str) -> list[dict[str, Any]] | None:
    """The environment's `tools` (JSON schemas for a chat template), or None; ValueError
    naming `name` if they are not a list of dicts."""
    tools = getattr(env, "tools", None)
    if tools is None:
        return None
    if isinstance(tools, Mapping) or not isinstance(tools, tuple | list):
        raise ValueError(f"{name}: tools={tools!r} must be a list of JSON schemas (dicts).")
    if not all(isinstance(tool, Mapping) for tool in tools):
        raise ValueError(f"{name}: tools must be a list of JSON schemas (dicts), got {tools!r}.")
    return [dict(tool) for tool in tools]


class GuardedEnvironment:
    """Calls an environment's `step` in its own daemon thread, against `timeout` seconds.

    A step that raises, hangs past the timeout, or returns something that is not an
    `Observation` or a string becomes the observation ``"error: <kind>"`` (`ERROR_KINDS`)
    and is counted; an observation is cut to `max_chars` characters (a tool that floods its
    output). `name` is what warnings call the environment.
    """

    def __init__(
        self, env: Environment, name: str, timeout: float, max_chars: int, max_abandoned=256
    ):
        if not timeout > 0:
            raise ValueError(f"timeout={timeout!r} must be a number of seconds > 0.")
        self.env = env
        self.name = name
        self.timeout = float(timeout)
        self.max_chars = int(max_chars)
        self.max_abandoned = int(max_abandoned)
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        self._abandoned = 0  # Steps past their timeout whose thread still runs.

    def step(self, state: Any, turn: str) -> concurrent.futures.Future:
        """A future of `(observation, error kind or None)`: errors are already turned into
        an observation, one longer than `max_chars` is cut; it completes within `timeout`
        (plus scheduling) whatever the environment does."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def settle(observation: Observation, kind: str | None) -> None:
            with self._lock:
                if future.done():
                    return
                observation = _cut(observation, self.max_chars)
                future.set_result((observation, kind))
            if kind is not None:
                self._warn(kind)

        flags = {"finished": False, "abandoned": False}

        def call() -> None:
            try:
                value = self.env.step(state, turn)
            except Exception as error:  # noqa: BLE001 - user code: an error observation
                logger.debug("environment %s raised %r", self.name, error)
                value = error
            finally:
                with self._lock:
                    flags["finished"] = True
                    if flags["abandoned"]:  # It had timed out: no longer abandoned.
                        self._abandoned -= 1
            if isinstance(value, Exception):
                settle(_error("raised"), "raised")
            elif isinstance(value, str):
                settle(Observation(value), None)
            elif not _valid(value):
                settle(_error("invalid"), "invalid")
            else:
                settle(value, None)

        def time_out() -> None:
            with self._lock:
                if not future.done() and not flags["finished"]:
                    flags["abandoned"] = True
                    self._abandoned += 1
            settle(_error("timeout"), "timeout")

        with self._lock:
            full = self._abandoned >= self.max_abandoned
        if full:  # Too many hung steps still running: this one times out at once.
            settle(_error("timeout"), "timeout")
            return future
        threading.Thread(target=call, daemon=True, name="gac_jax-env").start()
        timer = threading.Timer(self.timeout, time_out)
        timer.daemon = True
        timer.start()
        future.add_done_callback(lambda _: timer.cancel())
        return future

    def _warn(self, kind: str) -> None:
        with self._lock:
            first = kind not in self._warned
            self._warned.add(kind)
        if first:
            logger.warning(
                "environment %s: a step %s; it became the observation %r (later ones are "
                "only counted in tools/%s)",
                self.name,
                {
                    "raised": "raised",
                    "timeout": f"took longer than {self.timeout:g} s",
                    "invalid": "returned neither an Observation nor a string",
                }[kind],
                _error(kind).text,
                kind,
            )


def _valid(value) -> bool:
    if not isinstance(value, Observation) or not (isinstance(value.role, str) and value.role):
        return False
    text = value.text
    return isinstance(text, str) or (
        isinstance(text, tuple | list) and all(isinstance(t, str) for t in text)
    )


def _cut(observation: Observation, max_chars: int) -> Observation:
    """`observation` with at most `max_chars` characters of text in all (a tuple's texts
    cut in order: the first ones are kept whole)."""
    if isinstance(observation.text, str):
        return dataclasses.replace(observation, text=observation.text[:max_chars])
    kept, room = [], max_chars
    for text in observation.text:
        kept.append(text[:room])
        room -= len(kept[-1])
    return dataclasses.replace(observation, text=tuple(kept))


def _error(kind: str) -> Observation:
    return Observation(f"error: {kind}")
