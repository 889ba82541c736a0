"""`ComputeConfig`: a model's compute dtype, parameter dtype and remat, set on any model.

A run's model comes from a preset, a Hugging Face checkpoint or a warm start, each with
its own dtypes; `with_compute` gives any of them the run's settings, so one config field
reaches every source the same way.
"""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from gac_jax.models.config import CHOICES
from gac_jax.models.decoder import Decoder, create_model


@dataclasses.dataclass(frozen=True)
class ComputeConfig:
    """How a model computes and stores its weights, whatever its architecture or source.

    Each field left None keeps the model's own value (its preset's, its Hugging Face
    checkpoint's, or its warm start's); see `ModelConfig` for their meaning.
    """

    dtype: str | None = None  # Activations and matmuls; logits and softmaxes stay float32.
    param_dtype: str | None = None  # Parameter storage (and so the optimizer's moments).
    remat: str | None = None  # Per layer: "none", "full" (save nothing) or "dots".

    def validate(self) -> None:
        """Raises ValueError naming a bad field."""
        for name, allowed in CHOICES.items():
            value = getattr(self, name)
            if value is not None and value not in allowed:
                raise ValueError(f"{name}={value!r} is not one of {list(allowed)} (or null).")

    def overrides(self) -> dict[str, str]:
        """The `ModelConfig` fields this config sets (for `get_config`, `load_hf_checkpoint`)."""
        return {name: v for name, v in dataclasses.asdict(self).items() if v is not None}


def with_compute(model: Decoder, compute: ComputeConfig) -> Decoder:
    """`model` with `compute`'s settings: itself when they change nothing, else a new
    decoder with the same parameters (cast to the new `param_dtype`, each on its sharding).
    """
    changes = {k: v for k, v in compute.overrides().items() if getattr(model.config, k) != v}
    if not changes:
        return model
    config = model.config.replace(**changes)
    new = nnx.eval_shape(lambda: create_model(config, rules=model.rules))
    dtype = config.parameter_dtype
    state = nnx.state(model, nnx.Param)
    cast = jax.tree.map(lambda x: x.astype(dtype) if x.dtype != dtype else x, state)
    nnx.update(new, cast)
    return new
