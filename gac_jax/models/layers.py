"""Decoder building blocks: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU.

Parameters are stored in `config.param_dtype` and cast to `config.dtype` for compute;
norms, softmaxes and rotary angles are computed in float32. Every parameter is annotated
with the logical names of its dimensions (see `gac_jax.models.sharding`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gac_jax._validation import check_int
from gac_jax.models.config import ModelConfig, RopeScaling
from gac_jax.models.sharding import ShardingRules, constrain

# A finite "minus infinity" for masked attention scores: a query whose keys are all masked
# (a left-padding position) then gets a uniform, finite distribution instead of NaN.
_MASKED_SCORE = float(np.finfo(np.float32).min)


def param(rngs: nnx.Rngs, shape, logical_axes, dtype, stddev: float | None) -> nnx.Param:
    """A weight of `shape` named by `logical_axes`: normal(0, stddev), or ones if None."""
    if stddev is None:
        value = jnp.ones(shape, dtype)
    else:
        value = (stddev * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    # Sharding is applied explicitly (gac_jax.models.sharding), not when the variable is
    # created, so a model can be built without a mesh.
    return nnx.Param(value, out_sharding=tuple(logical_axes), eager_sharding=False)


class RMSNorm(nnx.Module):
    """Root-mean-square norm over the last axis, `x / rms(x) * scale`, as in HF Llama/Qwen3.

    The normalisation runs in float32; the result is cast back to the input dtype before
    the scale is applied (the order HF uses, which matters in bfloat16).
    """

    def __init__(self, dim: int, *, eps: float, param_dtype, rngs: nnx.Rngs):
        self.eps = eps
        self.scale = param(rngs, (dim,), ("norm",), param_dtype, None)

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        variance = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
        normed = (x32 * jax.lax.rsqrt(variance + self.eps)).astype(x.dtype)
        scale = self.scale[...].astype(x.dtype)
        return normed * jnp.reshape(scale, (1,) * (x.ndim - 1) + scale.shape)


def dense(x: jax.Array, w: jax.Array, num_contracted: int = 1) -> jax.Array:
    """Contracts the last `num_contracted` axes of `x` with the first ones of `w`.

    Computed as one 2-D matmul `[rows, in] @ [in, out]` between reshapes, which is the
    einsum `"...I,IO->...O"` but lowers better: XLA:CPU turns the weight gradient of an
    einsum with two free activation axes (B, T) into a dot that first writes the
    activation gradient transposed ([F, B*T]), an extra, slow pass over memory for every
    projection; with one row axis it multiplies in place. Reshapes that merge a sharded
    leading axis with unsharded trailing ones keep their sharding under GSPMD.

    `x` [..., *in_shape] and `w` [*in_shape, *out_shape] (`num_contracted` axes in
    `in_shape`) are in the compute dtype; the result is [..., *out_shape].
    """
    lead = x.shape[: x.ndim - num_contracted]
    in_size = math.prod(x.shape[x.ndim - num_contracted :])
    out_shape = w.shape[num_contracted:]
    y = jnp.dot(jnp.reshape(x, (-1, in_size)), jnp.reshape(w, (in_size, -1)))
    return jnp.reshape(y, (*lead, *out_shape))


def rope_inverse_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None = None
) -> np.ndarray:
    """Rotary inverse frequencies [H/2] (float32): `theta ** (-2i / head_dim)` for i in
    [0, head_dim / 2), rescaled by Llama 3 `scaling` (HF `rope_type: "llama3"`) if given.
    """
    exponents = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
    inv_freq = 1.0 / np.power(float(theta), exponents)
    if scaling is not None:
        old_context = scaling.original_max_position_embeddings
        low_freq_wavelen = old_context / scaling.low_freq_factor
        high_freq_wavelen = old_context / scaling.high_freq_factor
        wavelen = 2.0 * math.pi / inv_freq
        smooth = (old_context / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        interpolated = (1.0 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
        inv_freq = np.where(
            wavelen > low_freq_wavelen,
            inv_freq / scaling.factor,
            np.where(wavelen < high_freq_wavelen, inv_freq, interpolated),
        )
    return inv_freq.astype(np.float32)


def rope_tables(
    positions_bt: jax.Array, inv_freq_h: np.ndarray, max_position: int | None = None
) -> tuple[jax.Array, jax.Array]:
    """`(cos, sin)` of the rotary angles, float32 [B, T, 1, H/2] each.

    Every layer rotates by the same angles, so the decoder takes them once per call (or
    from its caller, as the sampler's decode step passes them).

    With `max_position`, the tables are looked up in constant tables for positions
    `[0, max_position)` (positions outside are clipped into it), computed once with NumPy
    at trace time. Otherwise they are evaluated in the program, and XLA fuses them into
    every rotation (again per head, layer and backward pass: about a tenth of a small
    model's CPU train step). The decoder looks them up whenever it derives the positions
    from the mask (they are then below the sequence length).
    """
    check_int("max_position", max_position, 1, allow_none=True)
    if max_position is not None:
        inv_freq = np.asarray(inv_freq_h, np.float32)  # Concrete: the tables are constants.
        # float32 angles as the evaluated path (and HF) computes them; cos and sin in
        # float64, rounded once.
        angles_ph = np.arange(max_position, dtype=np.float32)[:, None] * inv_freq[None, :]
        index_bt = jnp.clip(positions_bt.astype(jnp.int32), 0, max_position - 1)
        cos, sin = (
            jnp.take(jnp.asarray(f(angles_ph.astype(np.float64)), jnp.float32), index_bt, axis=0)
            for f in (np.cos, np.sin)
        )
        return cos[:, :, None, :], sin[:, :, None, :]
    inv_freq = jnp.asarray(inv_freq_h, jnp.float32)
    angles_bth = positions_bt.astype(jnp.float32)[:, :, None] * inv_freq[None, None, :]
    return jnp.cos(angles_bth)[:, :, None, :], jnp.sin(angles_bth)[:, :, None, :]


def rotate(x_btnh: jax.Array, rope: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Rotates `x` [B, T, N, H] by `rope = rope_tables(...)`, HF's "rotate half" layout (not
    interleaved pairs)."""
    cos, sin = rope
    half = x_btnh.shape[-1] // 2
    x32 = x_btnh.astype(jnp.float32)
    x1, x2 = x32[..., :half], x32[..., half:]
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x_btnh.dtype)


class Attention(nnx.Module):
    """Grouped-query self-attention with rotary embeddings, optional q/k norm and KV cache."""

    def __init__(self, config: ModelConfig, rules: ShardingRules, *, rngs: nnx.Rngs):
        self.config = config
        self.rules = rules
        d, n, k, h = config.embed_dim, config.num_heads, config.num_kv_heads, config.head_dim
        pdt = config.parameter_dtype
        self.q_dnh = param(rngs, (d, n, h), ("embed", "heads", "head_dim"), pdt, 0.02)
        self.k_dkh = param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), pdt, 0.02)
        self.v_dkh = param(rngs, (d, k, h), ("embed", "kv_heads", "head_dim"), pdt, 0.02)
        self.o_nhd = param(rngs, (n, h, d), ("heads", "head_dim", "embed"), pdt, 0.02)
        if config.qk_norm:
            self.q_norm = RMSNorm(h, eps=config.rms_norm_eps, param_dtype=pdt, rngs=rngs)
            self.k_norm = RMSNorm(h, eps=config.rms_norm_eps, param_dtype=pdt, rngs=rngs)
        else:
            self.q_norm = None
            self.k_norm = None

    def __call__(
        self,
        x_btd: jax.Array,
        rope: tuple[jax.Array, jax.Array],
        mask_bts: jax.Array,
        cache: dict[str, jax.Array] | None = None,
        cache_index: jax.Array | None = None,
        layer: jax.Array | int = 0,
    ) -> tuple[jax.Array, dict[str, jax.Array] | None]:
        """Attends from the T new tokens of the normalised stream `x_btd` [B, T, D] (their
        `rope_tables`) to the S visible keys; returns `(out_btd, new_cache)`.

        `mask_bts`: bool [B, T, S], True where query t may attend to key s (S = T without
        a cache, else the cache length). `cache`: the decoder's stacked caches
        `{"k": [L, B, K, H, S], "v": [L, B, K, S, H]}` (this layer's at index `layer`) or
        None, then `new_cache` (all layers) is None too. `cache_index`: int32 [] slot where
        the new keys are written, or [B], one slot per row.
        """
        cfg, rules = self.config, self.rules
        dtype = cfg.compute_dtype
        b, t, _ = x_btd.shape
        q_btnh, k_btkh, v_btkh = self._project_qkv(x_btd, rope)

        kv, g, h = cfg.num_kv_heads, cfg.group_size, cfg.head_dim
        q_btkgh = jnp.reshape(q_btnh, (b, t, kv, g, h))
        if cache is not None:
            new_cache = _write_kv_cache(cache, layer, cache_index, k_btkh, v_btkh, rules)
            k_bkhs = jax.lax.dynamic_index_in_dim(new_cache["k"], layer, keepdims=False)
            scores = _cached_scores(q_btkgh, k_bkhs, dtype)
        else:
            new_cache = None
            scores = jnp.einsum(
                "BTKGH,BSKH->BKGTS", q_btkgh, k_btkh, preferred_element_type=jnp.float32
            )
        probs = _attention_probs(scores, mask_bts, h, dtype)
        if new_cache is not None:
            v_bksh = jax.lax.dynamic_index_in_dim(new_cache["v"], layer, keepdims=False)
            out_btkgh = _cached_values(probs, v_bksh, dtype)
        else:
            out_btkgh = jnp.einsum("BKGTS,BSKH->BTKGH", probs, v_btkh)
        out_btnh = constrain(jnp.reshape(out_btkgh, (b, t, kv * g, h)), rules.act_btnh)
        out_btd = dense(out_btnh, self.o_nhd[...].astype(dtype), num_contracted=2)
        return constrain(out_btd, rules.act_btd), new_cache

    def _project_qkv(
        self, x_btd: jax.Array, rope: tuple[jax.Array, jax.Array]
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Queries [B, T, N, H] and keys [B, T, K, H] (normed if so configured, rotated),
        and values [B, T, K, H], all constrained to their activation shardings."""
        cfg, rules = self.config, self.rules
        dtype = cfg.compute_dtype
        q_btnh = dense(x_btd, self.q_dnh[...].astype(dtype))
        k_btkh = dense(x_btd, self.k_dkh[...].astype(dtype))
        v_btkh = dense(x_btd, self.v_dkh[...].astype(dtype))
        if self.q_norm is not None:
            q_btnh = self.q_norm(q_btnh)
            k_btkh = self.k_norm(k_btkh)
        q_btnh = constrain(rotate(q_btnh, rope), rules.act_btnh)
        k_btkh = constrain(rotate(k_btkh, rope), rules.act_btkh)
        v_btkh = constrain(v_btkh, rules.act_btkh)
        return q_btnh, k_btkh, v_btkh


def _write_kv_cache(
    cache: dict[str, jax.Array],
    layer: jax.Array | int,
    cache_index: jax.Array,
    k_btkh: jax.Array,
    v_btkh: jax.Array,
    rules: ShardingRules,
) -> dict[str, jax.Array]:
    """The stacked caches with layer `layer`'s T new keys and values written in place at
    slot `cache_index` (int32 [], or [B]: each row at its own slot).

    The cache keeps keys as [L, B, K, H, S] and values as [L, B, K, S, H]: the layouts in
    which both attention products are plain batched matmuls over (B, K), so a decode step
    reads a layer's cache once instead of first copying it transposed.
    """
    index = cache_index.astype(jnp.int32)
    k_new, v_new = k_btkh.astype(cache["k"].dtype), v_btkh.astype(cache["v"].dtype)
    if index.ndim == 1:
        b, t = k_btkh.shape[:2]
        rows_b1 = jnp.arange(b, dtype=jnp.int32)[:, None]
        slots_bt = index[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        # Advanced indices split by slices put their [B, T] shape first: [B, T, K, H].
        k_lbkhs = cache["k"].at[layer, rows_b1, :, :, slots_bt].set(k_new)
        v_lbksh = cache["v"].at[layer, rows_b1, :, slots_bt, :].set(v_new)
    else:
        zero = jnp.zeros((), jnp.int32)
        k_lbkhs = jax.lax.dynamic_update_slice(
            cache["k"], jnp.transpose(k_new, (0, 2, 3, 1))[None], (layer, zero, zero, zero, index)
        )
        v_lbksh = jax.lax.dynamic_update_slice(
            cache["v"], jnp.transpose(v_new, (0, 2, 1, 3))[None], (layer, zero, zero, index, zero)
        )
    k_lbkhs = constrain(k_lbkhs, rules.spec("layers", "batch", "kv_heads", "head_dim", "sequence"))
    v_lbksh = constrain(v_lbksh, rules.spec("layers", "batch", "kv_heads", "sequence", "head_dim"))
    return {"k": k_lbkhs, "v": v_lbksh}


def _cached_scores(q_btkgh: jax.Array, k_bkhs: jax.Array, dtype) -> jax.Array:
    """Attention scores [B, K, G, T, S] (float32) of the queries against cached keys."""
    b, t, kv, g, h = q_btkgh.shape
    # [B, K, G*T, H] @ [B, K, H, S]: rows of queries times the key columns.
    q_bkrh = jnp.reshape(jnp.transpose(q_btkgh, (0, 2, 3, 1, 4)), (b, kv, g * t, h))
    scores = jax.lax.dot_general(
        q_bkrh,
        k_bkhs.astype(dtype),
        (((3,), (2,)), ((0, 1), (0, 1))),
        preferred_element_type=jnp.float32,
    )
    return jnp.reshape(scores, (b, kv, g, t, -1))


def _attention_probs(scores: jax.Array, mask_bts: jax.Array, head_dim: int, dtype) -> jax.Array:
    """Softmax over the keys of the scaled scores [B, K, G, T, S], masked keys excluded."""
    scores = scores * (head_dim**-0.5)
    scores = jnp.where(mask_bts[:, None, None, :, :], scores, _MASKED_SCORE)
    return jax.nn.softmax(scores, axis=-1).astype(dtype)


def _cached_values(probs: jax.Array, v_bksh: jax.Array, dtype) -> jax.Array:
    """The attention output [B, T, K, G, H] from probabilities over the cached values."""
    b, kv, g, t, _ = probs.shape
    h = v_bksh.shape[-1]
    # [B, K, G*T, S] @ [B, K, S, H].
    out_bkrh = jax.lax.dot_general(
        jnp.reshape(probs, (b, kv, g * t, -1)),
        v_bksh.astype(dtype),
        (((3,), (2,)), ((0, 1), (0, 1))),
    )
    return jnp.transpose(jnp.reshape(out_bkrh, (b, kv, g, t, h)), (0, 3, 1, 2, 4))


class MLP(nnx.Module):
    """SwiGLU feed-forward: `down(silu(gate(x)) * up(x))`."""

    def __init__(self, config: ModelConfig, rules: ShardingRules, *, rngs: nnx.Rngs):
        self.config = config
        self.rules = rules
        d, f, pdt = config.embed_dim, config.mlp_dim, config.parameter_dtype
        self.gate_df = param(rngs, (d, f), ("embed", "mlp"), pdt, 0.02)
        self.up_df = param(rngs, (d, f), ("embed", "mlp"), pdt, 0.02)
        self.down_fd = param(rngs, (f, d), ("mlp", "embed"), pdt, 0.02)

    def __call__(self, x_btd: jax.Array) -> jax.Array:
        """[B, T, D] -> [B, T, D]."""
        dtype = self.config.compute_dtype
        gate_btf = dense(x_btd, self.gate_df[...].astype(dtype))
        up_btf = dense(x_btd, self.up_df[...].astype(dtype))
        hidden_btf = constrain(jax.nn.silu(gate_btf) * up_btf, self.rules.act_btf)
        out_btd = dense(hidden_btf, self.down_fd[...].astype(dtype))
        return constrain(out_btd, self.rules.act_btd)


class DecoderLayer(nnx.Module):
    """Pre-norm block: `x + attn(norm(x))`, then `x + mlp(norm(x))`."""

    def __init__(self, config: ModelConfig, rules: ShardingRules, *, rngs: nnx.Rngs):
        eps, pdt = config.rms_norm_eps, config.parameter_dtype
        self.attn_norm = RMSNorm(config.embed_dim, eps=eps, param_dtype=pdt, rngs=rngs)
        self.attn = Attention(config, rules, rngs=rngs)
        self.mlp_norm = RMSNorm(config.embed_dim, eps=eps, param_dtype=pdt, rngs=rngs)
        self.mlp = MLP(config, rules, rngs=rngs)

    def __call__(self, x_btd, rope, mask_bts, cache=None, cache_index=None, layer=0):
        """See `Attention.__call__`; returns `(x_btd, new_cache)`."""
        normed_btd = self.attn_norm(x_btd)
        attn_out, new_cache = self.attn(normed_btd, rope, mask_bts, cache, cache_index, layer)
        x_btd = x_btd + attn_out
        x_btd = x_btd + self.mlp(self.mlp_norm(x_btd))
        return x_btd, new_cache
