r"""Teacher-forced token log-probabilities for the learner.

Convention (shared with `gac_jax.models.sampler`): for tokens [B, T] and mask [B, T],
entry `t` of the result is

.. math::

    \log p_\theta(x_t \mid x_{<t}) = z_{t-1}[x_t] - \operatorname{logsumexp}(z_{t-1})

where `z_{t-1}` are the logits after the real tokens up to position `t-1`, divided by the
temperature. Entry 0 has no context and is 0; so is every entry whose token or whose
predecessor is masked (padding, or the first real token of a left-padded row).

`token_logps_from_logits` applies it to logits [B, T, V] (the dense reference);
`per_token_logps` and `token_logps_and_entropy` score a model without materialising them
(`gac_jax.models.chunked_logprobs`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gac_jax.models.chunked_logprobs import chunked_token_logps_and_entropy

DEFAULT_CHUNK_SIZE = 512


def logps_of_tokens(logits_bv: jax.Array, tokens_b: jax.Array) -> jax.Array:
    """`log_softmax(logits)[token]` [...] in float32 for logits [..., V] and int ids [...],
    without materialising the softmax."""
    logits = logits_bv.astype(jnp.float32)
    picked = jnp.take_along_axis(logits, tokens_b[..., None].astype(jnp.int32), axis=-1)
    return picked[..., 0] - jax.nn.logsumexp(logits, axis=-1)


def token_logps_from_logits(
    logits_btv: jax.Array, tokens_bt: jax.Array, mask_bt: jax.Array, temperature=1.0
) -> jax.Array:
    """Shifted per-token log-probabilities, float32 [B, T] (the module docstring's
    convention), from the logits [B, T, V] of a forward pass over `tokens_bt` [B, T];
    `mask_bt` is True for real tokens, `temperature` a positive scalar."""
    b, t = tokens_bt.shape
    if logits_btv.shape[:2] != (b, t):
        raise ValueError(
            f"logits shape {logits_btv.shape} does not start with tokens shape {(b, t)}."
        )
    if mask_bt.shape != (b, t):
        raise ValueError(f"mask shape {mask_bt.shape} != tokens shape {(b, t)}.")
    scaled = logits_btv[:, :-1].astype(jnp.float32) / jnp.asarray(temperature, jnp.float32)
    logps = logps_of_tokens(scaled, tokens_bt[:, 1:])
    mask = mask_bt.astype(bool)
    valid = mask[:, 1:] & mask[:, :-1]
    logps = jnp.where(valid, logps, 0.0)
    return jnp.concatenate([jnp.zeros((b, 1), jnp.float32), logps], axis=1)


def token_logps_and_entropy(
    model, tokens_bt: jax.Array, mask_bt: jax.Array, *, chunk_size: int, temperature=1.0
) -> tuple[jax.Array, jax.Array]:
    """Teacher-forced log-probs [B, T] and the entropy of each predicted token [B, T].

    The logits are computed, reduced and dropped `chunk_size` positions at a time, in the
    forward and the backward pass (`chunked_token_logps_and_entropy`), so no [B, T, V]
    array exists. Differentiable in the model's parameters (both outputs).

    `model` is a `gac_jax.models.Decoder` (call inside `jax.jit`, e.g. after `nnx.merge`);
    positions come from `mask_bt` (True for real tokens). Returns `(logp_bt, entropy_bt)`,
    float32; entry 0 of both is 0, and so is every log-prob whose token or predecessor is
    masked (entropies are not masked).
    """
    mask_bt = jnp.asarray(mask_bt).astype(bool)
    hidden_btd, _ = model.hidden_states(tokens_bt, None, mask_bt)
    weights, layout = model.output_head()
    return chunked_token_logps_and_entropy(
        hidden_btd,
        weights,
        tokens_bt,
        mask_bt,
        chunk_size=chunk_size,
        head_layout=layout,
        temperature=temperature,
        compute_dtype=model.config.compute_dtype,
        logits_spec=model.rules.act_btv,
    )


def per_token_logps(
    model,
    tokens_bt: jax.Array,
    mask_bt: jax.Array,
    *,
    temperature=1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
):
    """Teacher-forced `log p(tokens[t] | tokens[<t])` [B, T] under `model`.

    Positions count from each row's first real token, so prompt + completion rows laid
    out as the sampler returns them (left-padded prompt, then completion) reproduce the
    sampler's `policy_logps` (temperature 1). Differentiable in the model's parameters.

    Args and returns: as `token_logps_and_entropy` (its log-probs only).
    """
    logp_bt, _ = token_logps_and_entropy(
        model, tokens_bt, mask_bt, chunk_size=chunk_size, temperature=temperature
    )
    return logp_bt
