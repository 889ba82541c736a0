r"""Per-token log-probabilities and entropies without the [B, T, V] logits.

The next token's log-probability and the predicted distribution's entropy are reductions
over the vocabulary, so positions are cut into chunks of at most `chunk_size` and a
`jax.lax.scan` computes each chunk's logits [B, C, V], reduces them and drops them. A
`jax.custom_vjp` recomputes them chunk by chunk in the backward pass, so both passes hold
O(B x chunk x V) float32 logits instead of O(B x T x V); kept between the passes are the
chunked hidden states [B, T, D] and one log-normaliser per position. The backward
accumulates the head weights' gradient in float32 and returns the temperature's too.

Chunks run along the sequence, not the batch: the batch is already cut by micro-batching
and sharded over the data axes, and long completions make T, not B, the factor that
grows; a chunk of positions bounds the memory even for a single row.

With :math:`s = h W / \tau` the scaled logits of one position, :math:`p = \mathrm{softmax}(s)`,
:math:`\ell = s - \operatorname{logsumexp}(s)` and target token :math:`y`:

.. math::

    \log p(y) = \ell_y, \qquad H = -\sum_v p_v \ell_v,

    \frac{\partial \log p(y)}{\partial s} = e_y - p, \qquad
    \frac{\partial H}{\partial s} = -p \odot (\ell + H).

The shift and mask convention is that of `gac_jax.models.scoring`: entry `t` scores token
`t` from the hidden state at `t - 1`; entry 0 is 0, and so is every log-prob whose token or
predecessor is masked. Entropies are not masked (entry 0 is 0), as the learner reports them.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from gac_jax._validation import check_int
from gac_jax.models.sharding import constrain

HEAD_LAYOUTS = ("dv", "vd")


class _Head(NamedTuple):
    """Static description of the output projection (hashable: a `custom_vjp` nondiff arg)."""

    layout: str  # "dv": weights [D, V] (an lm_head); "vd": [V, D] (tied embeddings).
    dtype: jnp.dtype  # Compute dtype of the matmuls; softmax statistics are float32.
    logits_spec: PartitionSpec | None  # Sharding constraint of a chunk's logits [B, C, V].


def head_logits(
    hidden: jax.Array, weights: jax.Array, layout: str, dtype, logits_spec=None
) -> jax.Array:
    """float32 logits [..., V] of hidden states [..., D] under the output projection
    `weights` (`layout` as `head_layout` below), both cast to `dtype`: one 2-D matmul over
    all positions (see `layers.dense` for why not an einsum), then `logits_spec`'s
    sharding constraint, if any."""
    *lead, d = hidden.shape
    x_rd = jnp.reshape(hidden.astype(dtype), (-1, d))
    contract = (((1,), (1,)) if layout == "vd" else ((1,), (0,)), ((), ()))
    z_rv = jax.lax.dot_general(
        x_rd, weights.astype(dtype), contract, preferred_element_type=jnp.float32
    )
    z = jnp.reshape(z_rv, (*lead, z_rv.shape[-1]))
    return z if logits_spec is None else constrain(z, logits_spec)


def _statistics(head: _Head, h_bcd, w, y_bc, tau):
    """`(logp, entropy, lse)` [B, C] of one chunk, float32."""
    s = head_logits(h_bcd, w, *head) / tau
    lse = jax.nn.logsumexp(s, axis=-1)
    log_probs = s - lse[..., None]
    entropy = -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)
    logp = jnp.take_along_axis(log_probs, y_bc[..., None], axis=-1)[..., 0]
    return logp, entropy, lse


def _scan_forward(head: _Head, h_nbcd, w, y_nbc, tau):
    """Per-chunk `(logp, entropy, lse)`, each [N, B, C] float32."""
    w = w.astype(head.dtype)

    def body(_, xs):
        h_bcd, y_bc = xs
        return None, _statistics(head, h_bcd, w, y_bc, tau)

    _, out = jax.lax.scan(body, None, (h_nbcd, y_nbc))
    return out


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _logps_and_entropy(head: _Head, h_nbcd, w, y_nbc, tau):
    logp, entropy, _ = _scan_forward(head, h_nbcd, w, y_nbc, tau)
    return logp, entropy


def _fwd(head, h_nbcd, w, y_nbc, tau):
    logp, entropy, lse = _scan_forward(head, h_nbcd, w, y_nbc, tau)
    return (logp, entropy), (h_nbcd, w, y_nbc, tau, lse, entropy)


def _bwd(head, residuals, cotangents):
    h_nbcd, w, y_nbc, tau, lse_nbc, entropy_nbc = residuals
    g_logp_nbc, g_entropy_nbc = cotangents
    w_c = w.astype(head.dtype)
    b, c, d = h_nbcd.shape[1:]
    # [R, V] x [V, D] or [R, V] x [D, V] -> [R, D]; [R, D] x [R, V] -> weights' layout.
    back_h = (((1,), (0,)) if head.layout == "vd" else ((1,), (1,)), ((), ()))

    def body(carry, xs):
        g_w, g_tau = carry
        h_bcd, y_bc, lse, entropy, g_logp, g_entropy = xs
        log_probs = head_logits(h_bcd, w_c, *head) / tau - lse[..., None]
        p = jnp.exp(log_probs)
        one_hot = jax.nn.one_hot(y_bc, p.shape[-1], dtype=jnp.float32)
        g_s = g_logp[..., None] * (one_hot - p) - g_entropy[..., None] * p * (
            log_probs + entropy[..., None]
        )
        # d s / d tau = -s / tau, with s = log_probs + lse.
        g_tau = g_tau - jnp.sum(g_s * (log_probs + lse[..., None])) / tau
        g_z_rv = jnp.reshape(g_s / tau, (b * c, -1)).astype(head.dtype)
        x_rd = jnp.reshape(h_bcd.astype(head.dtype), (b * c, d))
        g_h = jax.lax.dot_general(g_z_rv, w_c, back_h, preferred_element_type=jnp.float32)
        pair = (g_z_rv, x_rd) if head.layout == "vd" else (x_rd, g_z_rv)
        g_w_chunk = jax.lax.dot_general(
            *pair, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )
        g_h_bcd = jnp.reshape(g_h, (b, c, d)).astype(h_bcd.dtype)
        return (g_w + g_w_chunk, g_tau), g_h_bcd

    init = (jnp.zeros(w.shape, jnp.float32), jnp.zeros((), jnp.float32))
    xs = (h_nbcd, y_nbc, lse_nbc, entropy_nbc, g_logp_nbc, g_entropy_nbc)
    (g_w, g_tau), g_h_nbcd = jax.lax.scan(body, init, xs)
    return g_h_nbcd, g_w.astype(w.dtype), None, g_tau.astype(tau.dtype)


_logps_and_entropy.defvjp(_fwd, _bwd)


def _check(hidden_btd, head_weights, tokens_bt, mask_bt, chunk_size, head_layout) -> None:
    """Raises ValueError naming a bad argument."""
    check_int("chunk_size", chunk_size, 1)
    if head_layout not in HEAD_LAYOUTS:
        raise ValueError(f"head_layout={head_layout!r} must be one of {HEAD_LAYOUTS}.")
    if hidden_btd.ndim != 3 or head_weights.ndim != 2:
        raise ValueError(
            f"hidden must be [B, T, D] and head weights 2-D; got shapes {hidden_btd.shape} "
            f"and {head_weights.shape}."
        )
    b, t, d = hidden_btd.shape
    for name, x in (("tokens", tokens_bt), ("mask", mask_bt)):
        if x.shape != (b, t):
            raise ValueError(f"{name} shape {x.shape} != hidden's leading shape {(b, t)}.")
    d_axis = 1 if head_layout == "vd" else 0
    if head_weights.shape[d_axis] != d:
        raise ValueError(
            f"head weights {head_weights.shape} (layout {head_layout!r}) do not contract "
            f"with hidden width {d}."
        )


def chunked_token_logps_and_entropy(
    hidden_btd: jax.Array,
    head_weights: jax.Array,
    tokens_bt: jax.Array,
    mask_bt: jax.Array,
    *,
    chunk_size: int,
    head_layout: str = "dv",
    temperature=1.0,
    compute_dtype=None,
    logits_spec: PartitionSpec | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Shifted per-token log-probs [B, T] and entropies [B, T] of `softmax(h W / temperature)`.

    Equal to `token_logps_from_logits(logits, tokens, mask, temperature)` and the entropy of
    `log_softmax(logits / temperature)` for `logits = hidden @ W` (float32 accumulation),
    but no more than one chunk's logits [B, C, V] exist at a time, forward or backward.
    Differentiable in `hidden_btd`, `head_weights` and `temperature` (both outputs);
    entry 0 of both is 0, and so is every log-prob whose token or predecessor is masked.

    Args:
      head_weights: the output projection: [D, V] for `head_layout="dv"` (an lm_head), or
        [V, D] for `"vd"` (tied input embeddings, used without a transpose).
      chunk_size: at most this many positions per chunk. The T - 1 predicting positions are
        cut into `ceil((T - 1) / chunk_size)` chunks of equal size, padded at the end by
        fewer positions than there are chunks; a chunk_size >= T - 1 gives one chunk.
      temperature: positive scalar (may be traced).
      compute_dtype: dtype both matmul operands are cast to (the model's compute dtype);
        the hidden states' dtype by default. Softmax statistics are always float32.
      logits_spec: sharding constraint of a chunk's logits [B, C, V] under a mesh.
    """
    _check(hidden_btd, head_weights, tokens_bt, mask_bt, chunk_size, head_layout)
    b, t, d = hidden_btd.shape
    if t < 2:
        return jnp.zeros((b, t), jnp.float32), jnp.zeros((b, t), jnp.float32)
    dtype = hidden_btd.dtype if compute_dtype is None else jnp.dtype(compute_dtype)
    head = _Head(head_layout, jnp.dtype(dtype), logits_spec)
    positions = t - 1
    n = math.ceil(positions / chunk_size)
    c = math.ceil(positions / n)
    pad = n * c - positions
    h = jnp.pad(hidden_btd[:, :-1], ((0, 0), (0, pad), (0, 0)))
    y = jnp.pad(tokens_bt[:, 1:].astype(jnp.int32), ((0, 0), (0, pad)))
    h_nbcd = jnp.swapaxes(jnp.reshape(h, (b, n, c, d)), 0, 1)
    y_nbc = jnp.swapaxes(jnp.reshape(y, (b, n, c)), 0, 1)
    tau = jnp.asarray(temperature, jnp.float32)
    logp_nbc, entropy_nbc = _logps_and_entropy(head, h_nbcd, head_weights, y_nbc, tau)

    def unchunk(x_nbc):
        x = jnp.reshape(jnp.swapaxes(x_nbc, 0, 1), (b, n * c))[:, :positions]
        return jnp.concatenate([jnp.zeros((b, 1), jnp.float32), x], axis=1)

    mask = mask_bt.astype(bool)
    valid = jnp.concatenate([jnp.zeros((b, 1), bool), mask[:, 1:] & mask[:, :-1]], axis=1)
    return jnp.where(valid, unchunk(logp_nbc), 0.0), unchunk(entropy_nbc)
