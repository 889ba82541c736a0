"""Multi-turn rollouts: `EpisodeRunner` samples one episode per row on the run's sampler
(`episode_driver.EpisodeSampler`), the task's environment answering each turn off the
decode loop (`GuardedEnvironment`: each step in a thread, with a timeout; an error becomes
an observation), and scores each episode with the environment's `reward`, guarded. With a
chat template (`ChatTurns`) a turn also ends on its end of an assistant message, and an
observation is the template's text after the turn.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from gac_jax._validation import check_int
from gac_jax.models import left_pad
from gac_jax.models.tokenizers import Tokenizer, decode_completion
from gac_jax.rollout.episode_driver import EpisodeSampler, EpisodeSettings
from gac_jax.rollout.sampling import SampleSettings
from gac_jax.tasks.chat_turns import ChatTurns
from gac_jax.tasks.custom import GuardedReward, RewardGuardConfig
from gac_jax.tasks.environments import (
    ERROR_KINDS,
    Environment,
    GuardedEnvironment,
    Observation,
    check_turn_end,
)

__all__ = ["EpisodeConfig", "EpisodeRunner", "EpisodeRows", "turn_end_ids"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EpisodeConfig:
    """Multi-turn episodes (tasks with an environment).

    Attributes:
      max_turns: an episode ends at the end of this many policy turns that called the
        environment (the last one is not answered).
      max_observation_tokens: an observation is cut to this many tokens (a tool that floods
        its output); one observation is one prefill of this many positions.
      tool_timeout: seconds an environment step may take; past it the step becomes the
        observation "error: timeout" and the episode goes on.
      max_observation_chars: an observation's text is cut to this many characters before
        it is tokenised.
    """

    max_turns: int = 4
    max_observation_tokens: int = 16
    tool_timeout: float = 5.0
    max_observation_chars: int = 256

    def validate(self) -> None:
        """Raises ValueError naming a bad field."""
        for name in ("max_turns", "max_observation_tokens", "max_observation_chars"):
            check_int(name, getattr(self, name), 1)
        if isinstance(self.tool_timeout, bool) or not (
            isinstance(self.tool_timeout, int | float) and self.tool_timeout > 0
        ):
            raise ValueError(f"tool_timeout={self.tool_timeout!r} must be a number of seconds > 0.")


def turn_end_ids(tokenizer: Tokenizer, turn_end: Sequence[str]) -> list[list[int]]:
    """The token ids of each turn-end string: one token, or several (the turn then ends
    when the policy writes exactly those tokens, the string's tokenization on its own).
    Raises ValueError in one line for a string the tokenizer cannot encode."""
    ids = []
    for text in turn_end:
        encoded = []
        with contextlib.suppress(ValueError):
            encoded = tokenizer.encode(text, add_bos=False)
        if not encoded:
            raise ValueError(f"turn_end string {text!r} cannot be encoded by this tokenizer.")
        ids.append([int(i) for i in encoded])
    return ids


@dataclasses.dataclass
class EpisodeRows:
    """One call's episodes as host arrays (R rows of N columns) and their telemetry. A
    single answer (`gac_jax.rollout.answers.AnswerRunner`: no environment) has no
    observation, turn, state or tool fields (None), and versions only in flight."""

    tokens: np.ndarray  # int32 [R, N]: policy and observation tokens.
    policy_mask: np.ndarray  # bool [R, N]
    policy_logps: np.ndarray  # f32 [R, N]
    token_versions: np.ndarray | None  # int32 [R, N], -1 off policy tokens.
    transcripts: list[str | None]  # Each row's context text (a single answer's: by `items`).
    observation_mask: np.ndarray | None = None  # bool [R, N]
    turns: np.ndarray | None = None  # int [R]
    states: list[Any] | None = None  # Each row's environment state, for its reward.
    tool_calls: np.ndarray | None = None  # int [R]
    tool_errors: dict[str, np.ndarray] | None = None  # kind -> int [R]
    tool_seconds: np.ndarray | None = None  # f [R]: latency of the steps answered in time.
    prefill_tokens: int = 0
    truncated: np.ndarray | None = None  # bool [R]: cut by the length limit (`cut_by_length`).


def cut_by_length(tokens: np.ndarray, context: np.ndarray, eos_ids) -> np.ndarray:
    """[R] bool: the rows whose context (policy and observation tokens) fills every column
    and does not end on an end-of-sequence id: the length limit cut them."""
    return context[:, -1] & ~np.isin(tokens[:, -1], eos_ids)


class _Telemetry:
    """Per row: environment steps, their errors by kind, and the latency of the ones that
    answered in time (written from the environments' threads)."""

    def __init__(self, rows: int):
        self.calls = np.zeros(rows, np.int64)
        self.errors = {kind: np.zeros(rows, np.int64) for kind in ERROR_KINDS}
        self.seconds = np.zeros(rows)
        self._lock = threading.Lock()

    def count(self, row: int, kind: str | None, seconds: float) -> None:
        with self._lock:
            self.calls[row] += 1
            if kind is None:
                self.seconds[row] += seconds
            else:
                self.errors[kind][row] += 1


class EpisodeRunner:
    """Samples episodes for prompts of one task on the run's `Sampler`, its environment
    guarded (`reward_guard`: `GuardedReward`'s settings; `name`: what warnings call it).
    `chat`: the chat template's turns (`ChatTurns`); None appends observations as text.
    """

    def __init__(
        self,
        sampler,
        tokenizer: Tokenizer,
        environment: Environment,
        config: EpisodeConfig,
        name: str = "environment",
        reward_guard: RewardGuardConfig | None = None,
        chat: ChatTurns | None = None,
    ):
        config.validate()
        self.sampler = sampler
        self.tokenizer = tokenizer
        self.environment = environment
        self.config = config
        self.chat = chat
        self.turn_end_ids = turn_end_ids(tokenizer, check_turn_end(environment.turn_end, name))
        if chat is not None:
            self._check_chat(name)
        if not self.turn_end_ids:
            raise ValueError(
                f"{name} has no turn_end and the run renders no chat template: no token "
                "would end a policy's turn (give turn_end, or a model with a chat template)."
            )
        self.guarded = GuardedEnvironment(
            environment, name, config.tool_timeout, config.max_observation_chars
        )

        def reward(item, example):  # `item`: an episode's (state, transcript), from `items`.
            return environment.reward(*item, example)

        self.reward = GuardedReward(reward, f"{name}.reward", reward_guard or RewardGuardConfig())

    def sample(
        self,
        graphdef,
        params_fn: Callable[[], tuple[Any, int]],
        prompts: Sequence[Sequence[int]],
        examples: Sequence[Mapping[str, Any]],
        key,
        settings: SampleSettings,
    ) -> EpisodeRows:
        """One episode per prompt (`examples[i]` is prompt i's example). `params_fn` is
        asked every `settings.chunk_steps` decode steps (in flight or not: episodes always
        run in chunks, back to the host at each turn's end)."""
        states = [self.environment.start(example) for example in examples]
        telemetry = _Telemetry(len(prompts))
        tokens, mask = left_pad(prompts, self.tokenizer.pad_id, settings.prompt_length)
        if settings.place_inputs is not None:
            tokens, mask = settings.place_inputs(tokens, mask)
        out = EpisodeSampler(self.sampler).sample(
            graphdef,
            params_fn,
            tokens,
            mask,
            key,
            respond=self._responder(states, telemetry),
            settings=EpisodeSettings(
                self.turn_end_ids,
                self.config.max_observation_tokens,
                settings.chunk_steps,
                self.config.max_turns,
            ),
            sampling=settings.sampling,
        )
        return self._rows(out, states, telemetry)

    def _rows(self, out, states, telemetry: _Telemetry) -> EpisodeRows:
        """The sampler's output as host arrays, with each row's transcript text."""
        names = ("tokens", "completion_mask", "observation_mask", "policy_logps", "token_versions")
        host = jax.device_get([getattr(out, name) for name in names])
        all_tokens, policy, observed, logps, versions = (np.asarray(x) for x in host)
        transcripts = [
            decode_completion(self.tokenizer, row[keep])
            for row, keep in zip(all_tokens, policy | observed, strict=True)
        ]
        return EpisodeRows(
            tokens=all_tokens.astype(np.int32),
            policy_mask=policy,
            observation_mask=observed,
            policy_logps=logps.astype(np.float32),
            token_versions=versions.astype(np.int32),
            turns=np.asarray(out.turns),
            transcripts=transcripts,
            states=states,
            tool_calls=telemetry.calls,
            tool_errors=telemetry.errors,
            tool_seconds=telemetry.seconds,
            prefill_tokens=out.prefill_tokens,
            truncated=cut_by_length(all_tokens, policy | observed, self.sampler.eos_ids),
        )

    def _responder(self, states, telemetry: _Telemetry):
        """`respond` for `EpisodeSampler.sample`: the turn's text to the guarded
        environment; its observation's token ids (None if it ended the episode) back."""
        turn_start = np.zeros(len(states), np.int64)  # Where each row's current turn began.

        def respond(row: int, tokens: np.ndarray) -> concurrent.futures.Future:
            turn = decode_completion(self.tokenizer, tokens[turn_start[row] :])
            reply: concurrent.futures.Future = concurrent.futures.Future()
            started = time.monotonic()

            def answered(step: concurrent.futures.Future) -> None:
                try:
                    observation, kind = step.result()
                    telemetry.count(row, kind, time.monotonic() - started)
                    if observation.done:
                        reply.set_result(None)
                        return
                    ids = self._observation_ids(observation, int(tokens[-1]))
                    turn_start[row] = len(tokens) + len(ids)
                    reply.set_result(ids)
                except Exception:  # noqa: BLE001 - e.g. a tokenizer failing: end the episode
                    logger.exception("observation of row %d could not be encoded", row)
                    if not reply.done():
                        reply.set_result(None)

            self.guarded.step(states[row], turn).add_done_callback(answered)
            return reply

        return respond

    @staticmethod
    def items(rows: EpisodeRows) -> list[tuple[Any, str]]:
        """What `score` takes for each row: its environment state and transcript."""
        return list(zip(rows.states, rows.transcripts, strict=True))

    def score(self, items: Sequence[tuple[Any, str]], example):
        """The rewards of one group's episodes: the environment's `reward`, guarded (one
        deadline per group, failures scored and counted)."""
        return self.reward.score_group(list(items), example)

    def _check_chat(self, name: str) -> None:
        """The template's end of turn becomes a turn end; its frame around a tool's result
        must leave room for the result within `max_observation_tokens`."""
        end_id = self._encode(self.chat.assistant_end)[:1]
        end_text = self.tokenizer.decode(end_id, skip_special_tokens=False)
        if not end_id or not self.chat.assistant_end.startswith(end_text):
            raise ValueError(
                f"the chat template ends an assistant message with "
                f"{self.chat.assistant_end!r}, which starts with no whole token of this "
                "tokenizer: a policy's turn could not end on it."
            )
        if [end_id[0]] not in self.turn_end_ids:
            self.turn_end_ids.append([end_id[0]])
        self._chat_end = (end_id[0], end_text)
        frame = len(self._encode(self.chat.after_turn([{"role": "tool", "content": ""}], end_text)))
        if frame >= self.config.max_observation_tokens:
            raise ValueError(
                f"episode.max_observation_tokens={self.config.max_observation_tokens} leaves "
                f"no room for a tool's result: the chat template writes {frame} tokens around "
                f"it; raise it above {frame}."
            )

    def _observation_ids(self, observation: Observation, last_token: int) -> list[int]:
        """An observation's token ids, at most `max_observation_tokens`: its text, or with
        a chat template the template's text around its messages (`ChatTurns.after_turn`),
        the longest content cut first until it fits (never the template's frame)."""
        k = self.config.max_observation_tokens
        if self.chat is None:
            return self._encode(observation.joined)[:k]
        # A turn that ended on the template's own end token wrote that much of its close.
        ended_with = self._chat_end[1] if last_token == self._chat_end[0] else ""

        def rendered(texts) -> list[int]:
            messages = [{"role": observation.role, "content": text} for text in texts]
            return self._encode(self.chat.after_turn(messages, ended_with))

        ids = rendered(observation.texts)
        contents = [self._encode(text) for text in observation.texts] if len(ids) > k else []
        while len(ids) > k and any(contents):
            longest = max(range(len(contents)), key=lambda i: len(contents[i]))
            cut = max(0, len(contents[longest]) - (len(ids) - k))
            contents[longest] = contents[longest][:cut]
            ids = rendered([self.tokenizer.decode(c) for c in contents])
        return ids[:k]

    def _encode(self, text: str) -> list[int]:
        """An observation's token ids; characters the tokenizer cannot encode are dropped."""
        try:
            return list(self.tokenizer.encode(text, add_bos=False))
        except ValueError:
            kept = []
            for char in text:
                with contextlib.suppress(ValueError):
                    kept += list(self.tokenizer.encode(char, add_bos=False))
            return kept
