"""LoRA adapters on the decoder's projections, their merge, and the policy a sampler runs.

`apply_lora` replaces each chosen projection weight ``W`` (an `nnx.Param` such as
``attn.q_dnh`` [D, N, H]) with a `LoraWeight`: ``W`` kept as is plus two
`nnx.LoRAParam` factors ``A`` [*in, r] and ``B`` [r, *out], read by the layer exactly as
the weight it replaces (``w[...]``)::

    W' = W + (alpha / r) * tensordot(A, B)

``B`` starts at zero, so the adapted model starts equal to the base. Training only the
`lora_filter` params (`gac_jax.learner.ShardedLearner`'s ``trainable``) keeps the
optimizer's, GAC's and ESS's state the adapters' size. `merge_lora` folds the deltas
back into a plain `Decoder` (what the sampler runs and `save_hf_checkpoint` writes).

Not qwix's `LoraProvider`: it finds weights by tracing ``jnp.dot`` operands back to an
``nnx.Param``, and the decoder multiplies reshaped, cast weights (`layers.dense`) with q,
k, v and o in one module, so qwix 0.1.8 created no adapters on it. The cost here is one
weight-sized delta per adapted projection and forward pass (not an ``x @ A @ B`` side
path), a small part of a step at the ranks and sizes LoRA is used with.

Reference: Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", 2021, eq. 3.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from gac_jax._validation import check_int
from gac_jax.models.sharding import abstract_with_shardings, logical_axes_of, state_shardings

# Projection names (as Hugging Face / PEFT name them) -> (submodule of a decoder layer,
# weight attribute, number of leading input axes of the weight). The only list of valid
# `LoraConfig.targets`.
PROJECTIONS = {
    "q_proj": ("attn", "q_dnh", 1),
    "k_proj": ("attn", "k_dkh", 1),
    "v_proj": ("attn", "v_dkh", 1),
    "o_proj": ("attn", "o_nhd", 2),
    "gate_proj": ("mlp", "gate_df", 1),
    "up_proj": ("mlp", "up_df", 1),
    "down_proj": ("mlp", "down_fd", 1),
}

# The nnx filter of the adapter params: what a LoRA run trains.
lora_filter = nnx.LoRAParam


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters on chosen projections (`apply_lora`)."""

    rank: int = 0  # r; 0 turns LoRA off (all params train).
    alpha: float = 16.0  # The delta's scale is alpha / r.
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")  # `PROJECTIONS` names.

    def validate(self) -> None:
        """Raises ValueError naming a bad field."""
        check_int("rank", self.rank, 0, note=" (0: LoRA off)")
        a = self.alpha
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not math.isfinite(a) or a <= 0:
            raise ValueError(f"alpha={a!r} must be a finite number > 0.")
        t = self.targets
        if not isinstance(t, (tuple, list)) or not t or len(set(t)) != len(t):
            raise ValueError(f"targets={t!r} must be a non-empty list of distinct names.")
        unknown = [name for name in t if name not in PROJECTIONS]
        if unknown:
            raise ValueError(f"targets={t!r}: unknown {unknown}; known: {list(PROJECTIONS)}.")


class LoraWeight(nnx.Module):
    """A stacked weight plus its low-rank delta, read as ``w[...]`` like the `nnx.Param`
    it replaces (inside the decoder's scan, one layer's slice of each, without the L axis).

    Attributes:
      base: the original weight [L, *in, *out] (frozen in a LoRA run).
      lora_a: A [L, *in, r], he-uniform at init, each layer from its own key.
      lora_b: B [L, r, *out], zero at init.
      scale: alpha / r.
      num_in: how many axes `in` has.
    """

    def __init__(self, base: nnx.Param, num_in: int, rank: int, alpha: float, *, keys):
        shape, axes = base.shape, logical_axes_of(base) or (None,) * base.ndim
        in_shape, out_shape = shape[1 : 1 + num_in], shape[1 + num_in :]
        # Adapters train in at least float32 whatever the base's storage dtype.
        dtype = jnp.promote_types(base.dtype, jnp.float32)
        init_a = nnx.initializers.he_uniform(in_axis=tuple(range(num_in)), out_axis=-1)
        self.base = base
        self.scale = float(alpha) / rank
        self.num_in = num_in
        a = jnp.stack([init_a(key, (*in_shape, rank), jnp.float32) for key in keys])
        self.lora_a = nnx.LoRAParam(
            a.astype(dtype), out_sharding=(*axes[: 1 + num_in], None), eager_sharding=False
        )
        self.lora_b = nnx.LoRAParam(
            jnp.zeros((shape[0], rank, *out_shape), dtype),
            out_sharding=(axes[0], None, *axes[1 + num_in :]),
            eager_sharding=False,
        )

    def delta(self) -> jax.Array:
        """(alpha / r) A @ B, the base weight's shape, in the adapters' dtype."""
        a, b = self.lora_a[...], self.lora_b[...]
        lead = a.shape[: a.ndim - self.num_in - 1]  # (L,), or () inside the scan.
        rank = a.shape[-1]
        ab = jnp.reshape(a, (*lead, -1, rank)) @ jnp.reshape(b, (*lead, rank, -1))
        return self.scale * jnp.reshape(ab, (*a.shape[:-1], *b.shape[len(lead) + 1 :]))

    def __getitem__(self, index) -> jax.Array:
        """The adapted weight W + (alpha / r) A @ B (float32 or wider), indexed."""
        return (self.base[...] + self.delta())[index]


def _adapted(model, config: LoraConfig):
    """(module, attribute, num_in) of every projection `config.targets` names."""
    for name in config.targets:
        module_name, attribute, num_in = PROJECTIONS[name]
        yield getattr(model.layers, module_name), attribute, num_in


def apply_lora(model: nnx.Module, config: LoraConfig, *, rngs: nnx.Rngs) -> nnx.Module:
    """Adds adapters to `model` (a `Decoder`) in place on `config.targets`; returns it.

    With ``config.rank == 0`` the model is returned unchanged. The adapted model's
    outputs equal the base's until B moves away from zero. `rngs.params` draws the A
    factors; `config` is validated here.
    """
    config.validate()
    if config.rank == 0:
        return model
    for module, attribute, _ in _adapted(model, LoraConfig(targets=tuple(PROJECTIONS))):
        if isinstance(getattr(module, attribute), LoraWeight):
            raise ValueError("the model already has LoRA adapters; apply_lora it once.")
    # Each layer's A from its own key, drawn in the order separate layers drew them.
    targets = list(_adapted(model, config))
    keys = [[rngs.params() for _ in targets] for _ in range(model.config.num_layers)]
    for j, (module, attribute, num_in) in enumerate(targets):
        weight = LoraWeight(getattr(module, attribute), num_in, config.rank, config.alpha,
                            keys=[layer_keys[j] for layer_keys in keys])  # fmt: skip
        setattr(module, attribute, weight)
    return model


def merge_lora(model: nnx.Module) -> nnx.Module:
    """A plain `Decoder` with every adapter folded in, ``W + (alpha / r) A @ B`` in the
    base weight's dtype; `model` is left as it is (unadapted weights are shared)."""
    # New modules; the variables (shared with `model`) are replaced, never written to.
    model = nnx.merge(*nnx.split(model))
    for module, attribute, _ in _adapted(model, LoraConfig(targets=tuple(PROJECTIONS))):
        weight = getattr(module, attribute)
        if isinstance(weight, LoraWeight):
            merged = weight[...].astype(weight.base.dtype)
            setattr(module, attribute, nnx.Param(merged, **weight.base.get_metadata()))
    return model


def _merged_state(graphdef, params, frozen) -> nnx.State:
    return nnx.state(merge_lora(nnx.merge(graphdef, params, frozen)))


class Policy:
    """The decoder a learner's sampler runs: its own graphdef and params, or, for a
    learner with frozen params (LoRA), the merged plain decoder's (a jitted merge, laid
    out on the learner's mesh as a plain learner's params would be). `graphdef` is the
    one the sampler merges the params with.
    """

    def __init__(self, learner):
        self._learner = learner
        self.graphdef = learner.graphdef
        self._merge = self._like = None
        if learner.frozen is None:
            return
        # The learner's state as arguments, so abstract params (`plan`) trace as well.
        abstract = nnx.eval_shape(
            lambda params, frozen: merge_lora(nnx.merge(learner.graphdef, params, frozen)),
            learner.params,
            learner.frozen,
        )
        self.graphdef, state = nnx.split(abstract)
        shardings = state_shardings(state, learner.mesh, learner.rules)
        self._like = abstract_with_shardings(state, shardings)
        merge = functools.partial(_merged_state, learner.graphdef)
        self._merge = jax.jit(merge, out_shardings=shardings)

    def params(self) -> nnx.State:
        """The current params of the decoder the sampler runs."""
        if self._merge is None:
            return self._learner.params
        return self._merge(self._learner.params, self._learner.frozen)

    def like(self):
        """A tree with `params()`'s structure and shardings (a restore target)."""
        return self._learner.params if self._like is None else self._like
