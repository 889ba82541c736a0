"""Multi-turn episodes in the KV-cache sampler: a turn ends, an environment answers, the
answer is appended to the slot's cache and decoding goes on, without re-running the prefix.

An episode is one row of the sampler: its prompt, then policy turns and observations
interleaved in the row's N = `max_new_tokens` columns (the episode's token budget). A
policy turn ends when it samples one of `turn_end_ids` (a tool call's closing token,
say, or the last token of a sequence of them); its slot then *waits*
(`_SlotState.waiting_b`): it neither decodes nor takes another row, while the other
slots go on decoding. The host hands the row's tokens so far to `respond`, which returns
a `concurrent.futures.Future`; the environment runs off the decode loop (in the caller's
threads), so a slow tool stalls only its own slot. When the future is done, its
observation tokens are fed through the model into that slot's cache at the slot's next
positions (one prefill of at most `max_observation_tokens` tokens, the observation
only), written into the row as observation tokens (`observation_mask`, never sampled,
with log-prob 0 and version -1), and the slot decodes again (an empty reply appends
nothing); a reply of None ends the episode (the slot takes the next waiting row, as
after EOS). EOS and the row's token budget end an episode too; an observation that would
leave no room for one more policy token ends it.

The decode loop is the sampler's own (`Sampler._decode_loop` / `_decode_step`: refill,
per-row keys, versions), run in chunks of at most `chunk_steps` decode steps as
`Sampler.sample_inflight` runs it; a chunk also returns to the host as soon as a slot
starts waiting. `params_fn` is asked for the newest params every `chunk_steps` decode steps,
so with in-flight updates a new version can land between two turns or inside one, and
every policy token records the version that sampled it. No tail compaction: a waiting
slot keeps its place.

`prefill_tokens` counts the tokens every prefill fed through the model (the first slots'
prompts, each refill's prompt, each observation block): R prompts and the observation
blocks, never a prefix again.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gac_jax._validation import check_int
from gac_jax.models.sampler import (
    InflightSampleOutput,
    Sampler,
    _published,
    _SlotState,
)

#: `respond(row, tokens)`: the row's tokens so far (policy and observation tokens, in order)
#: at the end of one of its turns -> a future of the observation's token ids, or None to end
#: the episode. The future must always complete (the caller times environments out).
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


class EpisodeSampler:
    """Multi-turn episodes on a `Sampler`'s slots, cache and decode step.

    Example::

        episodes = EpisodeSampler(sampler)
        out = episodes.sample(graphdef, lambda: (state, 0), prompts, mask, key,
                              respond=respond, turn_end_ids=[tok.id(">")],
                              max_observation_tokens=16, chunk_steps=16)
    """

    def __init__(self, sampler: Sampler):
        self.sampler = sampler
        self._start = jax.jit(self._start_program)
        # The in-flight sampler's chunk program, stopping where a slot starts waiting.
        self._chunk = jax.jit(sampler._chunk_program, donate_argnames="s")
        self._observe = jax.jit(self._observe_program, donate_argnames="s")
        self._end = jax.jit(self._end_program, donate_argnames="s")

    def sample(
        self,
        graphdef: nnx.GraphDef,
        params_fn: Callable[[], tuple[nnx.State, int]],
        prompt_tokens,
        prompt_mask,
        key: jax.Array,
        *,
        respond: Respond,
        turn_end_ids: Sequence[int | Sequence[int]],
        max_observation_tokens: int,
        chunk_steps: int = 16,
        max_turns: int | None = None,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=None,
    ) -> EpisodeOutput:
        """Samples one episode per prompt.

        Args:
          graphdef, prompt_tokens, prompt_mask, key, temperature, top_k, top_p: as for
            `Sampler.__call__`; `max_new_tokens` (scalar or [R]) is each episode's token
            budget, policy and observation tokens together.
          params_fn: `() -> (state, version)`, asked before the first prefill and every
            `chunk_steps` decode steps (`lambda: (state, 0)` for fixed params).
          respond: see `Respond`; called from this thread, it must not block.
          turn_end_ids: what ends a policy turn: token ids, or sequences of ids (a stop
            string of several tokens: the turn ends when the policy's latest tokens are
            that sequence). Other EOS ids end the episode; an id that is both (a chat
            template's end of turn, ``<|im_end|>``) ends the turn, and `respond` ends the
            episode by answering None.
          max_observation_tokens: K, the longest observation; a longer one is cut to K.
          chunk_steps: decode steps between two looks at `params_fn`.
          max_turns: an episode whose turn count reaches this ends at that turn's end
            without asking `respond` (None: no limit).

        Returns:
          An `EpisodeOutput`, one row per prompt, in prompt order.
        """
        check_int("chunk_steps", chunk_steps, 1)
        check_int("max_observation_tokens", max_observation_tokens, 1)
        check_int("max_turns", max_turns, 1, allow_none=True)
        sampler = self.sampler
        turn_ids = _turn_end_table(turn_end_ids)
        prompt_tokens, prompt_mask, per_row = sampler._prepared(
            prompt_tokens, prompt_mask, temperature, top_k, top_p, max_new_tokens
        )
        loop = _HostLoop(
            self,
            graphdef,
            params_fn,
            (prompt_tokens, prompt_mask, key, per_row, jnp.asarray(turn_ids)),
            respond,
            max_observation_tokens,
            max_turns,
        )
        return loop.run(chunk_steps)

    # ----------------------------------------------------------------------- programs

    def _start_program(self, graphdef, state, prompt_tokens, prompt_mask):
        """The first B rows prefilled; nothing waiting, observed or versioned yet."""
        s = self.sampler._first_slots(nnx.merge(graphdef, state), prompt_tokens, prompt_mask)
        return dataclasses.replace(
            s,
            versions_rn=jnp.full(s.tokens_rn.shape, -1, jnp.int32),
            waiting_b=jnp.zeros(s.row_b.shape, bool),
            observed_rn=jnp.zeros(s.tokens_rn.shape, bool),
        )

    def _observe_program(self, graphdef, state, s: _SlotState, slot, block_k, length):
        """Feeds the first `length` tokens of `block_k` into `slot`'s cache at its next
        positions (one prefill of K tokens, the rest masked), writes them into its row as
        observation tokens, and lets the slot decode again from the last one's logits."""
        model = nnx.merge(graphdef, state)
        k = block_k.shape[0]
        real_1k = (jnp.arange(k) < length)[None, :]
        tokens_1k = block_k[None, :]

        def row_of(x):
            return jax.lax.dynamic_slice_in_dim(x, slot, 1, axis=0)

        one = jax.tree.map(row_of, s.cache)
        positions_1k = s.positions_b[slot] + jnp.arange(k, dtype=jnp.int32)[None, :]
        rope = model.rope_tables(positions_1k, one["key_mask"].shape[1])
        hidden, one = model.hidden_states(tokens_1k, positions_1k, real_1k, one, rope)
        logits_v = model.logits(jax.lax.dynamic_slice_in_dim(hidden, length - 1, 1, axis=1))[0, 0]
        zero = jnp.zeros((), jnp.int32)

        def put_row(big, small):
            return jax.lax.dynamic_update_slice(big, small, (slot,) + (zero,) * (big.ndim - 1))

        cache = {
            "index": s.cache["index"].at[slot].add(length),
            "key_mask": put_row(s.cache["key_mask"], one["key_mask"]),
            "layers": jax.tree.map(put_row, s.cache["layers"], one["layers"]),
        }
        row, step = s.row_b[slot], s.step_b[slot]
        columns = jnp.where(real_1k[0], step + jnp.arange(k, dtype=jnp.int32), s.tokens_rn.shape[1])
        return dataclasses.replace(
            s,
            cache=cache,
            logits_bv=s.logits_bv.at[slot].set(logits_v.astype(s.logits_bv.dtype)),
            step_b=s.step_b.at[slot].add(length),
            positions_b=s.positions_b.at[slot].add(length),
            tokens_rn=s.tokens_rn.at[row, columns].set(block_k, mode="drop"),
            observed_rn=s.observed_rn.at[row, columns].set(True, mode="drop"),
            waiting_b=s.waiting_b.at[slot].set(False),
        )

    def _end_program(self, graphdef, state, s: _SlotState, slot, prompt_tokens, prompt_mask):
        """Ends `slot`'s episode at its turn's end; the slot takes the next waiting row."""
        ended_b = jnp.arange(s.row_b.shape[0]) == slot
        s = dataclasses.replace(s, waiting_b=s.waiting_b & ~ended_b)
        model = nnx.merge(graphdef, state)
        return self.sampler._refill(model, s, ended_b, prompt_tokens, prompt_mask)


class _HostLoop:
    """`EpisodeSampler.sample`'s host side: decode chunks, hand ended turns to `respond`,
    feed the observations that came back (or end the episodes), refresh the params."""

    def __init__(self, episodes, graphdef, params_fn, inputs, respond, k, max_turns):
        self.episodes, self.graphdef, self.params_fn = episodes, graphdef, params_fn
        self.inputs, self.respond, self.k, self.max_turns = inputs, respond, k, max_turns
        prompt_tokens, _, _, per_row, _ = inputs
        self.rows, self.prompt_len = prompt_tokens.shape
        self.limits = np.asarray(per_row[3])
        self.pending: dict[int, tuple[int, concurrent.futures.Future]] = {}
        self.turns = np.zeros(self.rows, np.int64)
        self.observed_blocks = 0

    def run(self, chunk_steps: int) -> EpisodeOutput:
        e, graphdef = self.episodes, self.graphdef
        state, version = _published(self.params_fn)
        st = e._start(graphdef, state, *self.inputs[:2])
        width = st.row_b.shape[0]
        remaining, refresh, ran = chunk_steps, False, jnp.zeros((), jnp.int32)
        while True:
            # One read-back a chunk: the slots' rows, waits and steps, and the steps it ran.
            row_b, waiting_b, step_b, steps = (
                np.asarray(x) for x in jax.device_get((st.row_b, st.waiting_b, st.step_b, ran))
            )
            remaining -= int(steps)
            if remaining <= 0:
                new_state, new_version = _published(self.params_fn)
                refresh = new_version != version
                state, version, remaining = new_state, new_version, chunk_steps
            self._ask(st, row_b, waiting_b, step_b)
            decoding = int(np.sum((row_b < self.rows) & ~waiting_b))
            if not decoding and not self.pending:
                break
            if not decoding:  # Every busy slot waits: wait for the first environment.
                concurrent.futures.wait(
                    [f for _, f in self.pending.values()],
                    return_when=concurrent.futures.FIRST_COMPLETED,
                )
            st = self._answer(st, state, step_b)
            st, progress = e._chunk(
                graphdef,
                state,
                st,
                *self.inputs[:4],
                jnp.int32(version),
                jnp.int32(remaining),
                jnp.asarray(refresh),
                turn_end_ids=self.inputs[4],
            )
            ran, refresh = progress[0], False
        return self._output(st, width)

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
        e, k = self.episodes, self.k
        for slot, (row, future) in list(self.pending.items()):
            if not future.done():
                continue
            del self.pending[slot]
            reply = future.result()
            tokens = None if reply is None else np.asarray(reply, np.int32)[:k]
            if tokens is not None and len(tokens) == 0:  # Nothing to append: decode on.
                st = dataclasses.replace(st, waiting_b=st.waiting_b.at[slot].set(False))
                continue
            room = int(self.limits[row]) - int(step_b[slot]) - 1  # One policy token at least.
            if tokens is None or len(tokens) > room:
                st = e._end(self.graphdef, state, st, jnp.int32(slot), *self.inputs[:2])
                continue
            block = np.full(k, e.sampler.pad_id, np.int32)
            block[: len(tokens)] = tokens
            st = e._observe(
                self.graphdef, state, st, jnp.int32(slot), block, jnp.int32(len(tokens))
            )
            self.observed_blocks += 1
        return st

    def _output(self, st, width: int) -> EpisodeOutput:
        started = max(int(jax.device_get(st.next_row)), width)
        return EpisodeOutput(
            tokens=st.tokens_rn,
            completion_mask=st.mask_rn,
            logps=st.logps_rn,
            policy_logps=st.policy_logps_rn,
            lengths=jnp.sum(st.mask_rn, axis=1, dtype=jnp.int32),
            token_versions=st.versions_rn,
            observation_mask=st.observed_rn,
            episode_lengths=jnp.sum(st.mask_rn | st.observed_rn, axis=1, dtype=jnp.int32),
            turns=self.turns,
            prefill_tokens=started * self.prompt_len + self.observed_blocks * self.k,
        )


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


__all__ = ["EpisodeOutput", "EpisodeSampler", "Respond"]
