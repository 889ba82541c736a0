"""The episode driver: the one host loop over the sampler's slots (its public slot API
alone), for multi-turn episodes and for single answers sampled in flight, which are
episodes with no environment (`EpisodeSampler.sample_inflight`). In an episode a turn
ends, an environment answers, the answer is appended to the slot's cache and decoding
goes on, without re-running the prefix. It waits on the environments' futures, so it is
rollout work and lives in `rollout/`, above the models.

An episode is one row of the sampler: its prompt, then policy turns and observations interleaved in
the row's N = `max_new_tokens` columns (the episode's token budget). A policy turn ends when it
samples one of `turn_end_ids` (a tool call's closing token, say, or the last token of a sequence of
them); its slot then *waits* (`EpisodeSlots.waiting_b`): it neither decodes nor takes another row,
while the other slots go on decoding. The host hands the row's tokens so far to `respond`, which
returns a `concurrent.futures.Future`; the environment runs off the decode loop (in the caller's
threads), so a slow tool stalls only its own slot. When the future is done, its observation tokens
are fed through the model into that slot's cache at the slot's next positions (one prefill of at
most `max_observation_tokens` tokens, the observation only), written into the row as observation
tokens (`observation_mask`, never sampled, with log-prob 0 and version -1), and the slot decodes
again (an empty reply appends nothing); a reply of None ends the episode (the slot takes the next
waiting row, as after EOS). EOS and the row's token budget end an episode too; an observation that
would leave no room for one more policy token ends it.

The decode loop is the sampler's own, driven through its public slot API (`start`,
`run_chunk`, `append_observation`, `end_slot`: refill, per-row keys, versions), in chunks
of at most `chunk_steps` decode steps; in an episode a chunk also returns to the host as
soon as a slot starts waiting. `params_fn` is asked for the newest params every
`chunk_steps` decode steps, so with in-flight updates a new version can land between two
turns or inside one, and every policy token records the version that sampled it. Tail
compaction (`Sampler.compact`) runs for single answers only: in an episode a waiting slot
keeps its place.

`prefill_tokens` counts the tokens every prefill fed through the model (the first slots'
prompts, each refill's prompt, each observation block): R prompts and the observation
blocks, never a prefix again.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gac_jax._validation import check_int
from gac_jax.models.sampler import EpisodeSlots, InflightSampleOutput, Prompts, Sampler

#: `respond(row, tokens)`: the row's tokens so far (policy and observation tokens, in order)
#: at the end of one of its turns -> a future of the observation's token ids, or None to end
#: the episode. The future must always complete (the caller times environments out), with
#: at most `max_observation_tokens` ids: the cut is the caller's, who knows what they mean
#: (the episode runner keeps a chat template's frame); a longer one is refused.
Respond = Callable[[int, np.ndarray], "concurrent.futures.Future[Sequence[int] | None]"]


@dataclasses.dataclass(frozen=True)
class EpisodeOutput(InflightSampleOutput):
    """`InflightSampleOutput` of `EpisodeSampler.sample`: `tokens` hold policy and
    observation tokens interleaved; `completion_mask` and `lengths` count policy tokens
    only."""

    observation_mask: jax.Array  # bool [R, N]: observation tokens (context, not sampled).
    episode_lengths: jax.Array  # int32 [R]: positions the episode used (policy + observation).
    turns: np.ndarray  # int [R]: turns that ended waiting for the environment.
    prefill_tokens: int = 0


@dataclasses.dataclass(frozen=True)
class EpisodeSettings:
    """How `EpisodeSampler.sample` runs a call's episodes: what ends a turn, how long an
    observation and an episode may get, how often the params are looked at.

    Attributes:
      turn_end_ids: token ids, or sequences of ids (a multi-token stop string), that end a
        policy turn. Other EOS ids end the episode; an id that is both (``<|im_end|>``)
        ends the turn, and `respond` ends the episode by answering None.
      max_observation_tokens: K, the longest observation `respond` may give (cutting is
        `respond`'s, where the tokens' meaning is known; longer raises ValueError).
      chunk_steps: decode steps between two looks at `params_fn` and the environments.
      max_turns: an episode reaching this many turns ends without asking `respond`.
    """

    turn_end_ids: Sequence[int | Sequence[int]]
    max_observation_tokens: int
    chunk_steps: int
    max_turns: int | None = None

    def __post_init__(self):
        check_int("max_observation_tokens", self.max_observation_tokens, 1)
        check_int("max_turns", self.max_turns, 1, allow_none=True)


class EpisodeSampler:
    """Multi-turn episodes on a `Sampler`'s slots, cache and decode step.

    Example::

        episodes = EpisodeSampler(sampler)
        settings = EpisodeSettings([tok.id(">")], max_observation_tokens=16, chunk_steps=16)
        out = episodes.sample(graphdef, lambda: (state, 0), prompts, mask, key,
                              respond=respond, settings=settings)
    """

    def __init__(self, sampler: Sampler):
        self.sampler = sampler

    def sample(
        self,
        graphdef: nnx.GraphDef,
        params_fn: Callable[[], tuple[nnx.State, int]],
        prompt_tokens,
        prompt_mask,
        key: jax.Array,
        *,
        respond: Respond,
        settings: EpisodeSettings,
        sampling: Mapping[str, Any] | None = None,
    ) -> EpisodeOutput:
        """Samples one episode per prompt; an `EpisodeOutput`, rows in prompt order.

        `params_fn` (`() -> (state, version)`) is asked before the first prefill and every
        `settings.chunk_steps` decode steps; `respond` (see `Respond`) is called from this
        thread and must not block. `sampling` holds the sampler's keywords
        (`SampleSettings.sampling`; None: its defaults); `max_new_tokens` (scalar or [R]) is
        each episode's token budget, policy and observation tokens together. The rest as
        for `Sampler.__call__`.
        """
        turn_ids = jnp.asarray(_turn_end_table(settings.turn_end_ids))
        prompts = self.sampler.prepare(prompt_tokens, prompt_mask, key, **(sampling or {}))
        loop = _HostLoop(self.sampler, graphdef, params_fn, prompts, respond)
        loop.k, loop.max_turns = settings.max_observation_tokens, settings.max_turns
        return loop.run(settings.chunk_steps, turn_ids)

    def sample_inflight(
        self,
        graphdef: nnx.GraphDef,
        params_fn: Callable[[], tuple[nnx.State, int]],
        prompt_tokens,
        prompt_mask,
        key: jax.Array,
        *,
        chunk_steps: int,
        **sampling,
    ) -> InflightSampleOutput:
        """Samples one answer per prompt, picking up newly published params between decode
        chunks (in-flight weight updates, PipelineRL's idea): episodes with no environment,
        run by `sample`'s host loop, with the sampler's tail compaction.

        The decode of `Sampler.__call__` (same slots, refill order, per-row keys) runs in
        chunks of `chunk_steps` decode steps (a new value does not recompile), one jitted
        call each; the slot state stays on the device and the host reads back three scalars
        per call (steps run, busy slots, next waiting row) before dispatching the next.

        Schedule: `params_fn()` (`() -> (state, version)`, e.g. `param_store.latest`) is
        called before the first prefill and before each later chunk, never after the last:
        `ceil(D / chunk_steps)` times for D decode steps. Chunk c runs global decode steps
        `[c * chunk_steps, (c + 1) * chunk_steps)` (tail compaction may split it, with no
        `params_fn` call between); a row refilled during chunk c is prefilled with its
        params. Every version shares `graphdef`'s shapes (no recompile), and a repeated
        version number is taken as unchanged.

        Versions: the token sampled at global step t is drawn under chunk
        `t // chunk_steps`'s params, which `token_versions` records (as `logps` and
        `policy_logps`). For that, at a chunk whose version is new, the last token fed to
        each busy slot is fed again with the new params, overwriting its KV entry: one
        extra one-token forward per version change, where vLLM-based PipelineRL stands too.

        Stale KV cache: the keys and values already in a slot stay those of the params that
        computed them, so a token sampled after a swap is the new params' decode over that
        mixed cache, as in PipelineRL (no re-prefill). A row prefilled and completed within
        one version is exactly that version's sample; with fixed params and version the
        output equals `Sampler.__call__`'s (tokens and both log-probs).
        """
        prompts = self.sampler.prepare(prompt_tokens, prompt_mask, key, **sampling)
        return _HostLoop(self.sampler, graphdef, params_fn, prompts, None).run(chunk_steps)


class _HostLoop:
    """The host side of every call in flight and every episode (the module docstring)."""

    def __init__(self, sampler: Sampler, graphdef, params_fn, prompts: Prompts, respond):
        self.sampler, self.graphdef, self.params_fn = sampler, graphdef, params_fn
        self.prompts, self.respond = prompts, respond
        self.rows, self.prompt_len = prompts.tokens.shape
        self.limits = np.asarray(prompts.per_row[3])
        self.pending: dict[int, tuple[int, concurrent.futures.Future]] = {}
        self.turns = np.zeros(self.rows, np.int64)
        self.observed_blocks = 0
        self.k, self.max_turns = 0, None  # Episodes only: set by `EpisodeSampler.sample`.

    def run(self, chunk_steps: int, turn_ids=None) -> InflightSampleOutput:
        """Runs every row to its end; a turn-end table `turn_ids` makes them episodes."""
        check_int("chunk_steps", chunk_steps, 1)
        sampler, graphdef = self.sampler, self.graphdef
        state, version = _published(self.params_fn)
        st, progress = sampler.start(graphdef, state, self.prompts, turn_ids)
        episodes = isinstance(st, EpisodeSlots)
        width = st.row_b.shape[0]
        remaining, refresh = chunk_steps, False
        while True:
            # One read-back a chunk: its progress and, in episodes, the slots' rows,
            # waits and steps.
            looked = (st.row_b, st.waiting_b, st.step_b) if episodes else ()
            *slots, progress = (np.asarray(x) for x in jax.device_get((*looked, progress)))
            steps, busy, next_row = (int(x) for x in progress)
            if episodes:
                self._ask(st, *slots)
                decoding = int(np.sum((slots[0] < self.rows) & ~slots[1]))
                if not decoding and not self.pending:
                    return self._episode_output(st, width)
            elif not busy:
                return st.output(InflightSampleOutput, token_versions=st.versions_rn)
            remaining -= steps
            if remaining <= 0:
                new_state, new_version = _published(self.params_fn)
                refresh = new_version != version
                state, version, remaining = new_state, new_version, chunk_steps
            if episodes:
                if not decoding:  # Every busy slot waits: wait for the first environment.
                    concurrent.futures.wait(
                        [f for _, f in self.pending.values()],
                        return_when=concurrent.futures.FIRST_COMPLETED,
                    )
                st = self._answer(st, state, slots[2])
            elif next_row >= self.rows and busy <= (narrower := sampler.narrower_width(st)):
                st, progress = sampler.compact(st, narrower), np.array([0, busy, next_row])
                continue
            st, progress = sampler.run_chunk(
                graphdef, state, st, self.prompts, version=version, budget=remaining,
                refresh=refresh,
            )  # fmt: skip
            refresh = False

    def _ask(self, st, row_b, waiting_b, step_b) -> None:
        """Hands each newly waiting slot's row to `respond` (or ends it at the turn limit)."""
        new = [int(slot) for slot in np.flatnonzero(waiting_b) if slot not in self.pending]
        all_tokens = np.asarray(jax.device_get(st.tokens_rn)) if new else None
        for slot in new:
            row = int(row_b[slot])
            self.turns[row] += 1
            if self.max_turns is not None and self.turns[row] >= self.max_turns:
                self.pending[slot] = (row, _done(None))
            else:
                self.pending[slot] = (row, self.respond(row, all_tokens[row, : step_b[slot]]))

    def _answer(self, st, state, step_b):
        """Feeds each observation that came back into its slot, or ends its episode."""
        sampler, k = self.sampler, self.k
        for slot, (row, future) in list(self.pending.items()):
            if not future.done():
                continue
            del self.pending[slot]
            reply = future.result()
            tokens = None if reply is None else np.asarray(reply, np.int32).reshape(-1)
            if tokens is not None and len(tokens) > k:
                raise ValueError(
                    f"respond gave row {row} an observation of {len(tokens)} tokens; "
                    f"max_observation_tokens={k} is the most (cut it before returning it)."
                )
            if tokens is not None and len(tokens) == 0:  # Nothing to append: decode on.
                st = dataclasses.replace(st, waiting_b=st.waiting_b.at[slot].set(False))
                continue
            room = int(self.limits[row]) - int(step_b[slot]) - 1  # One policy token at least.
            if tokens is None or len(tokens) > room:
                st = sampler.end_slot(self.graphdef, state, st, slot, self.prompts)
                continue
            block = np.full(k, sampler.pad_id, np.int32)
            block[: len(tokens)] = tokens
            st = sampler.append_observation(self.graphdef, state, st, slot, block, len(tokens))
            self.observed_blocks += 1
        return st

    def _episode_output(self, st, width: int) -> EpisodeOutput:
        started = max(int(jax.device_get(st.next_row)), width)
        return st.output(
            EpisodeOutput,
            token_versions=st.versions_rn,
            observation_mask=st.observed_rn,
            episode_lengths=jnp.sum(st.mask_rn | st.observed_rn, axis=1, dtype=jnp.int32),
            turns=self.turns,
            prefill_tokens=started * self.prompt_len + self.observed_blocks * self.k,
        )


def _published(params_fn) -> tuple[nnx.State, int]:
    """`params_fn()`'s `(state, version)`, the version checked to be an int."""
    state, version = params_fn()
    if isinstance(version, bool) or not isinstance(version, int | np.integer):
        raise ValueError(f"params_fn() returned version {version!r}; it must be an int.")
    return state, int(version)


def _turn_end_table(turn_end_ids) -> np.ndarray:
    """int32 [T, L]: each turn end (an id, or a sequence of ids) right-aligned, -1 before a
    shorter one. Raises ValueError in one line for an empty list or sequence."""
    sequences = [[t] if isinstance(t, int | np.integer) else list(t) for t in turn_end_ids]
    if not sequences:
        raise ValueError("turn_end_ids is empty; give the token ids that end a turn.")
    if not all(sequences):
        raise ValueError(f"turn_end_ids={turn_end_ids!r} holds an empty sequence.")
    table = np.full((len(sequences), max(map(len, sequences))), -1, np.int32)
    for i, sequence in enumerate(sequences):
        table[i, table.shape[1] - len(sequence) :] = sequence
    return table


def _done(value) -> concurrent.futures.Future:
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_result(value)
    return future


__all__ = ["EpisodeOutput", "EpisodeSampler", "EpisodeSettings", "Respond"]
