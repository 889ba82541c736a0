r"""The KV-cache sampler: continuous batching, per-token log-probabilities, in-flight updates.

`Sampler` takes R left-padded prompts and decodes B of them at a time (`slots`; all R by
default). When a row ends (an EOS id or its length limit) its slot takes the next
waiting prompt, in row order, and reuses the slot's part of the KV cache: with
heavy-tailed completion lengths the slots stay busy instead of padding behind the
longest row. The cache is B slots of `S = P + max_new_tokens` positions, whatever R is.
A slot's sequence has the prompt left-padded into positions [0, P) and token j of the
completion at P + j; slots write at their own positions with the decoder's per-row cache
index. A refilled slot ignores the previous row's keys: the new prompt's key mask covers
[0, P), and each completion position is overwritten before the causal mask lets the new
row see it.

Once no prompt waits, the last long rows would still pay for B slots per step: each time
the busy slots fit in half the width (`_narrower`), they are gathered into a state of
half as many slots (down to 4) and decoding goes on there ("tail compaction").

One decode step (`Sampler._decode_step`: sample a token in every busy slot, record it,
feed it to the decoder, refill the slots that ended) sits behind one loop
(`Sampler._decode_loop`) and two drivers, as gemma's sampler has one `_sample_step`:

* `__call__`: one jitted program per (rows, prompt length, slots), a batched prefill of
  the first B prompts, then one `jax.lax.while_loop` per width; the scheduler lives on
  the device (no host round trip per step, no program per refill batch size).
* the slot API (`prepare`, `start`, `run_chunk`, `compact`, `append_observation`,
  `end_slot`), which `gac_jax.rollout.episode_driver.EpisodeSampler`'s host loop drives:
  the same loop in chunks of at most `chunk_steps` decode steps, one jitted call each,
  the slot state (KV cache included) staying on the device. Between chunks the host
  fetches the newest params (in-flight weight updates, PipelineRL's idea: a long row is
  finished by newer weights; each token records its version, `InflightSampleOutput`),
  and in multi-turn episodes a slot whose turn ends waits (`EpisodeSlots.waiting_b`),
  decoding nothing, until the host appends its environment's observation.

The mode is the state's type: `SlotState` (`__call__`'s), `InflightSlots` (each token's
version recorded) or `EpisodeSlots` (slots that wait for an environment), never a
missing field.

Temperature, top-k, top-p and each row's length limit are array arguments (one value per
row, or one for all), so changing them does not recompile; `(graphdef, state)` are jit
arguments, so new parameters do not recompile either. Randomness is per row: row r's
token j is drawn with `fold_in(fold_in(key, r), j)`, so a row's completion does not
depend on which slot served it, when, or how many rows shared its call.

For each sampled token the sampler keeps two log-probabilities:

* `logps`: under the distribution actually sampled from, i.e. `softmax(logits / T)`
  restricted to the top-k / top-p set and renormalised (0 for greedy rows);
* `policy_logps`: under the temperature-1, unfiltered policy, `log_softmax(logits)`, the
  quantity `gac_jax.models.per_token_logps` recomputes for the learner.

Top-k and top-p keep every token whose scaled logit is at least the cut-off logit, so a
tie at the cut-off keeps all tied tokens. `temperature == 0` means greedy decoding.

Over 450 lines because `__call__` and the slot API share the slot state, the decode
step, the refill and the compaction, which would otherwise be split across modules that
only make sense together.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gac_jax._validation import check_int
from gac_jax.models.config import ModelConfig
from gac_jax.models.decoder import init_cache, map_rows
from gac_jax.models.scoring import logps_of_tokens

# Tail compaction stops halving the decode width here: narrower steps cost about the same
# (the weights, not the rows, dominate) and each width is one more compiled loop.
_MIN_WIDTH = 4


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SampleOutput:
    """What the sampler returns. N = `max_new_tokens`; columns past a row's end are pad."""

    tokens: jax.Array  # int32 [B, N]: completion tokens (EOS included), then pad_id.
    completion_mask: jax.Array  # bool [B, N]: True for generated tokens, EOS included.
    logps: jax.Array  # f32 [B, N]: log-prob under the sampling distribution; 0 if masked.
    policy_logps: jax.Array  # f32 [B, N]: log-prob under the temperature-1 policy.
    lengths: jax.Array  # int32 [B]: number of generated tokens per row.


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class InflightSampleOutput(SampleOutput):
    """`SampleOutput` of `EpisodeSampler.sample_inflight`, with each token's version."""

    # int32 [R, N]: version of the params that sampled each token, -1 past a row's end;
    # non-decreasing along a row when the published versions are.
    token_versions: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Prompts:
    """A call's prompts as `Sampler.prepare` checked them, its key and per-row settings."""

    tokens: jax.Array  # int32 [R, P], left-padded.
    mask: jax.Array  # bool [R, P]
    key: jax.Array  # The call's `jax.random` key; row r draws with fold_in(key, r).
    per_row: tuple  # [R] arrays (temperature f32, top_k i32, top_p f32, max_new_tokens i32).


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotState:
    """The decode slots of one call: B slots' KV cache and next-token logits, the row each
    serves, and the R rows' outputs so far."""

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

    def output(self, cls: type, **extra):
        """The rows' outputs so far as `cls` (`SampleOutput` or a subclass: `extra` holds
        its other fields)."""
        lengths = jnp.sum(self.mask_rn, axis=1, dtype=jnp.int32)
        outputs = (self.tokens_rn, self.mask_rn, self.logps_rn, self.policy_logps_rn, lengths)
        return cls(*outputs, **extra)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class InflightSlots(SlotState):
    """The slot API's `SlotState`, with the params version that sampled each token."""

    versions_rn: jax.Array  # int32 [R, N]: -1 past a row's end.


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EpisodeSlots(InflightSlots):
    """`InflightSlots` of multi-turn episodes (`gac_jax.rollout.episode_driver`): a slot
    whose turn ends waits for its environment's observation, neither decoding nor refilled."""

    waiting_b: jax.Array  # bool [B]: the slot's turn has ended; it waits.
    observed_rn: jax.Array  # bool [R, N]: the row's observation tokens (context, not sampled).
    turn_end_tl: jax.Array  # int32 [T, L]: what ends a turn, right-aligned, -1 padding.


def _turn_ended(s: EpisodeSlots, tokens_b, row_b) -> jax.Array:
    """bool [B]: whether each slot's policy tokens end, with this step's `tokens_b`, in one
    of the sequences `s.turn_end_tl`. Earlier tokens are read from the slot's row; a
    sequence never spans an observation."""
    turn_tl = s.turn_end_tl
    back = jnp.arange(turn_tl.shape[1] - 1, 0, -1, dtype=jnp.int32)  # L-1 .. 1 steps back.
    columns_bl = s.step_b[:, None] - back[None, :]
    rows_bl = row_b[:, None]
    at_bl = jnp.maximum(columns_bl, 0)
    policy_bl = s.mask_rn[rows_bl, at_bl] & (columns_bl >= 0)
    before_bl = jnp.where(policy_bl, s.tokens_rn[rows_bl, at_bl], -2)
    window_bl = jnp.concatenate([before_bl, tokens_b[:, None]], axis=1)
    match_btl = (window_bl[:, None, :] == turn_tl[None]) | (turn_tl[None] < 0)
    return jnp.any(jnp.all(match_btl, axis=2), axis=1)


def filter_logits(
    logits_bv: jax.Array, temperature_b: jax.Array, top_k_b: jax.Array, top_p_b: jax.Array
) -> jax.Array:
    """The sampling distribution's logits, float32 [B, V]: scaled by 1/T, then top-k and
    top-p filtered; removed tokens get `-inf`. Rows with `temperature == 0` are returned
    unscaled (the caller decodes them greedily).

    `top_k_b` keeps the k most likely tokens (0 or >= V keeps all); `top_p_b` in (0, 1]
    keeps the smallest most-likely set whose probability reaches p (1 keeps all).
    """
    vocab = logits_bv.shape[-1]
    scaled = _scale_logits(logits_bv, temperature_b)
    sorted_desc = jnp.flip(jnp.sort(scaled, axis=-1), axis=-1)
    k_eff = jnp.where((top_k_b > 0) & (top_k_b < vocab), top_k_b, vocab)
    rank_v = jnp.arange(vocab, dtype=jnp.int32)[None, :]
    within_k = rank_v < k_eff[:, None]
    probs = jax.nn.softmax(jnp.where(within_k, sorted_desc, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    within_p = (mass_before < top_p_b[:, None]) | (top_p_b[:, None] >= 1.0)
    num_kept = jnp.maximum(jnp.sum(within_k & within_p, axis=-1), 1)
    cutoff = jnp.take_along_axis(sorted_desc, (num_kept - 1)[:, None], axis=-1)
    return jnp.where(scaled >= cutoff, scaled, -jnp.inf)


def _scale_logits(logits_bv, temperature_b, *unused_filters):
    """`filter_logits` when no row filters: only the temperature scaling."""
    safe_temperature = jnp.where(temperature_b > 0, temperature_b, 1.0)
    return logits_bv.astype(jnp.float32) / safe_temperature[:, None]


def sample_step(
    logits_bv: jax.Array,
    key: jax.Array,
    temperature_b: jax.Array,
    top_k_b: jax.Array,
    top_p_b: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Samples one token per row of `logits_bv` [B, V] (settings as `filter_logits`;
    temperature 0 is greedy). `key`: one `jax.random` key for the batch, or one per row
    ([B] typed keys or [B, 2] raw ones), so that a row's sample does not depend on its batch.

    Returns `(tokens_b, logps_b, policy_logps_b)`: int32 ids, their log-probabilities under
    the filtered sampling distribution (0 for greedy rows) and under `log_softmax(logits)`.
    """
    logits = logits_bv.astype(jnp.float32)
    vocab = logits.shape[-1]
    # Top-k / top-p need a sort of every row; skip it at run time when no row filters.
    filters = jnp.any(((top_k_b > 0) & (top_k_b < vocab)) | (top_p_b < 1.0))
    filtered = jax.lax.cond(
        filters, filter_logits, _scale_logits, logits, temperature_b, top_k_b, top_p_b
    )
    greedy_row = temperature_b <= 0
    # Inverse-CDF sampling: one uniform per row against the running sum of the filtered
    # probabilities, instead of `jax.random.categorical`'s Gumbel noise for every logit
    # and an arg-max over it (on CPU those two passes cost more than the rest of the
    # sampling head). u is in (0, 1], so the chosen token always has nonzero probability.
    unnormalised = jnp.exp(filtered - jnp.max(filtered, axis=-1, keepdims=True))
    cdf = jnp.cumsum(unnormalised, axis=-1)
    u = 1.0 - _uniform_b1(key, filtered.shape[0])
    sampled = jnp.sum(cdf < u * cdf[:, -1:], axis=-1, dtype=jnp.int32)
    greedy = jax.lax.cond(
        jnp.any(greedy_row),
        lambda x: jnp.argmax(x, axis=-1).astype(jnp.int32),
        lambda x: jnp.zeros(x.shape[:1], jnp.int32),
        logits,
    )
    tokens = jnp.where(greedy_row, greedy, sampled)
    logps = jnp.where(greedy_row, 0.0, logps_of_tokens(filtered, tokens))
    # At temperature 1 with no filter the sampled distribution is the policy (logits / 1
    # is exact), so its log-probs are the policy's, bit for bit: no second log-softmax
    # over the vocabulary.
    plain = jnp.all(temperature_b == 1.0) & ~filters
    policy_logps = jax.lax.cond(plain, lambda: logps, lambda: logps_of_tokens(logits, tokens))
    return tokens, logps, policy_logps


def _uniform_b1(key: jax.Array, batch: int) -> jax.Array:
    """float32 [B, 1] uniforms in [0, 1): from one key, or one per row from B keys."""
    typed = jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    if key.ndim == (1 if typed else 2):
        return jax.vmap(lambda k: jax.random.uniform(k, (1,), jnp.float32))(key)
    return jax.random.uniform(key, (batch, 1), jnp.float32)


def left_pad(
    sequences: Sequence[Sequence[int]], pad_id: int, length: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Left-pads B non-empty token lists into `(tokens [B, L] int32, mask [B, L] bool)`.
    L is `length`, the longest sequence's by default (pad to a few fixed lengths to limit
    recompilation)."""
    if not sequences:
        raise ValueError("left_pad needs at least one sequence; got none.")
    lengths = [len(s) for s in sequences]
    if min(lengths) == 0:
        raise ValueError(f"Sequence {lengths.index(0)} is empty; prompts need >= 1 token.")
    length = max(lengths) if length is None else length
    if length < max(lengths):
        raise ValueError(f"length={length} is shorter than the longest sequence ({max(lengths)}).")
    tokens = np.full((len(sequences), length), pad_id, np.int32)
    mask = np.zeros((len(sequences), length), bool)
    for row, seq in enumerate(sequences):
        tokens[row, length - len(seq) :] = np.asarray(seq, np.int32)
        mask[row, length - len(seq) :] = True
    return tokens, mask


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _per_row(name: str, value, batch: int, dtype) -> jax.Array:
    array = jnp.asarray(value, dtype)
    if array.ndim == 0:
        return jnp.broadcast_to(array, (batch,))
    if array.shape != (batch,):
        raise ValueError(
            f"{name} must be a scalar or have shape ({batch},); got shape {array.shape}."
        )
    return array


class Sampler:
    """Generates completions for left-padded prompts with a KV cache of `slots` rows.

    Example::

        sampler = Sampler(config, max_new_tokens=1024, eos_ids=tok.eos_id,
                          pad_id=tok.pad_id, slots=64)
        graphdef, state = nnx.split(model)
        out = sampler(graphdef, state, prompt_tokens, prompt_mask, jax.random.key(0),
                      temperature=0.8, top_p=0.95)
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
        """Creates the sampler and its jitted programs.

        Args:
          max_new_tokens: N, the most tokens generated per row (static).
          eos_ids: id or ids that end a row; the EOS token is part of the completion.
          pad_id: id written after a row has ended.
          slots: B, rows decoded together (static); None decodes all rows of a call
            together. A call with fewer rows uses one slot per row.
          cache_dtype: KV cache dtype; `config.dtype` by default.
        """
        check_int("max_new_tokens", max_new_tokens, 1)
        check_int("slots", slots, 1, allow_none=True)
        eos = (eos_ids,) if isinstance(eos_ids, int | np.integer) else tuple(eos_ids)
        if not eos:
            raise ValueError("eos_ids is empty; give at least one end-of-sequence id.")
        for token in (*eos, pad_id):
            if not 0 <= int(token) < config.vocab_size:
                raise ValueError(
                    f"Token id {token!r} (eos_ids={eos_ids!r}, pad_id={pad_id!r}) is outside "
                    f"[0, vocab_size={config.vocab_size})."
                )
        self.config = config
        self.max_new_tokens = max_new_tokens
        self.eos_ids = tuple(int(t) for t in eos)
        self.pad_id = int(pad_id)
        self.slots = slots
        self.cache_dtype = cache_dtype
        specification = (config, max_new_tokens, self.eos_ids, self.pad_id, slots, cache_dtype)
        self._programs = _shared_programs(specification, self._new_programs)

    @property
    def num_traces(self) -> int:
        """How often `__call__`'s program was traced (recompilations), by this sampler or
        another of the same specification (they share their programs)."""
        return self._programs.traces

    def __call__(
        self,
        graphdef: nnx.GraphDef,
        state: nnx.State,
        prompt_tokens: jax.Array,
        prompt_mask: jax.Array,
        key: jax.Array,
        **sampling,
    ) -> SampleOutput:
        """A `SampleOutput` of one row per prompt, in prompt order, sampled by the model
        `nnx.split` gave `(graphdef, state)`.

        `prompt_tokens` int [R, P] are left-padded (`left_pad`); `prompt_mask` bool [R, P]
        is True for real tokens, at least one per row, all padding first. The same `key`
        gives the same tokens. `**sampling`: `temperature`, `top_k`, `top_p`,
        `max_new_tokens` as `prepare` takes them (each a scalar or one value per row).
        """
        p = self.prepare(prompt_tokens, prompt_mask, key, **sampling)
        return self._programs.sample(graphdef, state, p.tokens, p.mask, p.key, p.per_row)

    def lower(self, graphdef, state, prompt_tokens, prompt_mask, key, **sampling):
        """`__call__`'s program lowered for `__call__`'s arguments, which may be abstract
        (`jax.ShapeDtypeStruct`s, with shardings), for ahead-of-time planning: its
        `.compile().memory_analysis()` says whether sampling fits without creating a weight.
        """
        per_row = self._per_row_arrays(prompt_tokens.shape[0], **sampling)
        return self._programs.sample.lower(
            graphdef, state, prompt_tokens, prompt_mask, key, per_row
        )

    def generate(self, model: nnx.Module, prompt_tokens, prompt_mask, key, **sampling):
        """`self(*nnx.split(model), prompt_tokens, prompt_mask, key, **sampling)`."""
        return self(*nnx.split(model), prompt_tokens, prompt_mask, key, **sampling)

    def compiled_programs(self) -> dict[str, int]:
        """How many programs each jitted entry point holds (`__call__`'s "sample", the slot
        API's "start", "chunk", "compact", "observe", "end"; shared with the samplers of
        the same specification): recompilation checks."""
        names = ("sample", "start", "chunk", "compact", "observe", "end")
        return {name: getattr(self._programs, name)._cache_size() for name in names}

    def prepare(
        self, prompt_tokens, prompt_mask, key, *, temperature=1.0, top_k=0, top_p=1.0,
        max_new_tokens=None,
    ) -> Prompts:  # fmt: skip
        """A call's prompts checked and converted, with its key and [R] sampling settings;
        ValueError in one line for a bad one. `prompt_tokens`, `prompt_mask`, `key`: as
        for `__call__`.

        Args:
          temperature: scalar or [R], >= 0 (0 is greedy).
          top_k: scalar or [R] int, >= 0 (0 disables).
          top_p: scalar or [R], in (0, 1] (1 disables).
          max_new_tokens: scalar or [R] int in [1, `self.max_new_tokens`], each row's own
            limit (the output keeps `self.max_new_tokens` columns); all of them by default.
        """
        prompt_tokens = jnp.asarray(prompt_tokens)
        prompt_mask = jnp.asarray(prompt_mask)
        self._check_prompts(prompt_tokens, prompt_mask)
        per_row = self._per_row_arrays(
            prompt_tokens.shape[0], temperature, top_k, top_p, max_new_tokens
        )
        return Prompts(prompt_tokens.astype(jnp.int32), prompt_mask.astype(bool), key, per_row)

    # ------------------------------------------------------------------- the slot API

    def start(
        self, graphdef, state, prompts: Prompts, turn_end_ids=None
    ) -> tuple[InflightSlots, jax.Array]:
        """The first B rows prefilled with `state` into `InflightSlots`, every token's
        version recorded from here on (-1 until sampled); given `turn_end_ids` (int32
        [T, L]: the sequences that end a policy turn, right-aligned, -1 before shorter
        ones), `EpisodeSlots`. Returns the slots and their progress (int32 [3]: decode
        steps just run, busy slots, first row no slot took)."""
        return self._programs.start(graphdef, state, prompts.tokens, prompts.mask, turn_end_ids)

    def run_chunk(
        self, graphdef, state, slots: InflightSlots, prompts: Prompts, *, version: int,
        budget: int, refresh: bool = False,
    ) -> tuple[InflightSlots, jax.Array]:  # fmt: skip
        """At most `budget` decode steps with `state` (version `version`; the busy slots'
        last tokens fed again first if `refresh`), stopping early where `__call__` would
        compact, or, for `EpisodeSlots`, as soon as one more slot waits for its
        environment. `slots` is donated. Returns the new slots and their progress (as
        `start`)."""
        return self._programs.chunk(
            graphdef, state, slots, prompts, jnp.asarray(version, jnp.int32),
            jnp.asarray(budget, jnp.int32), jnp.asarray(refresh),
        )  # fmt: skip

    def append_observation(self, graphdef, state, slots: EpisodeSlots, slot: int, block, length):
        """Feeds the first `length` tokens of `block` (int32 [K]) into waiting slot `slot`'s
        cache at its next positions, writes them into its row as observation tokens and
        lets the slot decode again. `slots` is donated."""
        return self._programs.observe(
            graphdef, state, slots, jnp.int32(slot), block, jnp.int32(length)
        )

    def end_slot(self, graphdef, state, slots: EpisodeSlots, slot: int, prompts: Prompts):
        """Ends waiting slot `slot`'s row at its turn's end; the slot takes the next row
        no slot has taken (prefilled with `state`), or idles. `slots` is donated."""
        return self._programs.end(
            graphdef, state, slots, jnp.int32(slot), prompts.tokens, prompts.mask
        )

    def narrower_width(self, slots: SlotState) -> int:
        """The width tail compaction moves `slots` to once no row waits for a slot and
        their busy slots fit it; 0 where `slots` is already the narrowest."""
        return _narrower(slots.row_b.shape[0])

    def compact(self, slots: SlotState, width: int) -> SlotState:
        """`slots` gathered into `width` (`narrower_width`) slots, the busy ones first in
        slot order; the caller checks that at most `width` are busy and no row waits.
        `slots` is not donated."""
        return self._programs.compact(slots, width=width)

    def _new_programs(self) -> _Programs:
        return _Programs(
            sample=jax.jit(self._sample),
            start=jax.jit(self._start_program),
            chunk=jax.jit(self._chunk_program, donate_argnames="s"),
            compact=jax.jit(_compacted, static_argnames="width"),
            observe=jax.jit(self._observe_program, donate_argnames="s"),
            end=jax.jit(self._end_program, donate_argnames="s"),
        )

    def _per_row_arrays(self, rows, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=None):
        """The [R] arrays `(temperature, top_k, top_p, max_new_tokens)` of a call, each
        checked where it is concrete (ValueError in one line)."""
        n = self.max_new_tokens
        limit = n if max_new_tokens is None else max_new_tokens
        settings = (
            ("temperature", temperature, jnp.float32, lambda v: v >= 0, ">= 0"),
            ("top_k", top_k, jnp.int32, lambda v: v >= 0, ">= 0"),
            ("top_p", top_p, jnp.float32, lambda v: (v > 0) & (v <= 1), "in (0, 1]"),
            ("max_new_tokens", limit, jnp.int32, lambda v: (v >= 1) & (v <= n), f"in [1, {n}]"),
        )
        arrays = tuple(_per_row(name, value, rows, dtype) for name, value, dtype, *_ in settings)
        for (name, _, _, ok, expected), array in zip(settings, arrays, strict=True):
            if _is_concrete(array) and not np.all(ok(np.asarray(array))):
                raise ValueError(f"{name}={np.asarray(array).tolist()} must be {expected}.")
        return arrays

    def _check_prompts(self, tokens, mask):
        if tokens.ndim != 2:
            raise ValueError(f"prompt_tokens must have shape [B, P]; got {tokens.shape}.")
        if mask.shape != tokens.shape:
            raise ValueError(
                f"prompt_mask shape {mask.shape} != prompt_tokens shape {tokens.shape}."
            )
        if not (_is_concrete(tokens) and _is_concrete(mask)):
            return
        tokens_np, mask_np = np.asarray(tokens), np.asarray(mask).astype(bool)
        empty = np.flatnonzero(~mask_np.any(axis=1))
        if empty.size:
            raise ValueError(f"Prompt rows {empty.tolist()} have no real token in prompt_mask.")
        not_left = np.flatnonzero((np.diff(mask_np.astype(np.int8), axis=1) < 0).any(axis=1))
        if not_left.size:
            raise ValueError(
                f"Prompt rows {not_left.tolist()} are not left-padded: a real token is "
                "followed by padding. Put all padding first (see left_pad)."
            )
        vocab = self.config.vocab_size
        bad = (tokens_np < 0) | (tokens_np >= vocab)
        if (bad & mask_np).any():
            row, col = np.argwhere(bad & mask_np)[0]
            raise ValueError(
                f"prompt_tokens[{row}, {col}]={tokens_np[row, col]} is outside "
                f"[0, vocab_size={vocab})."
            )

    def _width(self, rows: int) -> int:
        """B for a call of `rows` rows: the slots that start decoding (and refill)."""
        return rows if self.slots is None else min(self.slots, rows)

    def _sample(self, graphdef, state, prompt_tokens, prompt_mask, key, per_row):
        """`__call__`'s program: the first B rows prefilled, then one decode loop per width
        of the tail compaction schedule."""
        self._programs.traces += 1  # Runs only while tracing.
        prompts = Prompts(prompt_tokens, prompt_mask, key, per_row)
        s = self._first_slots(nnx.merge(graphdef, state), prompt_tokens, prompt_mask)
        no_budget = jnp.asarray(np.iinfo(np.int32).max, jnp.int32)
        while True:
            s, _ = self._decode_loop(graphdef, state, s, prompts, no_budget)
            if not _narrower(s.row_b.shape[0]):
                return s.output(SampleOutput)
            s = _compacted(s, _narrower(s.row_b.shape[0]))

    def _start_program(self, graphdef, state, prompt_tokens, prompt_mask, turn_end_tl):
        """`start`'s program: `_first_slots`, no version recorded yet."""
        s = self._first_slots(nnx.merge(graphdef, state), prompt_tokens, prompt_mask)
        versions_rn = jnp.full(s.tokens_rn.shape, -1, jnp.int32)
        if turn_end_tl is None:
            s = InflightSlots(**vars(s), versions_rn=versions_rn)
        else:
            waiting_b, observed_rn = jnp.zeros(s.row_b.shape, bool), jnp.zeros_like(s.mask_rn)
            s = EpisodeSlots(**vars(s), versions_rn=versions_rn, waiting_b=waiting_b,
                             observed_rn=observed_rn, turn_end_tl=turn_end_tl)  # fmt: skip
        return s, _progress(s, 0)

    def _chunk_program(self, graphdef, state, s: InflightSlots, prompts, version, budget, refresh):
        """`run_chunk`'s program: at most `budget` steps of `__call__`'s loop at the state's
        width, each token sampled recording `version`. Returns the new state and
        `_progress`."""

        def refreshed(s: SlotState) -> SlotState:
            return self._fed_again(nnx.merge(graphdef, state), s, prompts.tokens)

        sampled_rn = s.mask_rn
        s = jax.lax.cond(refresh, refreshed, lambda s: s, s)
        s, steps = self._decode_loop(graphdef, state, s, prompts, budget)
        versions_rn = jnp.where(s.mask_rn & ~sampled_rn, version, s.versions_rn)
        return dataclasses.replace(s, versions_rn=versions_rn), _progress(s, steps)

    def _decode_loop(self, graphdef, state, s: SlotState, prompts: Prompts, budget):
        """Decode steps at `s`'s width until `budget` steps are run, every row has ended,
        or no row waits and the busy slots fit the next width. The widest state refills
        the slots that end; narrower ones only follow their rows to the end. Returns
        `(state, decode steps run)`."""
        rows = prompts.tokens.shape[0]
        width = s.row_b.shape[0]
        refill = width == self._width(rows)
        narrower = _narrower(width)
        if isinstance(s, EpisodeSlots):  # No compaction; back to the host at a turn end.
            waiting = jnp.sum(s.waiting_b, dtype=jnp.int32)

            def cond(carry) -> jax.Array:
                s, step = carry
                decoding = jnp.sum((s.row_b < rows) & ~s.waiting_b, dtype=jnp.int32)
                unchanged = jnp.sum(s.waiting_b, dtype=jnp.int32) == waiting
                return (step < budget) & (decoding > 0) & unchanged

        else:

            def cond(carry) -> jax.Array:
                s, step = carry
                busy = jnp.sum(s.row_b < rows, dtype=jnp.int32)
                return (step < budget) & (busy > 0) & ((busy > narrower) | (s.next_row < rows))

        # Unrolled layers are cut once here: cut in the loop, each step copies each weight.
        unrolled = not self.config.scan_layers
        layers = nnx.merge(graphdef, state).layer_slices() if unrolled else None

        def body(carry):
            s, step = carry
            model = _SlicedLayers(nnx.merge(graphdef, state), layers)
            return self._decode_step(model, s, prompts, refill), step + 1

        return jax.lax.while_loop(cond, body, (s, jnp.zeros((), jnp.int32)))

    def _decode_step(self, model, s: SlotState, prompts: Prompts, refill: bool) -> SlotState:
        """The one decode step: samples a token in every busy slot, records it in its row,
        feeds it to the decoder, then hands each slot whose row has just ended the next
        waiting row (`refill`) or leaves it idle."""
        rows = s.tokens_rn.shape[0]
        episodes = isinstance(s, EpisodeSlots)
        # The row each slot writes to: R (dropped) for idle slots and waiting ones.
        written_b = jnp.where(s.waiting_b, rows, s.row_b) if episodes else s.row_b
        busy_b = written_b < rows  # Decoding: not idle, not waiting for an environment.
        row_b = jnp.minimum(s.row_b, rows - 1)
        temperature, top_k, top_p, limit = (jnp.take(x, row_b, axis=0) for x in prompts.per_row)
        # Row r's draws use fold_in(key, r), so they do not depend on its slot.
        row_keys = jax.vmap(jax.random.fold_in, (None, 0))(prompts.key, row_b)
        keys = jax.vmap(jax.random.fold_in)(row_keys, s.step_b)
        tokens, logps, policy_logps = sample_step(s.logits_bv, keys, temperature, top_k, top_p)
        tokens = jnp.where(busy_b, tokens, self.pad_id)

        def put(buffer, values_b):
            return buffer.at[written_b, s.step_b].set(values_b, mode="drop")

        eos = jnp.asarray(self.eos_ids, jnp.int32)
        eos_b = jnp.any(tokens[:, None] == eos[None, :], axis=1)
        full_b = s.step_b + 1 >= limit
        if episodes:  # A turn ends: the slot waits for its environment.
            # A turn-end token that is also EOS (a chat template's end of turn) ends the
            # turn; the environment then says whether the episode ends.
            turn_b = _turn_ended(s, tokens, row_b)
            eos_b = eos_b & ~turn_b
            s = dataclasses.replace(s, waiting_b=s.waiting_b | (busy_b & turn_b & ~full_b))
        ends = eos_b | full_b
        logits_bv, cache = _feed(model, tokens, s.positions_b, busy_b, s.cache)
        advance = busy_b.astype(jnp.int32)  # An idle slot stays where it is.
        s = dataclasses.replace(
            s,
            cache=cache | {"index": s.cache["index"] + advance},
            logits_bv=logits_bv,
            step_b=s.step_b + advance,
            positions_b=s.positions_b + advance,
            tokens_rn=put(s.tokens_rn, tokens),
            mask_rn=put(s.mask_rn, busy_b),
            logps_rn=put(s.logps_rn, logps),
            policy_logps_rn=put(s.policy_logps_rn, policy_logps),
        )
        ended_b = busy_b & ends
        if refill:
            return self._refill(model, s, ended_b, prompts.tokens, prompts.mask)
        return dataclasses.replace(s, row_b=jnp.where(ended_b, rows, s.row_b))

    def _observe_program(self, graphdef, state, s: EpisodeSlots, slot, block_k, length):
        """`append_observation`'s program: one prefill of K tokens (the rest masked) into
        the slot's row of the cache; the last real one's logits become the slot's."""
        model = nnx.merge(graphdef, state)
        k = block_k.shape[0]
        real_1k = (jnp.arange(k) < length)[None, :]
        tokens_1k = block_k[None, :]
        one = map_rows(lambda x, axis: jax.lax.dynamic_slice_in_dim(x, slot, 1, axis), s.cache)
        positions_1k = s.positions_b[slot] + jnp.arange(k, dtype=jnp.int32)[None, :]
        rope = model.rope_tables(positions_1k, one["key_mask"].shape[1])
        hidden, one = model.hidden_states(tokens_1k, positions_1k, real_1k, one, rope)
        logits_v = model.logits(jax.lax.dynamic_slice_in_dim(hidden, length - 1, 1, axis=1))[0, 0]
        cache = _cache_with_row(s.cache, slot, one, s.cache["index"].at[slot].add(length))
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

    def _end_program(self, graphdef, state, s: EpisodeSlots, slot, prompt_tokens, prompt_mask):
        """`end_slot`'s program: the slot stops waiting and is refilled like an ended row."""
        ended_b = jnp.arange(s.row_b.shape[0]) == slot
        s = dataclasses.replace(s, waiting_b=s.waiting_b & ~ended_b)
        model = nnx.merge(graphdef, state)
        return self._refill(model, s, ended_b, prompt_tokens, prompt_mask)

    def _fed_again(self, model, s: SlotState, prompt_tokens) -> SlotState:
        """Each busy slot's last fed token (its row's latest sample, or the last prompt
        token of a row with none yet) fed again through `model` at its own position:
        its KV entry and the slot's next-token logits become `model`'s."""
        rows, prompt_len = prompt_tokens.shape
        busy_b = s.row_b < rows
        row_b = jnp.minimum(s.row_b, rows - 1)
        sampled_b = s.tokens_rn[row_b, jnp.maximum(s.step_b - 1, 0)]
        last_b = jnp.where(s.step_b > 0, sampled_b, prompt_tokens[row_b, prompt_len - 1])
        # Idle slots write nothing real (masked), at a position their next prefill clears.
        back_one = s.cache | {"index": s.cache["index"] - 1}
        logits_bv, cache = _feed(model, last_b, s.positions_b - 1, busy_b, back_one)
        return dataclasses.replace(
            s,
            cache=cache | {"index": s.cache["index"]},
            logits_bv=jnp.where(busy_b[:, None], logits_bv, s.logits_bv),
        )

    def _first_slots(self, model, prompt_tokens, prompt_mask) -> SlotState:
        """Rows [0, B) prefilled together into the B slots, and empty output buffers."""
        rows, prompt_len = prompt_tokens.shape
        slots, n = self._width(rows), self.max_new_tokens
        cache = init_cache(self.config, slots, prompt_len + n, self.cache_dtype)
        hidden, cache = model.hidden_states(prompt_tokens[:slots], None, prompt_mask[:slots], cache)
        return SlotState(
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

    def _refill(self, model, s: SlotState, ended_b, prompt_tokens, prompt_mask):
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

    def _prefill_slot(self, model, s: SlotState, slot, prompt_tokens, prompt_mask):
        """Prefills slot `slot` with its (new) row's prompt: positions [0, P) of the slot's
        cache, the key mask of the rest cleared so the previous row's keys are ignored."""
        prompt_len = prompt_tokens.shape[1]
        seq_len = s.cache["key_mask"].shape[1]
        row = s.row_b[slot]
        tokens_1p = jax.lax.dynamic_slice_in_dim(prompt_tokens, row, 1, axis=0)
        mask_1p = jax.lax.dynamic_slice_in_dim(prompt_mask, row, 1, axis=0)
        fresh = init_cache(self.config, 1, seq_len, self.cache_dtype)
        hidden, fresh = model.hidden_states(tokens_1p, None, mask_1p, fresh)
        cache = _cache_with_row(s.cache, slot, fresh, s.cache["index"].at[slot].set(prompt_len))
        return dataclasses.replace(
            s,
            cache=cache,
            logits_bv=_put_row(s.logits_bv, model.logits(hidden[:, -1:])[:, 0], slot),
            step_b=s.step_b.at[slot].set(0),
            positions_b=s.positions_b.at[slot].set(jnp.sum(mask_1p, dtype=jnp.int32)),
        )


@dataclasses.dataclass
class _Programs:
    """The jitted programs of one sampler specification (see `_shared_programs`), built by
    the first sampler of it and shared by every later one: a run builds training and
    evaluation samplers, a sweep or a test process builds many, most of them alike, and
    each would otherwise trace, lower and load the same programs again (a quick
    laboratory run's samplers spent more time there than decoding)."""

    sample: Callable
    start: Callable
    chunk: Callable
    compact: Callable
    observe: Callable
    end: Callable
    traces: int = 0  # How often `sample` was traced.


# The programs of the last `_SHARED_SPECIFICATIONS` sampler specifications, least recently
# built first (a process that builds samplers of many shapes keeps only these alive).
_SHARED: dict[tuple, _Programs] = {}
_SHARED_SPECIFICATIONS = 16


def _shared_programs(specification: tuple, new: Callable[[], _Programs]) -> _Programs:
    """The programs of an earlier sampler of the same `specification` (its model
    configuration, lengths, special ids, slots and cache dtype: all that the programs read
    of the sampler), else `new()`."""
    programs = _SHARED.pop(specification, None) or new()
    _SHARED[specification] = programs
    while len(_SHARED) > _SHARED_SPECIFICATIONS:
        del _SHARED[next(iter(_SHARED))]
    return programs


def _put_row(big: jax.Array, one: jax.Array, slot) -> jax.Array:
    """`big` with row `slot` replaced by `one` (a leading axis of 1)."""
    zero = jnp.zeros((), jnp.int32)
    return jax.lax.dynamic_update_slice(big, one, (slot,) + (zero,) * (big.ndim - 1))


def _cache_with_row(cache: dict, slot, one: dict, index: jax.Array) -> dict:
    """`cache` with slot `slot`'s keys, values and key mask replaced by the one-row cache
    `one`'s, and the slots' write positions `index`."""
    return {
        "index": index,
        "key_mask": _put_row(cache["key_mask"], one["key_mask"], slot),
        "layers": jax.tree.map(
            lambda big, small: jax.lax.dynamic_update_slice_in_dim(big, small, slot, 1),
            cache["layers"],
            one["layers"],
        ),
    }


def _narrower(width: int) -> int:
    """The tail compaction schedule, written once: the width a state of `width` slots
    moves to once no row waits and its busy slots fit (0: none, `width` is the last)."""
    return (width + 1) // 2 if width > _MIN_WIDTH else 0


class _SlicedLayers:
    """`model`, whose `hidden_states` runs `layers` (`Decoder.layer_slices`, cut before a
    decode loop; None: its own scan)."""

    def __init__(self, model, layers):
        self.model, self.layers = model, layers

    def hidden_states(self, *args, **kwargs):
        return self.model.hidden_states(*args, layers=self.layers, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


def _compacted(s: SlotState, width: int) -> SlotState:
    """`s` with only `width` slots: the busy ones first, in slot order (the caller knows
    at most `width` are busy)."""
    rows = s.tokens_rn.shape[0]
    keep = jnp.argsort(s.row_b >= rows, stable=True)[:width]

    def take(x, axis=0):
        return jnp.take(x, keep, axis=axis)

    return dataclasses.replace(
        s,
        cache=map_rows(take, s.cache),
        logits_bv=take(s.logits_bv),
        row_b=take(s.row_b),
        step_b=take(s.step_b),
        positions_b=take(s.positions_b),
    )


def _feed(model, tokens_b, positions_b, busy_b, cache) -> tuple[jax.Array, dict]:
    """One token per slot through `model` at the slots' own positions (idle slots
    masked): the next-token logits [B, V] and the updated cache."""
    positions_b1 = positions_b[:, None]
    rope = model.rope_tables(positions_b1, cache["key_mask"].shape[1])
    hidden, cache = model.hidden_states(
        tokens_b[:, None], positions_b1, busy_b[:, None], cache, rope
    )
    return model.logits(hidden)[:, 0], cache


def _progress(s: SlotState, steps) -> jax.Array:
    """int32 [3]: decode steps just run, busy slots, first row no slot has taken."""
    rows = s.tokens_rn.shape[0]
    busy = jnp.sum(s.row_b < rows, dtype=jnp.int32)
    return jnp.stack([jnp.asarray(steps, jnp.int32), busy, s.next_row])
