r"""KV-cache sampler that records each sampled token's log-probability.

One jitted program per (prompt length, batch size): a prefill over the left-padded
prompts, then a `jax.lax.while_loop` that samples one token per step from the cached
decoder until every row has emitted an end-of-sequence id or `max_new_tokens` are out.
Temperature, top-k and top-p are array arguments (one value per row, or one for all), so
changing them does not recompile; `(graphdef, state)` are jit arguments, so new
parameters do not recompile either.

For each sampled token the sampler keeps two log-probabilities:

* `logps`: under the distribution actually sampled from, i.e. `softmax(logits / T)`
  restricted to the top-k / top-p set and renormalised (0 for greedy rows);
* `policy_logps`: under the temperature-1, unfiltered policy, `log_softmax(logits)`, the
  quantity `gac_jax.models.per_token_logps` recomputes for the learner.

Top-k and top-p keep every token whose scaled logit is at least the cut-off logit, so a
tie at the cut-off keeps all tied tokens. `temperature == 0` means greedy decoding.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gac_jax.models.config import ModelConfig
from gac_jax.models.decoder import init_cache
from gac_jax.models.scoring import logps_of_tokens


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
class _LoopState:
    step: jax.Array  # int32 []: tokens sampled so far.
    cache: dict  # the decoder's KV cache (see gac_jax.models.decoder).
    logits_bv: jax.Array  # f32 [B, V]: logits for the next token.
    positions_b: jax.Array  # int32 [B]: rotary position of the next token.
    done_b: jax.Array  # bool [B]: row has emitted EOS.
    tokens_bn: jax.Array  # int32 [B, N]
    mask_bn: jax.Array  # bool [B, N]
    logps_bn: jax.Array  # f32 [B, N]
    policy_logps_bn: jax.Array  # f32 [B, N]


def filter_logits(
    logits_bv: jax.Array, temperature_b: jax.Array, top_k_b: jax.Array, top_p_b: jax.Array
) -> jax.Array:
    """The sampling distribution's logits: scaled by 1/T, then top-k and top-p filtered.

    Removed tokens get `-inf`. Rows with `temperature == 0` are returned unscaled (the
    caller decodes them greedily).

    Args:
      logits_bv: float logits [B, V].
      temperature_b: float32 [B], >= 0.
      top_k_b: int32 [B]; keep the k most likely tokens, 0 (or >= V) keeps all.
      top_p_b: float32 [B] in (0, 1]; keep the smallest most-likely set whose probability
        reaches p, 1 keeps all.

    Returns:
      float32 [B, V].
    """
    vocab = logits_bv.shape[-1]
    safe_temperature = jnp.where(temperature_b > 0, temperature_b, 1.0)
    scaled = logits_bv.astype(jnp.float32) / safe_temperature[:, None]
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


def _scale_logits(logits_bv, temperature_b, top_k_b, top_p_b):
    """`filter_logits` when no row filters: only the temperature scaling."""
    del top_k_b, top_p_b
    safe_temperature = jnp.where(temperature_b > 0, temperature_b, 1.0)
    return logits_bv.astype(jnp.float32) / safe_temperature[:, None]


def sample_step(
    logits_bv: jax.Array,
    key: jax.Array,
    temperature_b: jax.Array,
    top_k_b: jax.Array,
    top_p_b: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Samples one token per row.

    Args:
      logits_bv: float logits [B, V].
      key: one `jax.random` key for the batch, or one per row ([B] typed keys or [B, 2]
        raw ones): with a key per row a row's sample does not depend on its batch.
      temperature_b: float32 [B], >= 0 (0 is greedy).
      top_k_b: int32 [B], see `filter_logits`.
      top_p_b: float32 [B], see `filter_logits`.

    Returns:
      `(tokens_b, logps_b, policy_logps_b)`: int32 ids, their log-probabilities under the
      filtered sampling distribution (0 for greedy rows) and under `log_softmax(logits)`.
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
    return tokens, logps, logps_of_tokens(logits, tokens)


def _uniform_b1(key: jax.Array, batch: int) -> jax.Array:
    """float32 [B, 1] uniforms in [0, 1): from one key, or one per row from B keys."""
    typed = jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    if key.ndim == (1 if typed else 2):
        return jax.vmap(lambda k: jax.random.uniform(k, (1,), jnp.float32))(key)
    return jax.random.uniform(key, (batch, 1), jnp.float32)


def left_pad(
    sequences: Sequence[Sequence[int]], pad_id: int, length: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Left-pads token lists into `(tokens [B, L] int32, mask [B, L] bool)`.

    Args:
      sequences: B non-empty lists of token ids.
      pad_id: id placed before the shorter sequences.
      length: L; the longest sequence's length by default (pad to a few fixed lengths
        to limit recompilation).
    """
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
    """Generates completions for left-padded prompts with a KV cache.

    Example::

        sampler = Sampler(config, max_new_tokens=32, eos_ids=tok.eos_id, pad_id=tok.pad_id)
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
        cache_dtype=None,
    ):
        """Creates the sampler and its jitted program.

        Args:
          config: the model's configuration.
          max_new_tokens: N, the most tokens generated per row (static).
          eos_ids: id or ids that end a row; the EOS token is part of the completion.
          pad_id: id written after a row has ended.
          cache_dtype: KV cache dtype; `config.dtype` by default.
        """
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
            raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a positive int.")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a positive int.")
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
        self.cache_dtype = cache_dtype
        self.num_traces = 0  # How often the program was traced (a recompilation check).
        self._jitted = jax.jit(self._sample)

    def __call__(
        self,
        graphdef: nnx.GraphDef,
        state: nnx.State,
        prompt_tokens: jax.Array,
        prompt_mask: jax.Array,
        key: jax.Array,
        *,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=None,
    ) -> SampleOutput:
        """Samples completions.

        Args:
          graphdef: from `nnx.split(model)`.
          state: the parameters, from `nnx.split(model)`.
          prompt_tokens: int [B, P], left-padded (see `left_pad`).
          prompt_mask: bool [B, P], True for real tokens; each row needs at least one, and
            all its padding must come first.
          key: a `jax.random` key; the same key gives the same tokens.
          temperature: scalar or [B], >= 0 (0 is greedy).
          top_k: scalar or [B] int, >= 0 (0 disables).
          top_p: scalar or [B], in (0, 1] (1 disables).
          max_new_tokens: scalar or [B] int in [1, `self.max_new_tokens`], each row's own
            limit (the output keeps `self.max_new_tokens` columns); all of them by default.

        Returns:
          A `SampleOutput`.
        """
        prompt_tokens, prompt_mask, per_row = self._prepared(
            prompt_tokens, prompt_mask, temperature, top_k, top_p, max_new_tokens
        )
        return self._jitted(graphdef, state, prompt_tokens, prompt_mask, key, per_row)

    def _prepared(self, prompt_tokens, prompt_mask, temperature, top_k, top_p, max_new_tokens):
        """The call's checks and conversions: `(tokens, mask, per_row)`, with `per_row` the
        [B] arrays `(temperature, top_k, top_p, max_new_tokens)`."""
        prompt_tokens = jnp.asarray(prompt_tokens)
        prompt_mask = jnp.asarray(prompt_mask)
        self._check_prompts(prompt_tokens, prompt_mask)
        rows = prompt_tokens.shape[0]
        temperature = _per_row("temperature", temperature, rows, jnp.float32)
        top_k = _per_row("top_k", top_k, rows, jnp.int32)
        top_p = _per_row("top_p", top_p, rows, jnp.float32)
        limit = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        limit = _per_row("max_new_tokens", limit, rows, jnp.int32)
        self._check_sampling(temperature, top_k, top_p, limit, self.max_new_tokens)
        per_row = (temperature, top_k, top_p, limit)
        return prompt_tokens.astype(jnp.int32), prompt_mask.astype(bool), per_row

    def generate(self, model: nnx.Module, prompt_tokens, prompt_mask, key, **sampling):
        """`self(*nnx.split(model), prompt_tokens, prompt_mask, key, **sampling)`."""
        graphdef, state = nnx.split(model)
        return self(graphdef, state, prompt_tokens, prompt_mask, key, **sampling)

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

    @staticmethod
    def _check_sampling(temperature, top_k, top_p, limit, most):
        checks = (
            ("temperature", temperature, lambda v: v >= 0, ">= 0"),
            ("top_k", top_k, lambda v: v >= 0, ">= 0"),
            ("top_p", top_p, lambda v: (v > 0) & (v <= 1), "in (0, 1]"),
            ("max_new_tokens", limit, lambda v: (v >= 1) & (v <= most), f"in [1, {most}]"),
        )
        for name, value, ok, expected in checks:
            if _is_concrete(value):
                value = np.asarray(value)
                if not np.all(ok(value)):
                    raise ValueError(f"{name}={value.tolist()} must be {expected}.")

    def _sample(self, graphdef, state, prompt_tokens, prompt_mask, key, per_row):
        self.num_traces += 1  # Runs only while tracing.
        temp, top_k, top_p, limit_b = per_row
        cfg, n = self.config, self.max_new_tokens
        batch, prompt_len = prompt_tokens.shape
        eos = jnp.asarray(self.eos_ids, jnp.int32)

        model = nnx.merge(graphdef, state)
        cache = init_cache(cfg, batch, prompt_len + n, self.cache_dtype)
        # Positions from the mask (the default): the prefill looks its rotary tables up.
        hidden, cache = model.hidden_states(prompt_tokens, None, prompt_mask, cache)
        logits_bv = model.logits(hidden[:, -1:])[:, 0]

        # Rotary tables for every decode step, looked up once outside the loop (the same
        # constant tables the prefill and the learner's forward use).
        positions_b0 = jnp.sum(prompt_mask, axis=1, dtype=jnp.int32)
        rope_cos, rope_sin = model.rope_tables(
            positions_b0[:, None] + jnp.arange(n, dtype=jnp.int32)[None, :], prompt_len + n
        )

        init = _LoopState(
            step=jnp.zeros((), jnp.int32),
            cache=cache,
            logits_bv=logits_bv,
            positions_b=positions_b0,
            done_b=jnp.zeros((batch,), bool),
            tokens_bn=jnp.full((batch, n), self.pad_id, jnp.int32),
            mask_bn=jnp.zeros((batch, n), bool),
            logps_bn=jnp.zeros((batch, n), jnp.float32),
            policy_logps_bn=jnp.zeros((batch, n), jnp.float32),
        )

        def cond(s: _LoopState):
            return (s.step < n) & ~jnp.all(s.done_b)

        def body(s: _LoopState) -> _LoopState:
            step_key = jax.random.fold_in(key, s.step)
            tokens, logps, policy_logps = sample_step(s.logits_bv, step_key, temp, top_k, top_p)
            active = ~s.done_b
            tokens = jnp.where(active, tokens, self.pad_id)
            zero = jnp.zeros((), jnp.int32)

            def put(buffer, column):
                return jax.lax.dynamic_update_slice(buffer, column[:, None], (zero, s.step))

            ends = jnp.any(tokens[:, None] == eos[None, :], axis=1) | (s.step + 1 >= limit_b)
            done = s.done_b | (active & ends)
            decoder = nnx.merge(graphdef, state)
            step_rope = tuple(
                jax.lax.dynamic_slice_in_dim(table, s.step, 1, axis=1)
                for table in (rope_cos, rope_sin)
            )
            hidden, cache = decoder.hidden_states(
                tokens[:, None], s.positions_b[:, None], active[:, None], s.cache, step_rope
            )
            return _LoopState(
                step=s.step + 1,
                cache=cache,
                logits_bv=decoder.logits(hidden)[:, 0],
                positions_b=s.positions_b + 1,
                done_b=done,
                tokens_bn=put(s.tokens_bn, tokens),
                mask_bn=put(s.mask_bn, active),
                logps_bn=put(s.logps_bn, jnp.where(active, logps, 0.0)),
                policy_logps_bn=put(s.policy_logps_bn, jnp.where(active, policy_logps, 0.0)),
            )

        final = jax.lax.while_loop(cond, body, init)
        return SampleOutput(
            tokens=final.tokens_bn,
            completion_mask=final.mask_bn,
            logps=final.logps_bn,
            policy_logps=final.policy_logps_bn,
            lengths=jnp.sum(final.mask_bn, axis=1, dtype=jnp.int32),
        )
