"""Encoding a task's prompt, sampling one completion per prompt, and cutting it at a stop
string."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from gac_jax.models import SampleOutput, Sampler, left_pad
from gac_jax.models.tokenizers import Tokenizer, decode_completion
from gac_jax.rollout.episode_driver import EpisodeSampler


def encode_prompt(tokenizer: Tokenizer, text: str, prompt_length: int, name: str) -> np.ndarray:
    """`text`'s token ids (with BOS when the tokenizer has one); ValueError naming `name`
    (e.g. "prompt 105") and `generation.prompt_length` when there are more than that."""
    ids = tokenizer.encode(text, add_bos=tokenizer.bos_id is not None)
    if len(ids) > prompt_length:
        raise ValueError(
            f"{name} has {len(ids)} tokens, more than generation.prompt_length={prompt_length} "
            f"(raise it with --set generation.prompt_length=N): {text!r}"
        )
    return np.asarray(ids, np.int32)


@dataclasses.dataclass(frozen=True)
class SampleSettings:
    """How a runner samples one call's rows (`EpisodeRunner.sample`, `AnswerRunner.sample`).

    Attributes:
      prompt_length: the prompts are left-padded to this many tokens.
      sampling: the sampler's keywords (`temperature`, `top_k`, `top_p`, `max_new_tokens`).
      chunk_steps: decode steps between two looks at `params_fn` (in flight) and at the
        environments' answers; the library's default (`RolloutConfig` takes it from here).
      place_inputs: puts the prompts on the sampler's mesh; None leaves them to the jit.
      inflight: in-flight updates: the sampler asks `params_fn` before its first chunk and
        every `chunk_steps` decode steps; else a single answer asks it once.
    """

    prompt_length: int
    sampling: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    chunk_steps: int = 16
    place_inputs: Callable | None = None
    inflight: bool = False


def generate(
    sampler: Sampler,
    graphdef: nnx.GraphDef,
    params_fn: Callable[[], tuple[Any, int]],
    prompts: Sequence[Sequence[int]],
    key: jax.Array,
    *,
    pad_id: int,
    settings: SampleSettings,
) -> SampleOutput:
    """One completion per prompt, as host arrays (`AnswerRunner`'s sampling): the
    prompts left-padded with `pad_id`; `params_fn` asked once, or in flight
    (`settings.inflight`) by `EpisodeSampler.sample_inflight` at every chunk."""
    tokens, mask = left_pad(prompts, pad_id, settings.prompt_length)
    if settings.place_inputs is not None:
        tokens, mask = settings.place_inputs(tokens, mask)
    sampling = dict(settings.sampling)
    if settings.inflight:
        out = EpisodeSampler(sampler).sample_inflight(
            graphdef, params_fn, tokens, mask, key, chunk_steps=settings.chunk_steps, **sampling
        )
    else:
        out = sampler(graphdef, params_fn()[0], tokens, mask, key, **sampling)
    return jax.device_get(out)


def cut_at_stop(
    tokenizer: Tokenizer, tokens: np.ndarray, mask: np.ndarray, stop: Sequence[str]
) -> tuple[str, np.ndarray]:
    """One sampled row's completion text and loss mask under stop strings, as vLLM cuts
    by default: the completion ends with the first token after which its text holds a stop
    string (the shortest such prefix, found by bisection); the text is cut before the stop
    string, the mask keeps the tokens through that last one (the policy sampled them).
    `tokens` [L] and `mask` [L] (its generated prefix) are one row; returns `(text, mask)`,
    `mask` itself when no stop string occurs.
    """
    ids = tokens[mask]
    text = decode_completion(tokenizer, ids)
    if not any(s in text for s in stop):
        return text, mask
    low, high = 1, len(ids)  # The shortest prefix holding a stop string has `high` tokens.
    while low < high:
        middle = (low + high) // 2
        if any(s in decode_completion(tokenizer, ids[:middle]) for s in stop):
            high = middle
        else:
            low = middle + 1
    text = decode_completion(tokenizer, ids[:high])
    text = text[: min(text.find(s) for s in stop if s in text)]
    return text, mask & (np.cumsum(mask) <= high)
