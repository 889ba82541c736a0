"""The decoder-only transformer (Qwen3 and Llama 3 families) in Flax NNX.

Inputs follow Hugging Face semantics for padded batches: `input_mask` marks real tokens,
and positions count from each row's first real token (`positions_from_mask`), so a
left-padded prompt is encoded exactly as the unpadded one.

The KV cache is a plain dict of arrays (`init_cache`)::

    {"index": int32 [] or [B],           # next slot to write (one for all rows, or per row)
     "key_mask": bool [B, S],            # slots holding real tokens
     "layers": ({"k": [B, K, H, S], "v": [B, K, S, H]}, ...)}  # one dict per layer

Keys are stored with the slot axis last and values with it second to last, so both
attention products of a decode step are batched matmuls that read the cache in place.

Every call with a cache writes its T tokens at `index` with `jax.lax.dynamic_update_slice`
and advances `index` by T. The caller keeps `index + T <= S`. A per-row `index` [B] (set
by the caller, e.g. `cache | {"index": index_b}`) writes each row at its own slot with a
scatter instead: rows of one batch then hold sequences of different lengths, as the
refilling sampler's decode slots do.
"""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp
from flax import nnx

from gac_jax._validation import check_int
from gac_jax.models.chunked_logprobs import head_logits
from gac_jax.models.config import ModelConfig
from gac_jax.models.layers import (
    DecoderLayer,
    RMSNorm,
    param,
    rope_inverse_frequencies,
    rope_tables,
)
from gac_jax.models.sharding import ShardingRules, constrain

Cache = dict


def positions_from_mask(mask_bt: jax.Array) -> jax.Array:
    """Positions [B, T] counting the real tokens (True or 1 in `mask_bt` [B, T]) from each
    row's first one (pads get 0)."""
    mask = mask_bt.astype(jnp.int32)
    return jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0).astype(jnp.int32)


def init_cache(config: ModelConfig, batch_size: int, max_length: int, dtype=None) -> Cache:
    """An empty KV cache for `batch_size` rows of up to `max_length` tokens.

    Args:
      config: the model's configuration.
      batch_size: B.
      max_length: S, prompt plus generated tokens.
      dtype: storage dtype of keys and values; `config.dtype` by default.
    """
    for name, value in (("batch_size", batch_size), ("max_length", max_length)):
        check_int(name, value, 1)
    dtype = config.compute_dtype if dtype is None else jnp.dtype(dtype)
    k, h = config.num_kv_heads, config.head_dim
    return {
        "index": jnp.zeros((), jnp.int32),
        "key_mask": jnp.zeros((batch_size, max_length), bool),
        "layers": tuple(
            {
                "k": jnp.zeros((batch_size, k, h, max_length), dtype),
                "v": jnp.zeros((batch_size, k, max_length, h), dtype),
            }
            for _ in range(config.num_layers)
        ),
    }


def _rematerialized(policy_name: str):
    """`run(layer, *args)`, the layer's call, its activations recomputed in the backward
    pass (`jax.checkpoint` over the layer's state). Not `nnx.remat`: it writes the state
    back into the layer's variables afterwards, which fails ("Cannot mutate Param from a
    different trace level") when some come from another trace, as a LoRA run's frozen base
    weights do; a training forward pass changes no variable, so nothing needs writing back."""
    saveable = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    policy = saveable if policy_name == "dots" else None  # "full": recompute everything.

    def run(layer, *args):
        graphdef, state = nnx.split(layer)

        def pure(state, *args):
            return nnx.merge(graphdef, state)(*args)

        return jax.checkpoint(pure, policy=policy)(state, *args)

    return run


def _checked_inputs(
    tokens_bt: jax.Array, positions_bt: jax.Array | None, input_mask_bt: jax.Array | None
) -> tuple[jax.Array, jax.Array, int | None]:
    """`(input_mask_bt, positions_bt, max_position)` with defaults filled in, shapes checked.

    `max_position` is T when the positions are derived from the mask (they then lie in
    [0, T), so their rotary tables can be looked up), else None.
    """
    if tokens_bt.ndim != 2:
        raise ValueError(f"tokens must have shape [B, T]; got shape {tokens_bt.shape}.")
    b, t = tokens_bt.shape
    input_mask_bt = jnp.ones((b, t), bool) if input_mask_bt is None else input_mask_bt.astype(bool)
    if input_mask_bt.shape != (b, t):
        raise ValueError(f"input_mask shape {input_mask_bt.shape} != tokens shape {(b, t)}.")
    max_position = t if positions_bt is None else None
    if positions_bt is None:
        positions_bt = positions_from_mask(input_mask_bt)
    if positions_bt.shape != (b, t):
        raise ValueError(f"positions shape {positions_bt.shape} != tokens shape {(b, t)}.")
    return input_mask_bt, positions_bt, max_position


def _causal_mask(input_mask_bt: jax.Array) -> jax.Array:
    """bool [B, T, T]: query t sees key s <= t when s is a real token (no cache)."""
    t = input_mask_bt.shape[1]
    causal_tt = jnp.tril(jnp.ones((t, t), bool))
    return causal_tt[None, :, :] & input_mask_bt[:, None, :]


def _cached_mask(cache: Cache, input_mask_bt: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`(mask_bts, key_mask)`: the attention mask [B, T, S] of T new tokens written at
    `cache["index"]` (int32 [] or per row [B]), and the cache's key mask [B, S] with them
    marked."""
    b, t = input_mask_bt.shape
    cache_index = cache["index"]
    offsets_t = jnp.arange(t, dtype=jnp.int32)
    if cache_index.ndim == 0:
        key_mask = jax.lax.dynamic_update_slice_in_dim(
            cache["key_mask"], input_mask_bt, cache_index, 1
        )
        query_slot_bt = (cache_index + offsets_t)[None, :]
    else:
        query_slot_bt = cache_index[:, None] + offsets_t[None, :]
        rows_b1 = jnp.arange(b, dtype=jnp.int32)[:, None]
        key_mask = cache["key_mask"].at[rows_b1, query_slot_bt].set(input_mask_bt)
    s = key_mask.shape[1]
    causal_bts = jnp.arange(s, dtype=jnp.int32)[None, None, :] <= query_slot_bt[:, :, None]
    return causal_bts & key_mask[:, None, :], key_mask


class Decoder(nnx.Module):
    """Token embedding, `num_layers` pre-norm blocks, final RMSNorm, output projection."""

    def __init__(
        self,
        config: ModelConfig,
        rules: ShardingRules | None = None,
        *,
        rngs: nnx.Rngs,
    ):
        """Builds a randomly initialised decoder (normal(0.02) weights, unit norm scales).

        Args:
          config: architecture and dtypes, kept (static) as `self.config`.
          rules: logical-to-mesh rules for activation constraints, kept (static) as
            `self.rules`; `ShardingRules()` by default. Constraints only apply under a mesh
            set with `jax.set_mesh`.
          rngs: random streams; `rngs.params` initialises the weights.
        """
        if not isinstance(config, ModelConfig):
            raise ValueError(f"config must be a ModelConfig, got {type(config).__name__}.")
        self.config = config
        self.rules = ShardingRules() if rules is None else rules
        pdt = config.parameter_dtype
        self.embedding_vd = param(
            rngs, (config.vocab_size, config.embed_dim), ("vocab", "embed"), pdt, 0.02
        )
        self.layers = nnx.List(
            [DecoderLayer(config, self.rules, rngs=rngs) for _ in range(config.num_layers)]
        )
        self.final_norm = RMSNorm(
            config.embed_dim, eps=config.rms_norm_eps, param_dtype=pdt, rngs=rngs
        )
        if config.tie_word_embeddings:
            self.lm_head_dv = None
        else:
            self.lm_head_dv = param(
                rngs, (config.embed_dim, config.vocab_size), ("embed", "vocab"), pdt, 0.02
            )

    def hidden_states(
        self,
        tokens_bt: jax.Array,
        positions_bt: jax.Array | None = None,
        input_mask_bt: jax.Array | None = None,
        cache: Cache | None = None,
        rope: tuple[jax.Array, jax.Array] | None = None,
    ) -> tuple[jax.Array, Cache | None]:
        """The final-normed hidden states [B, T, D] (compute dtype), and the new cache.

        Args:
          tokens_bt: int token ids [B, T].
          positions_bt: rotary positions [B, T]; `positions_from_mask(input_mask_bt)` by
            default (pass them explicitly when decoding with a cache).
          input_mask_bt: bool [B, T], True for real tokens; all True by default. Padding
            tokens are never attended to.
          cache: a cache from `init_cache` (or a previous call), or None.
          rope: `self.rope_tables(positions_bt, max_position)` if the caller has them
            already (the sampler looks them up in the cache's constant tables at each
            step); computed here otherwise.

        Returns:
          `(hidden_btd, new_cache)`; `new_cache` is None when `cache` is None.
        """
        cfg, rules = self.config, self.rules
        input_mask_bt, positions_bt, max_position = _checked_inputs(
            tokens_bt, positions_bt, input_mask_bt
        )
        if cache is None:
            mask_bts = _causal_mask(input_mask_bt)
            cache_index, layer_caches, key_mask = None, (None,) * cfg.num_layers, None
        else:
            cache_index = cache["index"]
            mask_bts, key_mask = _cached_mask(cache, input_mask_bt)
            layer_caches = cache["layers"]

        embedding = self.embedding_vd[...].astype(cfg.compute_dtype)
        x_btd = constrain(jnp.take(embedding, tokens_bt, axis=0), rules.act_btd)

        run = operator.call
        if cfg.remat != "none" and cache is None:  # Decoding has no backward pass.
            run = _rematerialized(cfg.remat)
        if rope is None:
            rope = self.rope_tables(positions_bt, max_position)  # Shared by every layer.
        new_layer_caches = []
        for layer, layer_cache in zip(self.layers, layer_caches, strict=True):
            x_btd, new_layer_cache = run(layer, x_btd, rope, mask_bts, layer_cache, cache_index)
            new_layer_caches.append(new_layer_cache)
        x_btd = self.final_norm(x_btd)
        if cache is None:
            return x_btd, None
        index = cache_index + tokens_bt.shape[1]
        return x_btd, {"index": index, "key_mask": key_mask, "layers": tuple(new_layer_caches)}

    def rope_tables(
        self, positions_bt: jax.Array, max_position: int | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """`(cos, sin)` [B, T, 1, H/2] of the rotary angles at `positions_bt`.

        With `max_position`, looked up in constant tables (positions must lie in
        `[0, max_position)`); see `gac_jax.models.layers.rope_tables`.
        """
        cfg = self.config
        inv_freq = rope_inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        return rope_tables(positions_bt, inv_freq, max_position)

    def output_head(self) -> tuple[jax.Array, str]:
        """`(weights, layout)` of the output projection: the lm_head [D, V], "dv", or the
        tied embeddings as stored, [V, D], "vd" (transposing them would copy them)."""
        if self.lm_head_dv is None:
            return self.embedding_vd[...], "vd"
        return self.lm_head_dv[...], "dv"

    def logits(self, hidden_btd: jax.Array) -> jax.Array:
        """Output logits [B, T, V] in float32 from hidden states [B, T, D]."""
        weights, layout = self.output_head()
        dtype = self.config.compute_dtype
        return head_logits(hidden_btd, weights, layout, dtype, self.rules.act_btv)

    def __call__(
        self,
        tokens_bt: jax.Array,
        positions_bt: jax.Array | None = None,
        input_mask_bt: jax.Array | None = None,
        cache: Cache | None = None,
    ) -> tuple[jax.Array, Cache | None]:
        """Logits [B, T, V] (float32) and the new cache; see `hidden_states` for args."""
        hidden_btd, new_cache = self.hidden_states(tokens_bt, positions_bt, input_mask_bt, cache)
        return self.logits(hidden_btd), new_cache


def create_model(config: ModelConfig, *, seed: int = 0, rules: ShardingRules | None = None):
    """A randomly initialised `Decoder` on the default device (for a mesh, use
    `gac_jax.models.create_sharded`)."""
    return Decoder(config, rules, rngs=nnx.Rngs(params=seed))
