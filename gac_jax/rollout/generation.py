"""`TaskGroupGenerator`: the real `GenerateGroups`, sampling task prompts with the decoder."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from gac_jax._validation import check_int
from gac_jax.models import Sampler
from gac_jax.models.tokenizers import Tokenizer
from gac_jax.rollout.answers import AnswerRunner
from gac_jax.rollout.batching import OverlongConfig
from gac_jax.rollout.episodes import EpisodeRows, EpisodeRunner
from gac_jax.rollout.placement import RolloutPlacement
from gac_jax.rollout.record import Rollout
from gac_jax.rollout.sampling import SampleSettings, encode_prompt
from gac_jax.rollout.worker import GroupRequest
from gac_jax.tasks import Task


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """How rollouts are sampled: `TaskGroupGenerator`'s settings and the sampler's length.

    Attributes:
      group_size: G, completions per prompt (>= 2: GRPO compares within a group).
      prompt_length: prompts are left-padded to this many tokens.
      max_new_tokens: the longest completion (the `Sampler`'s static length).
      temperature: sampling temperature, > 0; 0 only with ``greedy=True``.
      top_k: keep the k most likely tokens; 0 keeps all.
      top_p: nucleus mass in (0, 1]; 1 keeps all.
      greedy: decode greedily (temperature 0). RL needs samples, so this must be asked for.
      slots: the sampler's decode slots (a finished row hands its slot on); None decodes
        all rows of a call together.
      stop: stop strings: a completion also ends at the first it holds (`cut_at_stop`).
      overlong: DAPO's overlong filtering and soft punishment (`OverlongConfig`; off).
    """

    group_size: int = 8
    prompt_length: int = 32
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    greedy: bool = False
    slots: int | None = None
    stop: tuple[str, ...] = ()
    overlong: OverlongConfig = dataclasses.field(default_factory=OverlongConfig)

    def validate(self) -> None:
        """Raises ValueError naming a bad field."""
        self.overlong.validate(self.max_new_tokens)
        for name in ("group_size", "prompt_length", "max_new_tokens"):
            check_int(name, getattr(self, name), 1)
        if self.group_size < 2:
            raise ValueError(
                f"group_size={self.group_size} must be >= 2: GRPO compares completions "
                "within a group."
            )
        if self.greedy:
            if self.temperature != 0:
                raise ValueError(f"temperature={self.temperature} must be 0 with greedy=true.")
        elif not self.temperature > 0:
            raise ValueError(
                f"temperature={self.temperature!r} must be > 0 (rollouts are samples); "
                "set greedy=true for greedy decoding."
            )
        check_int("top_k", self.top_k, 0)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1].")
        if not isinstance(self.stop, tuple | list) or not all(
            isinstance(s, str) and s for s in self.stop
        ):
            raise ValueError(f"stop={self.stop!r} must be a list of non-empty strings.")
        check_int("slots", self.slots, 1, allow_none=True)


@dataclasses.dataclass(frozen=True)
class DecodeSetup:
    """A `TaskGroupGenerator`'s wiring: where its calls decode (`placement`: the prompts
    go on its mesh; None leaves them to the jit), and in-flight updates: `latest_params`
    returns the newest published `(params, version)` (`ParamStore.latest`), looked at every
    `chunk_steps` decode steps (`EpisodeSampler.sample_inflight`); None samples a call
    with the params it was given."""

    placement: RolloutPlacement | None = None
    latest_params: Callable[[], tuple[Any, int]] | None = None
    chunk_steps: int = SampleSettings.chunk_steps


class TaskGroupGenerator:
    """Samples G completions per task prompt, scores them, makes `Rollout`s.

    A call samples all its groups as one batch (G rows per group), prompts left-padded to
    `prompt_length` so the sampler compiles once. The behaviour log-probabilities kept
    are the temperature-1 policy's (`policy_logps`), what the learner recomputes.

    `sampler`'s length must be `config.max_new_tokens`; params arrive per call. `decode`:
    see `DecodeSetup` (its fields stay settable as attributes). `episodes`: a multi-turn
    task's `EpisodeRunner`; None: an `AnswerRunner` scored by `task.reward` (`self.runner`).
    """

    def __init__(
        self,
        graphdef: nnx.GraphDef,
        sampler: Sampler,
        task: Task,
        examples: Sequence[Any],
        tokenizer: Tokenizer,
        config: GenerationConfig | None = None,
        decode: DecodeSetup = DecodeSetup(),
        episodes: EpisodeRunner | None = None,
    ):
        config = GenerationConfig() if config is None else config
        config.validate()
        if sampler.max_new_tokens != config.max_new_tokens:
            raise ValueError(
                f"the sampler generates {sampler.max_new_tokens} tokens but "
                f"max_new_tokens={config.max_new_tokens}."
            )
        self.graphdef = graphdef
        self.task = task
        self.examples = examples
        self.tokenizer = tokenizer
        self.placement = decode.placement
        self.latest_params = decode.latest_params
        self.chunk_steps = decode.chunk_steps
        self.group_size = config.group_size
        self.prompt_length = config.prompt_length
        temperature = 0.0 if config.greedy else config.temperature
        self.sampling = dict(temperature=temperature, top_k=config.top_k, top_p=config.top_p)
        self.stop = tuple(config.stop)
        self.overlong = config.overlong  # How `collate` shapes its rollouts for the learner.
        self.runner = episodes or AnswerRunner(sampler, tokenizer, task.reward, self.stop)

    @property
    def sampler(self) -> Sampler:
        """The sampler the runner decodes with; setting it sets the runner's (one
        reference: a spy or a replacement put here is the one that samples)."""
        return self.runner.sampler

    @sampler.setter
    def sampler(self, sampler: Sampler) -> None:
        self.runner.sampler = sampler

    def encode_prompt(self, prompt_id: int) -> np.ndarray:
        text = self.task.prompt(self.examples[prompt_id])
        return encode_prompt(self.tokenizer, text, self.prompt_length, f"prompt {prompt_id}")

    def __call__(
        self, params: nnx.State, version: int, requests: Sequence[GroupRequest], key: jax.Array
    ) -> list[Rollout]:
        g = self.group_size
        prompts = [self.encode_prompt(r.prompt_id) for r in requests]
        inflight = self.latest_params is not None
        params_fn = self._params_fn(params, version) if inflight else lambda: (params, version)
        examples = [self.examples[r.prompt_id] for r in requests]
        start = time.monotonic()
        out = self.runner.sample(
            self.graphdef,
            params_fn,
            [p for p in prompts for _ in range(g)],
            [ex for ex in examples for _ in range(g)],
            key,
            SampleSettings(
                prompt_length=self.prompt_length,
                sampling=self.sampling,
                chunk_steps=self.chunk_steps,
                place_inputs=None if self.placement is None else self.placement.place_inputs,
                inflight=inflight,
            ),
        )
        generate_seconds = (time.monotonic() - start) / len(requests)
        start = time.monotonic()
        items = self.runner.items(out)  # Each row decoded (and cut at a stop string).
        decode_seconds = (time.monotonic() - start) / len(requests)
        rollouts = []
        for i, request in enumerate(requests):
            rows_i = slice(i * g, (i + 1) * g)
            start = time.monotonic()
            scores = self.runner.score(items[rows_i], examples[i])
            rollouts.append(
                Rollout(
                    prompt_id=request.prompt_id,
                    group_id=request.group_id,
                    prompt_tokens=prompts[i],
                    rewards=scores.rewards,
                    generate_seconds=generate_seconds,
                    score_seconds=decode_seconds + time.monotonic() - start,
                    reward_failures=scores.failures,
                    reward_timeouts=scores.timeouts,
                    **_group_fields(out, rows_i, version, inflight),
                )
            )
        return rollouts

    def _params_fn(self, params, version):
        """In-flight `params_fn`: `(params, version)` first, then at each chunk boundary
        the newest version (never one older than the call's)."""
        first = [(params, int(version))]

        def params_fn():
            newest = first.pop() if first else self.latest_params()
            return newest if newest[1] >= version else (params, version)

        return params_fn


def _group_fields(out: EpisodeRows, rows: slice, version: int, inflight: bool) -> dict:
    """A group's rows of `out` as `Rollout` fields: its tokens, masks and log-probs, its
    oldest token's version (in flight) or the call's, and an episode's turns and tools."""
    policy = out.policy_mask[rows]
    versions = out.token_versions[rows] if inflight else None
    fields = dict(
        completion_tokens=out.tokens[rows],
        completion_mask=policy,
        behaviour_logp=np.where(policy, out.policy_logps[rows], 0.0).astype(np.float32),
        policy_version=int(versions[policy].min()) if inflight and policy.any() else int(version),
        token_versions=versions,
        truncated=out.truncated[rows],
    )
    if out.observation_mask is None:  # One answer: no observation, turn or tool.
        return fields
    return fields | dict(
        observation_mask=out.observation_mask[rows],
        turns=out.turns[rows],
        tool_calls=int(out.tool_calls[rows].sum()),
        tool_errors=int(sum(out.tool_errors[kind][rows].sum() for kind in ("raised", "invalid"))),
        tool_timeouts=int(out.tool_errors["timeout"][rows].sum()),
        tool_seconds=float(out.tool_seconds[rows].sum()),
    )


def make_sampler(model_config, tokenizer: Tokenizer, config: GenerationConfig) -> Sampler:
    """The sampler of `config` for a model, with `config.slots` decode slots: its EOS ids
    (the tokenizer's if the model names none) end a row, the tokenizer's pad id fills the
    rest."""
    eos = model_config.eos_token_ids or (tokenizer.eos_id,)
    n, pad = config.max_new_tokens, tokenizer.pad_id
    return Sampler(model_config, max_new_tokens=n, eos_ids=eos, pad_id=pad, slots=config.slots)
