r"""A sampler that refills finished decode slots with waiting prompts (continuous batching).

`Sampler` decodes all its rows in lockstep until the longest one ends: with heavy-tailed
completion lengths most of its decode slots are padding. `RefillSampler` takes R prompts
but decodes only B of them at a time (`slots`). When a row ends (an EOS id or its length
limit) its slot takes the next waiting prompt, in row order, and reuses the slot's part of
the KV cache. The cache is B slots of `S = P + max_new_tokens` positions, whatever R is.

Everything runs in one jitted program: a batched prefill of the first B prompts, then a
`jax.lax.while_loop` whose body is one decode step of all B slots followed by an inner
`while_loop` that prefills each slot that has just ended with its new prompt (zero
iterations on most steps). A slot's sequence keeps `Sampler`'s cache layout (prompt
left-padded into positions [0, P), token j of the completion at P + j); slots write at
their own positions with the decoder's per-row cache index. A refilled slot ignores the
previous row's keys: the new prompt's key mask covers [0, P), and each completion position
is overwritten before the causal mask lets the new row see it.

Once no prompt waits, the last long rows would still pay for B slots per step: each time
the busy slots fit in half the width, they are gathered into a state of half as many
slots (down to 4) and decoding goes on there ("tail compaction"; each width is another
`while_loop` in the same program).

The scheduler lives on the device: no host round trip per step and no program per refill
batch size. The program holds the first B-row prefill, a one-row prefill and one decode
step per width; it is compiled once per (rows, prompt length, slots).

Randomness is per row, not per slot: row r's token j is drawn with
`fold_in(fold_in(key, r), j)`, so a row's completion does not depend on which slot served
it or when. Greedy rows give `Sampler`'s tokens; sampled rows have its distribution (not
its draws: `Sampler` draws one key per step for the whole batch).

Outputs are `Sampler`'s: a `SampleOutput` with one row per prompt, in prompt order, the
same per-row temperature / top-k / top-p / length limit, and the same two log-probabilities
per token (`sample_step` and `filter_logits` are shared).

In-flight weight updates (`RefillSampler.sample_inflight`, PipelineRL's idea): the same
decode, refill and compaction, cut into chunks of at most `chunk_steps` decode steps, one
jitted call each, the slot state (KV cache included) staying on the device between calls.
Before each chunk the sampler asks for the newest published params and decodes the chunk
with them, so a long row is finished by newer weights instead of holding its batch on the
old ones; each token records the version that sampled it (`InflightSampleOutput`).

Over 450 lines because the one-program call and its chunked in-flight variant share the
slot state, the refill step and the compaction, which would otherwise be split across
modules that only make sense together.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gac_jax.models.config import ModelConfig
from gac_jax.models.decoder import init_cache
from gac_jax.models.sampler import SampleOutput, Sampler, sample_step

# Tail compaction stops halving the decode width here: narrower steps cost about the same
# (the weights, not the rows, dominate) and each width is one more compiled loop.
_MIN_WIDTH = 4


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _SlotState:
    cache: dict  # the decoder's KV cache of B slots x S positions; "index" int32 [B].
    logits_bv: jax.Array  # f32 [B, V]: logits for each slot's next token.
    row_b: jax.Array  # int32 [B]: the prompt row a slot serves; R when it is idle.
    step_b: jax.Array  # int32 [B]: tokens the slot's row has sampled so far.
    positions_b: jax.Array  # int32 [B]: rotary position of the slot's next token.
    next_row: jax.Array  # int32 []: the first row no slot has taken yet.
    tokens_rn: jax.Array  # int32 [R, N]
    mask_rn: jax.Array  # bool [R, N]
    logps_rn: jax.Array  # f32 [R, N]
    policy_logps_rn: jax.Array  # f32 [R, N]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _InflightState:
    slots: _SlotState
    versions_rn: jax.Array  # int32 [R, N]: the params version that sampled each token; -1.


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class InflightSampleOutput(SampleOutput):
    """`SampleOutput` of `RefillSampler.sample_inflight`, with each token's version."""

    # int32 [R, N]: version of the params that sampled each token, -1 past a row's end;
    # non-decreasing along a row when the published versions are.
    token_versions: jax.Array


class RefillSampler(Sampler):
    """`Sampler` with B decode slots refilled from a queue of R >= 1 prompts.

    Same call, same `SampleOutput` (one row per prompt, in order); only the number of
    rows decoded together differs.

    Example::

        sampler = RefillSampler(config, max_new_tokens=1024, eos_ids=tok.eos_id,
                                pad_id=tok.pad_id, slots=64)
        out = sampler(graphdef, state, prompt_tokens, prompt_mask, key, temperature=1.0)
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        max_new_tokens: int,
        eos_ids: int | Sequence[int],
        pad_id: int,
        slots: int | None = None,
        cache_dtype=None,
    ):
        """Creates the sampler and its jitted program.

        Args:
          config: the model's configuration.
          max_new_tokens: N, the most tokens generated per row (static).
          eos_ids: id or ids that end a row; the EOS token is part of the completion.
          pad_id: id written after a row has ended.
          slots: B, rows decoded together (static); None decodes all rows together. A
            call with fewer rows uses one slot per row.
          cache_dtype: KV cache dtype; `config.dtype` by default.
        """
        if slots is not None and (
            isinstance(slots, bool) or not isinstance(slots, int) or slots < 1
        ):
            raise ValueError(f"slots={slots!r} must be a positive int or None.")
        super().__init__(
            config,
            max_new_tokens=max_new_tokens,
            eos_ids=eos_ids,
            pad_id=pad_id,
            cache_dtype=cache_dtype,
        )
        self.slots = slots
        self._inflight_start = jax.jit(self._start_program)
        self._inflight_chunk = jax.jit(self._chunk_program, donate_argnames="st")
        self._inflight_compact = jax.jit(_compacted_inflight, static_argnames="width")

    def sample_inflight(
        self,
        graphdef: nnx.GraphDef,
        params_fn: Callable[[], tuple[nnx.State, int]],
        prompt_tokens: jax.Array,
        prompt_mask: jax.Array,
        key: jax.Array,
        *,
        chunk_steps: int,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=None,
    ) -> InflightSampleOutput:
        """Samples completions, picking up newly published params between decode chunks.

        The decode of `__call__` (same slots, refill order, tail compaction and per-row
        keys) runs in chunks of `chunk_steps` decode steps, one jitted call each; the
        slot state, KV cache included, stays on the device between calls and the host
        reads back three scalars per call (steps run, busy slots, next waiting row).

        Schedule: `params_fn()` is called once before the prefill of the first B prompts
        (chunk 0 uses those params) and once before each later chunk, never after the
        last: with D decode steps in all (`__call__`'s loop count), it is called exactly
        `ceil(D / chunk_steps)` times. Chunk c runs global decode steps
        `[c * chunk_steps, (c + 1) * chunk_steps)`; tail compaction may split a chunk into
        several calls, with no `params_fn` call between them. A row refilled during chunk
        c is prefilled with chunk c's params. Every version's params share `graphdef`'s
        structure, shapes and dtypes (a new version does not recompile), and a version
        number names one set of params: a repeated version is taken as unchanged. The
        host waits for each chunk's three scalars before it dispatches the next chunk.

        Versions: the token sampled at global step t is drawn from logits of chunk
        `t // chunk_steps`'s params, and `token_versions` records that version (its
        `logps` and `policy_logps` are under those params). To make that true at the
        first step of a chunk whose version is new, the last token fed to each busy slot
        (the previous sample, or a fresh row's last prompt token) is fed again with the
        new params, overwriting its KV entry, before the chunk decodes: one extra
        one-token forward per version change. That is where vLLM-based PipelineRL stands
        too (its forward of a sampled token runs in the next engine step, after the
        update).

        Stale KV cache: the keys and values of the tokens already in a slot stay those of
        the params that computed them (prompt by the prefill's version, each later
        position by the version of the token its logits sampled). A token sampled after
        a swap therefore is not the new params' teacher-forced prediction of its prefix,
        but the new params' decode over that mixed cache; PipelineRL keeps the stale
        cache the same way rather than re-prefilling every row. A row prefilled and
        completed within one version is exactly that version's sample.

        With a `params_fn` that always returns the same params and version, the output
        equals `__call__`'s (tokens and both log-probs).

        Args:
          graphdef: from `nnx.split(model)`; the structure of every version's params.
          params_fn: `() -> (state, version)`: the newest published params and their int
            version, e.g. `lambda: param_store.latest()`.
          prompt_tokens, prompt_mask, key, temperature, top_k, top_p, max_new_tokens: as
            for `__call__`.
          chunk_steps: decode steps per chunk, >= 1 (static for the host loop only: a new
            value does not recompile).

        Returns:
          An `InflightSampleOutput`: `__call__`'s fields and `token_versions`.
        """
        if isinstance(chunk_steps, bool) or not isinstance(chunk_steps, int) or chunk_steps < 1:
            raise ValueError(f"chunk_steps={chunk_steps!r} must be a positive int.")
        prompt_tokens, prompt_mask, per_row = self._prepared(
            prompt_tokens, prompt_mask, temperature, top_k, top_p, max_new_tokens
        )
        rows = prompt_tokens.shape[0]
        state, version = _published(params_fn)
        st, progress = self._inflight_start(graphdef, state, prompt_tokens, prompt_mask)
        steps, busy, next_row = (int(x) for x in jax.device_get(progress))
        remaining, refresh = chunk_steps, False
        while busy:
            remaining -= steps
            if remaining == 0:
                new_state, new_version = _published(params_fn)
                refresh = new_version != version
                state, version, remaining = new_state, new_version, chunk_steps
            width = st.slots.row_b.shape[0]
            narrower = _narrower(width)
            if next_row >= rows and busy <= narrower:
                st, steps = self._inflight_compact(st, width=narrower), 0
                continue
            st, progress = self._inflight_chunk(
                graphdef,
                state,
                st,
                prompt_tokens,
                prompt_mask,
                key,
                per_row,
                jnp.asarray(version, jnp.int32),
                jnp.asarray(remaining, jnp.int32),
                jnp.asarray(refresh),
            )
            refresh = False
            steps, busy, next_row = (int(x) for x in jax.device_get(progress))
        s = st.slots
        return InflightSampleOutput(
            tokens=s.tokens_rn,
            completion_mask=s.mask_rn,
            logps=s.logps_rn,
            policy_logps=s.policy_logps_rn,
            lengths=jnp.sum(s.mask_rn, axis=1, dtype=jnp.int32),
            token_versions=st.versions_rn,
        )

    def _start_program(self, graphdef, state, prompt_tokens, prompt_mask):
        """The first B rows prefilled (`_first_slots`), no version recorded yet."""
        rows = prompt_tokens.shape[0]
        slots = rows if self.slots is None else min(self.slots, rows)
        s = self._first_slots(nnx.merge(graphdef, state), prompt_tokens, prompt_mask, slots)
        versions_rn = jnp.full((rows, self.max_new_tokens), -1, jnp.int32)
        return _InflightState(slots=s, versions_rn=versions_rn), _progress(s, 0)

    def _chunk_program(
        self,
        graphdef,
        state,
        st,
        prompt_tokens,
        prompt_mask,
        key,
        per_row,
        version,
        budget,
        refresh,
    ):
        """At most `budget` decode steps of `__call__`'s loop at the state's width, with
        `state` (version `version`); stops early where `__call__` would compact. Returns
        the new state and `_progress`."""
        rows = prompt_tokens.shape[0]
        width = st.slots.row_b.shape[0]
        refill = width == (rows if self.slots is None else min(self.slots, rows))
        narrower = _narrower(width)
        row_keys = jax.vmap(jax.random.fold_in, (None, 0))(key, jnp.arange(rows, dtype=jnp.int32))

        def refreshed(s: _SlotState) -> _SlotState:
            return self._fed_again(nnx.merge(graphdef, state), s, prompt_tokens)

        s = jax.lax.cond(refresh, refreshed, lambda s: s, st.slots)

        def cond(carry) -> jax.Array:
            s, _, step = carry
            busy = jnp.sum(s.row_b < rows, dtype=jnp.int32)
            return (step < budget) & (busy > 0) & ((busy > narrower) | (s.next_row < rows))

        def body(carry):
            s, versions_rn, step = carry
            # Recorded at the pre-step (row, step), as `_decode_step` records its token.
            versions_rn = versions_rn.at[s.row_b, s.step_b].set(version, mode="drop")
            decoder = nnx.merge(graphdef, state)
            s, ended_b = self._decode_step(decoder, s, row_keys, per_row)
            if refill:
                s = self._refill(decoder, s, ended_b, prompt_tokens, prompt_mask)
            else:
                s = dataclasses.replace(s, row_b=jnp.where(ended_b, rows, s.row_b))
            return s, versions_rn, step + 1

        s, versions_rn, steps = jax.lax.while_loop(
            cond, body, (s, st.versions_rn, jnp.zeros((), jnp.int32))
        )
        return _InflightState(slots=s, versions_rn=versions_rn), _progress(s, steps)

    def _fed_again(self, model, s: _SlotState, prompt_tokens) -> _SlotState:
        """Each busy slot's last fed token (its row's latest sample, or the last prompt
        token of a row with none yet) fed again through `model` at its own position:
        its KV entry and the slot's next-token logits become `model`'s."""
        rows, prompt_len = prompt_tokens.shape
        busy_b = s.row_b < rows
        row_b = jnp.minimum(s.row_b, rows - 1)
        sampled_b = s.tokens_rn[row_b, jnp.maximum(s.step_b - 1, 0)]
        last_b = jnp.where(s.step_b > 0, sampled_b, prompt_tokens[row_b, prompt_len - 1])
        seq_len = s.cache["key_mask"].shape[1]
        positions_b1 = (s.positions_b - 1)[:, None]
        # Idle slots write nothing real (masked), at a position their next prefill clears.
        hidden, cache = model.hidden_states(
            last_b[:, None],
            positions_b1,
            busy_b[:, None],
            s.cache | {"index": s.cache["index"] - 1},
            model.rope_tables(positions_b1, seq_len),
        )
        return dataclasses.replace(
            s,
            cache=cache | {"index": s.cache["index"]},
            logits_bv=jnp.where(busy_b[:, None], model.logits(hidden)[:, 0], s.logits_bv),
        )

    def _sample(self, graphdef, state, prompt_tokens, prompt_mask, key, per_row):
        self.num_traces += 1  # Runs only while tracing.
        rows = prompt_tokens.shape[0]
        slots = rows if self.slots is None else min(self.slots, rows)
        model = nnx.merge(graphdef, state)
        s = self._first_slots(model, prompt_tokens, prompt_mask, slots)
        row_keys = jax.vmap(jax.random.fold_in, (None, 0))(key, jnp.arange(rows, dtype=jnp.int32))

        def body(s: _SlotState, refill: bool) -> _SlotState:
            decoder = nnx.merge(graphdef, state)
            s, ended_b = self._decode_step(decoder, s, row_keys, per_row)
            if refill:
                return self._refill(decoder, s, ended_b, prompt_tokens, prompt_mask)
            return dataclasses.replace(s, row_b=jnp.where(ended_b, rows, s.row_b))

        # Widths B, ceil(B/2), ... down to _MIN_WIDTH. A phase runs until no row waits and
        # its busy slots fit the next width; they then move to the narrower state (tail
        # compaction: the last long rows no longer pay for B slots per step).
        widths = [slots]
        while widths[-1] > _MIN_WIDTH:
            widths.append((widths[-1] + 1) // 2)
        for phase, width in enumerate(widths):
            if phase:
                s = _compacted(s, width)
            narrower = widths[phase + 1] if phase + 1 < len(widths) else 0

            def cond(s: _SlotState, narrower=narrower) -> jax.Array:
                busy = jnp.sum(s.row_b < rows, dtype=jnp.int32)
                return (busy > 0) & ((busy > narrower) | (s.next_row < rows))

            s = jax.lax.while_loop(cond, functools.partial(body, refill=phase == 0), s)
        return SampleOutput(
            tokens=s.tokens_rn,
            completion_mask=s.mask_rn,
            logps=s.logps_rn,
            policy_logps=s.policy_logps_rn,
            lengths=jnp.sum(s.mask_rn, axis=1, dtype=jnp.int32),
        )

    def _first_slots(self, model, prompt_tokens, prompt_mask, slots: int) -> _SlotState:
        """Rows [0, B) prefilled together into the B slots, and empty output buffers."""
        rows, prompt_len = prompt_tokens.shape
        n = self.max_new_tokens
        cache = init_cache(self.config, slots, prompt_len + n, self.cache_dtype)
        hidden, cache = model.hidden_states(prompt_tokens[:slots], None, prompt_mask[:slots], cache)
        return _SlotState(
            cache=cache | {"index": jnp.full((slots,), prompt_len, jnp.int32)},
            logits_bv=model.logits(hidden[:, -1:])[:, 0],
            row_b=jnp.arange(slots, dtype=jnp.int32),
            step_b=jnp.zeros((slots,), jnp.int32),
            positions_b=jnp.sum(prompt_mask[:slots], axis=1, dtype=jnp.int32),
            next_row=jnp.asarray(slots, jnp.int32),
            tokens_rn=jnp.full((rows, n), self.pad_id, jnp.int32),
            mask_rn=jnp.zeros((rows, n), bool),
            logps_rn=jnp.zeros((rows, n), jnp.float32),
            policy_logps_rn=jnp.zeros((rows, n), jnp.float32),
        )

    def _decode_step(self, model, s: _SlotState, row_keys, per_row):
        """Samples one token in every busy slot, records it in its row and feeds it to the
        decoder. Returns the new state and which slots' rows have just ended [B]."""
        rows = s.tokens_rn.shape[0]
        busy_b = s.row_b < rows
        row_b = jnp.minimum(s.row_b, rows - 1)
        temperature, top_k, top_p, limit = (jnp.take(x, row_b, axis=0) for x in per_row)
        keys = jax.vmap(jax.random.fold_in)(jnp.take(row_keys, row_b, axis=0), s.step_b)
        tokens, logps, policy_logps = sample_step(s.logits_bv, keys, temperature, top_k, top_p)
        tokens = jnp.where(busy_b, tokens, self.pad_id)

        def put(buffer, values_b):  # Idle slots carry row R, out of bounds: dropped.
            return buffer.at[s.row_b, s.step_b].set(values_b, mode="drop")

        eos = jnp.asarray(self.eos_ids, jnp.int32)
        ends = jnp.any(tokens[:, None] == eos[None, :], axis=1) | (s.step_b + 1 >= limit)
        seq_len = s.cache["key_mask"].shape[1]
        positions_b1 = s.positions_b[:, None]
        hidden, cache = model.hidden_states(
            tokens[:, None],
            positions_b1,
            busy_b[:, None],
            s.cache,
            model.rope_tables(positions_b1, seq_len),
        )
        advance = busy_b.astype(jnp.int32)  # An idle slot stays where it is.
        new = dataclasses.replace(
            s,
            cache=cache | {"index": s.cache["index"] + advance},
            logits_bv=model.logits(hidden)[:, 0],
            step_b=s.step_b + advance,
            positions_b=s.positions_b + advance,
            tokens_rn=put(s.tokens_rn, tokens),
            mask_rn=put(s.mask_rn, busy_b),
            logps_rn=put(s.logps_rn, logps),
            policy_logps_rn=put(s.policy_logps_rn, policy_logps),
        )
        return new, busy_b & ends

    def _refill(self, model, s: _SlotState, ended_b, prompt_tokens, prompt_mask):
        """Gives each ended slot the next waiting row (in slot order), or leaves it idle
        when none waits, and prefills the new rows one at a time."""
        rows = prompt_tokens.shape[0]
        rank_b = jnp.cumsum(ended_b.astype(jnp.int32)) - 1
        row_b = jnp.where(ended_b, jnp.minimum(s.next_row + rank_b, rows), s.row_b)
        s = dataclasses.replace(
            s,
            row_b=row_b,
            next_row=jnp.minimum(s.next_row + jnp.sum(ended_b, dtype=jnp.int32), rows),
        )

        def prefill_one(carry):
            s, pending_b = carry
            slot = jnp.argmax(pending_b).astype(jnp.int32)
            s = self._prefill_slot(model, s, slot, prompt_tokens, prompt_mask)
            return s, pending_b.at[slot].set(False)

        pending_b = ended_b & (row_b < rows)
        s, _ = jax.lax.while_loop(lambda c: jnp.any(c[1]), prefill_one, (s, pending_b))
        return s

    def _prefill_slot(self, model, s: _SlotState, slot, prompt_tokens, prompt_mask):
        """Prefills slot `slot` with its (new) row's prompt: positions [0, P) of the slot's
        cache, the key mask of the rest cleared so the previous row's keys are ignored."""
        prompt_len = prompt_tokens.shape[1]
        seq_len = s.cache["key_mask"].shape[1]
        row = s.row_b[slot]
        tokens_1p = jax.lax.dynamic_slice_in_dim(prompt_tokens, row, 1, axis=0)
        mask_1p = jax.lax.dynamic_slice_in_dim(prompt_mask, row, 1, axis=0)
        fresh = init_cache(self.config, 1, seq_len, self.cache_dtype)
        hidden, fresh = model.hidden_states(tokens_1p, None, mask_1p, fresh)
        zero = jnp.zeros((), jnp.int32)

        def put_row(big, one):
            return jax.lax.dynamic_update_slice(big, one, (slot,) + (zero,) * (big.ndim - 1))

        cache = {
            "index": s.cache["index"].at[slot].set(prompt_len),
            "key_mask": put_row(s.cache["key_mask"], fresh["key_mask"]),
            "layers": jax.tree.map(put_row, s.cache["layers"], fresh["layers"]),
        }
        return dataclasses.replace(
            s,
            cache=cache,
            logits_bv=put_row(s.logits_bv, model.logits(hidden[:, -1:])[:, 0]),
            step_b=s.step_b.at[slot].set(0),
            positions_b=s.positions_b.at[slot].set(jnp.sum(mask_1p, dtype=jnp.int32)),
        )


def _compacted(s: _SlotState, width: int) -> _SlotState:
    """`s` with only `width` slots: the busy ones first, in slot order (the caller knows
    at most `width` are busy)."""
    rows = s.tokens_rn.shape[0]
    keep = jnp.argsort(s.row_b >= rows, stable=True)[:width]

    def take(x):
        return jnp.take(x, keep, axis=0)

    return dataclasses.replace(
        s,
        cache=jax.tree.map(take, s.cache),
        logits_bv=take(s.logits_bv),
        row_b=take(s.row_b),
        step_b=take(s.step_b),
        positions_b=take(s.positions_b),
    )


def _compacted_inflight(st: _InflightState, width: int) -> _InflightState:
    return dataclasses.replace(st, slots=_compacted(st.slots, width))


def _narrower(width: int) -> int:
    """The width tail compaction moves to from `width` (0: none, `width` is the last)."""
    return (width + 1) // 2 if width > _MIN_WIDTH else 0


def _progress(s: _SlotState, steps) -> jax.Array:
    """int32 [3]: decode steps just run, busy slots, first row no slot has taken."""
    rows = s.tokens_rn.shape[0]
    busy = jnp.sum(s.row_b < rows, dtype=jnp.int32)
    return jnp.stack([jnp.asarray(steps, jnp.int32), busy, s.next_row])


def _published(params_fn) -> tuple[nnx.State, int]:
    state, version = params_fn()
    if isinstance(version, bool) or not isinstance(version, int | np.integer):
        raise ValueError(f"params_fn() returned version {version!r}; it must be an int.")
    return state, int(version)
