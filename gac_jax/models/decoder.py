"""The decoder-only transformer (Qwen3 and Llama 3 families) in Flax NNX.

Inputs follow Hugging Face semantics for padded batches: `input_mask` marks real tokens,
and positions count from each row's first real token (`positions_from_mask`), so a
left-padded prompt is encoded exactly as the unpadded one.

The layers are one `DecoderLayer` whose parameters are stacked on a leading axis of
`num_layers` (logical axis "layers", never sharded), run by `jax.lax.scan` as MaxText's
`scan_layers` and levanter's stacked blocks run theirs: a program traces and compiles one
layer, so its compile time does not grow with depth (`ModelConfig.scan_layers=False`
unrolls the scan instead, as the tiny presets do: same parameters, same values). The
layers are built one by one and then stacked (`_stacked`), so they draw the random numbers
separate layers drew.
Parameters saved per layer (`layers/0/attn/q_dnh`, before the scan) are stacked as they
are read (`stack_layers`, in `gac_jax.train.checkpoint`'s restore).

The KV cache is a plain dict of arrays (`init_cache`), stacked like the parameters::

    {"index": int32 [] or [B],           # next slot to write (one for all rows, or per row)
     "key_mask": bool [B, S],            # slots holding real tokens
     "layers": {"k": [L, B, K, H, S], "v": [L, B, K, S, H]}}

With `scan_layers=False` "layers" is a tuple of L such caches of one layer each ([1, B, ...]):
XLA:CPU copies a slice of a stacked array, so a stacked cache (or stacked weights, cut
inside a decode loop) is copied at every step.

Keys are stored with the slot axis last and values with it second to last, so both
attention products of a decode step are batched matmuls that read the cache in place. The
scan carries the whole cache and each layer writes its new tokens into its own slice (a
cache passed as the scan's xs and ys would be copied whole at every call).

Every call with a cache writes its T tokens at `index` with `jax.lax.dynamic_update_slice`
and advances `index` by T. The caller keeps `index + T <= S`. A per-row `index` [B] (set
by the caller, e.g. `cache | {"index": index_b}`) writes each row at its own slot with a
scatter instead: rows of one batch then hold sequences of different lengths, as the
refilling sampler's decode slots do.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

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
from gac_jax.models.sharding import ShardingRules, constrain, logical_axes_of

Cache = dict


def positions_from_mask(mask_bt: jax.Array) -> jax.Array:
    """Positions [B, T] counting the real tokens (True or 1 in `mask_bt` [B, T]) from each
    row's first one (pads get 0)."""
    mask = mask_bt.astype(jnp.int32)
    return jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0).astype(jnp.int32)


def init_cache(config: ModelConfig, batch_size: int, max_length: int, dtype=None) -> Cache:
    """An empty KV cache for `batch_size` (B) rows of up to `max_length` (S: prompt plus
    generated) tokens, keys and values stored in `dtype` (`config.dtype` by default)."""
    for name, value in (("batch_size", batch_size), ("max_length", max_length)):
        check_int(name, value, 1)
    dtype = config.compute_dtype if dtype is None else jnp.dtype(dtype)
    k, h, n = config.num_kv_heads, config.head_dim, config.num_layers

    def kv(layers: int) -> dict[str, jax.Array]:
        shape = (layers, batch_size, k)  # Keys [.., h, S] (transposed), values [.., S, h].
        keys = jnp.zeros((*shape, h, max_length), dtype)
        return {"k": keys, "v": jnp.zeros((*shape, max_length, h), dtype)}

    return {
        "index": jnp.zeros((), jnp.int32),
        "key_mask": jnp.zeros((batch_size, max_length), bool),
        # Unrolled: one [1, ...] cache a layer (a stacked one's slices are copies on CPU).
        "layers": kv(n) if config.scan_layers else tuple(kv(1) for _ in range(n)),
    }


def map_rows(fn, cache: Cache) -> Cache:
    """`cache` (its `index` per row, [B]) with `fn(array, axis)` applied to each array,
    `axis` being the array's row axis: 1 in the layers' stacked keys and values, else 0."""
    return {
        name: jax.tree.map(lambda x, axis=int(name == "layers"): fn(x, axis), arrays)
        for name, arrays in cache.items()
    }


def _per_layer(layers) -> bool:
    return isinstance(layers, Mapping) and bool(layers) and all(str(k).isdigit() for k in layers)


def _map_layers(fn, tree):
    """`tree` with each mapping holding "layers" (a decoder's params) a dict whose "layers"
    entry is `fn` of it."""
    holds = lambda x: isinstance(x, Mapping) and "layers" in x  # noqa: E731
    return jax.tree.map(
        lambda x: {**x, "layers": fn(x["layers"])} if holds(x) else x, tree, is_leaf=holds
    )


def saved_per_layer(tree) -> bool:
    """Whether `tree` holds a decoder's params per layer, `{"layers": {"0": ..., "1": ...}}`,
    as checkpoints saved before the scan do."""
    found = []
    _map_layers(lambda layers: found.append(_per_layer(layers)), tree)
    return any(found)


def stack_layers(tree):
    """`tree` with each decoder's per-layer params stacked on a new leading axis, as the
    decoder holds them; `unstack_layers` undoes it."""

    def stack(layers):
        per_layer = [layers[key] for key in sorted(layers, key=int)] if _per_layer(layers) else []
        return jax.tree.map(lambda *xs: jnp.stack(xs), *per_layer) if per_layer else layers

    return _map_layers(stack, tree)


def unstack_layers(tree):
    """`tree` with each decoder's stacked layers split into `{0: ..., L - 1: ...}`; abstract
    leaves (`jax.ShapeDtypeStruct`) lose the leading axis and its (unsharded) spec entry."""

    def layer(x, i):
        if not isinstance(x, jax.ShapeDtypeStruct):
            return x[i]
        sharding = x.sharding
        if isinstance(sharding, NamedSharding):
            sharding = NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[1:]))
        return jax.ShapeDtypeStruct(x.shape[1:], x.dtype, sharding=sharding)

    def unstack(layers):
        count = 0 if _per_layer(layers) else jax.tree.leaves(layers)[0].shape[0]
        return {i: jax.tree.map(lambda x, i=i: layer(x, i), layers) for i in range(count)} or layers

    return _map_layers(unstack, tree)


def _stacked(layers: list[nnx.Module]) -> nnx.Module:
    """One module of `layers`' structure (all alike), each variable holding theirs stacked
    on a new leading axis, named "layers"."""
    graphdef, _ = nnx.split(layers[0])

    def stack(*variables):
        axes = ("layers", *logical_axes_of(variables[0]))
        return variables[0].replace(jnp.stack([v[...] for v in variables]), out_sharding=axes)

    states = [nnx.state(layer) for layer in layers]
    is_variable = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    return nnx.merge(graphdef, jax.tree.map(stack, *states, is_leaf=is_variable))


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
        """Builds a randomly initialised decoder (normal(0.02) weights, unit norm scales,
        drawn from `rngs.params`). `config` and `rules` (the activation constraints'
        logical-to-mesh rules, `ShardingRules()` by default, applied only under a mesh set
        with `jax.set_mesh`) are kept, static, as `self.config` and `self.rules`.
        """
        if not isinstance(config, ModelConfig):
            raise ValueError(f"config must be a ModelConfig, got {type(config).__name__}.")
        self.config = config
        self.rules = ShardingRules() if rules is None else rules
        pdt = config.parameter_dtype
        self.embedding_vd = param(
            rngs, (config.vocab_size, config.embed_dim), ("vocab", "embed"), pdt, 0.02
        )
        self.layers = _stacked(
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
        layers: tuple | None = None,
    ) -> tuple[jax.Array, Cache | None]:
        """`(hidden_btd, new_cache)`: the final-normed hidden states [B, T, D] (compute
        dtype) and the cache after this call (None without a `cache`, from `init_cache`
        or a previous call). With an unrolled config's cache (one a layer) the layers run
        one after the other, from `layers` (`layer_slices()`, cut once before a loop that
        calls this at every step) or from slices cut now.

        Args:
          positions_bt: rotary positions [B, T]; `positions_from_mask(input_mask_bt)` by
            default (pass them explicitly when decoding with a cache).
          input_mask_bt: bool [B, T], True for real tokens (never attended to otherwise);
            all True by default.
          rope: `self.rope_tables(positions_bt, max_position)` if the caller has them
            already (the sampler looks them up in constant tables); computed otherwise.
        """
        cfg, rules = self.config, self.rules
        input_mask_bt, positions_bt, max_position = _checked_inputs(
            tokens_bt, positions_bt, input_mask_bt
        )
        if cache is None:
            mask_bts = _causal_mask(input_mask_bt)
            cache_index, layer_caches, key_mask = None, None, None
        else:
            cache_index = cache["index"]
            mask_bts, key_mask = _cached_mask(cache, input_mask_bt)
            layer_caches = cache["layers"]

        embedding = self.embedding_vd[...].astype(cfg.compute_dtype)
        x_btd = constrain(jnp.take(embedding, tokens_bt, axis=0), rules.act_btd)

        if rope is None:
            rope = self.rope_tables(positions_bt, max_position)  # Shared by every layer.
        if isinstance(layer_caches, tuple):  # Unrolled decoding: one cache a layer.
            graphdef, per_layer = self.layer_slices() if layers is None else layers
            caches = ()
            for state, one in zip(per_layer, layer_caches, strict=True):
                x_btd, one = nnx.merge(graphdef, state)(x_btd, rope, mask_bts, one, cache_index)
                caches += (one,)
            return self._finished(x_btd, cache, tokens_bt.shape[1], key_mask, caches)
        graphdef, stacked = nnx.split(self.layers)

        def layer(carry, state):
            x_btd, caches, i = carry
            x_btd, caches = nnx.merge(graphdef, state)(
                x_btd, rope, mask_bts, caches, cache_index, i
            )
            return (x_btd, caches, i + 1), None

        if cfg.remat != "none" and cache is None:  # Decoding has no backward pass.
            # Not `nnx.remat`: it writes the state back into the layer's variables, which
            # fails when some come from another trace, as a LoRA run's frozen weights do.
            saveable = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
            policy = saveable if cfg.remat == "dots" else None  # "full": recompute all.
            layer = jax.checkpoint(layer, policy=policy, prevent_cse=False)
        carry = (x_btd, layer_caches, jnp.zeros((), jnp.int32))
        unroll = 1 if cfg.scan_layers else cfg.num_layers
        (x_btd, layer_caches, _), _ = jax.lax.scan(layer, carry, stacked, unroll=unroll)
        return self._finished(x_btd, cache, tokens_bt.shape[1], key_mask, layer_caches)

    def _finished(self, x_btd, cache, length, key_mask, layer_caches):
        """`hidden_states`' result: the final norm, and the cache advanced by `length`."""
        x_btd = self.final_norm(x_btd)
        if cache is None:
            return x_btd, None
        index = cache["index"] + length
        return x_btd, {"index": index, "key_mask": key_mask, "layers": layer_caches}

    def layer_slices(self) -> tuple:
        """`(graphdef, (state_0, ..., state_L-1))`: the layers' parameters cut per layer,
        for `hidden_states(layers=...)`. A decode loop cuts them once before it starts:
        cut inside, at every step, XLA:CPU copies every weight each step (the 10M canary
        model's greedy decode: 3.1 s of CPU against 2.2 s with the slices cut once)."""
        graphdef, stacked = nnx.split(self.layers)
        count = self.config.num_layers
        return graphdef, tuple(jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(count))

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
