"""Decoder configuration: one frozen dataclass and a registry of named presets.

The presets' numbers are copied from the Hugging Face `config.json` of each checkpoint
(Qwen/Qwen3-{0.6B,1.7B,4B,8B}, meta-llama/Llama-3.2-{1B,3B}); `PRESETS` is the only list
of valid names.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from gac_jax._validation import check_int

FAMILIES = ("qwen3", "llama")
REMAT_POLICIES = ("none", "full", "dots")
DTYPES = ("float32", "bfloat16", "float16")
# The choices of `ModelConfig`'s string fields that `ComputeConfig` also sets.
CHOICES = {"dtype": DTYPES, "param_dtype": DTYPES, "remat": REMAT_POLICIES}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3 rotary frequency scaling (HF `rope_type: "llama3"`).

    Wavelengths longer than `original_max_position_embeddings / low_freq_factor` are
    divided by `factor`; those shorter than `original_max_position_embeddings /
    high_freq_factor` are kept; the band in between is interpolated smoothly.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if not self.factor > 0:
            raise ValueError(f"RopeScaling.factor={self.factor!r} must be positive.")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                f"RopeScaling needs 0 < low_freq_factor < high_freq_factor; got "
                f"low_freq_factor={self.low_freq_factor!r}, "
                f"high_freq_factor={self.high_freq_factor!r}."
            )
        if not self.original_max_position_embeddings > 0:
            raise ValueError(
                "RopeScaling.original_max_position_embeddings="
                f"{self.original_max_position_embeddings!r} must be positive."
            )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture and numerics of a Qwen3- or Llama-3-family decoder.

    Shape letters used across `gac_jax.models`: V = `vocab_size`, D = `embed_dim`,
    N = `num_heads`, K = `num_kv_heads`, H = `head_dim`, F = `mlp_dim`. HF names in
    parentheses.
    """

    family: str  # "qwen3" (q/k RMSNorm on each head) or "llama".
    vocab_size: int
    embed_dim: int  # Model width (`hidden_size`).
    num_layers: int  # (`num_hidden_layers`)
    num_heads: int  # Query heads.
    num_kv_heads: int  # Key/value heads; `num_heads` is a multiple of it.
    head_dim: int  # Need not equal `embed_dim / num_heads`.
    mlp_dim: int  # SwiGLU hidden width (`intermediate_size`).
    rope_theta: float = 10_000.0  # Rotary base wavelength.
    rope_scaling: RopeScaling | None = None  # Llama 3 frequency scaling; None: plain RoPE.
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False  # The output projection reuses the embedding table.
    max_position_embeddings: int = 4096  # The trained context; kept for export, not enforced.
    dtype: str = "bfloat16"  # Activations and matmuls; logits and softmaxes are float32.
    param_dtype: str = "float32"  # Parameter storage.
    # Per layer in the backward pass: "none", "full" (save nothing) or "dots" (save matmul
    # outputs without batch dims).
    remat: str = "none"
    # The layers as one `jax.lax.scan` (compile time flat in depth), or unrolled (faster on
    # XLA:CPU for small models: a loop copies each layer's weights and activations).
    scan_layers: bool = True
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()  # Ids that end a completion.
    pad_token_id: int | None = None

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"family={self.family!r} is not one of {FAMILIES}.")
        for name in ("vocab_size", "embed_dim", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "mlp_dim", "max_position_embeddings"):  # fmt: skip
            check_int(name, getattr(self, name), 1)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of "
                f"num_kv_heads={self.num_kv_heads} (grouped-query attention)."
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings.")
        for name in ("rope_theta", "rms_norm_eps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be positive.")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(f"rope_scaling={self.rope_scaling!r} must be a RopeScaling or None.")
        if not isinstance(self.scan_layers, bool):
            raise ValueError(f"scan_layers={self.scan_layers!r} must be a bool.")
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r} is not one of {allowed}.")
        if not isinstance(self.eos_token_ids, tuple):
            raise ValueError(f"eos_token_ids={self.eos_token_ids!r} must be a tuple of ints.")
        for name, value in (
            ("bos_token_id", self.bos_token_id),
            ("pad_token_id", self.pad_token_id),
            *(("eos_token_ids", v) for v in self.eos_token_ids),
        ):
            if value is not None and not 0 <= value < self.vocab_size:
                raise ValueError(
                    f"{name} contains {value!r}, outside [0, vocab_size={self.vocab_size})."
                )

    @property
    def qk_norm(self) -> bool:
        """Whether queries and keys are RMS-normalised per head (Qwen3)."""
        return self.family == "qwen3"

    @property
    def group_size(self) -> int:
        """Query heads per key/value head (G)."""
        return self.num_heads // self.num_kv_heads

    @property
    def compute_dtype(self) -> jnp.dtype:
        """`dtype` as a NumPy dtype."""
        return jnp.dtype(self.dtype)

    @property
    def parameter_dtype(self) -> jnp.dtype:
        """`param_dtype` as a NumPy dtype."""
        return jnp.dtype(self.param_dtype)

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with `changes` applied (validated again)."""
        return dataclasses.replace(self, **changes)


_QWEN3 = dict(
    family="qwen3",
    vocab_size=151_936,
    head_dim=128,
    num_kv_heads=8,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    max_position_embeddings=40_960,
    bos_token_id=151_643,
    eos_token_ids=(151_645, 151_643),
    pad_token_id=151_643,
)
_LLAMA3_2 = dict(
    family="llama",
    vocab_size=128_256,
    num_kv_heads=8,
    rope_theta=500_000.0,
    rope_scaling=RopeScaling(factor=32.0),
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    max_position_embeddings=131_072,
    bos_token_id=128_000,
    eos_token_ids=(128_001, 128_008, 128_009),
)
# Tiny models for CPU tests and demos, unrolled. Vocabulary 128 holds the character tokenizer.
_TINY = ModelConfig(
    family="qwen3",
    vocab_size=128,
    embed_dim=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    mlp_dim=128,
    rope_theta=10_000.0,
    tie_word_embeddings=True,
    max_position_embeddings=2048,
    dtype="float32",
    scan_layers=False,
    bos_token_id=1,
    eos_token_ids=(2,),
    pad_token_id=0,
)

PRESETS: dict[str, ModelConfig] = {
    "tiny": _TINY,
    "tiny_llama": _TINY.replace(
        family="llama",
        rope_theta=500_000.0,
        rope_scaling=RopeScaling(original_max_position_embeddings=64),
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
    "qwen3_0_6b": ModelConfig(**_QWEN3, embed_dim=1024, num_layers=28, num_heads=16, mlp_dim=3072),
    "qwen3_1_7b": ModelConfig(**_QWEN3, embed_dim=2048, num_layers=28, num_heads=16, mlp_dim=6144),
    "qwen3_4b": ModelConfig(**_QWEN3, embed_dim=2560, num_layers=36, num_heads=32, mlp_dim=9728),
    "qwen3_8b": ModelConfig(
        **_QWEN3, embed_dim=4096, num_layers=36, num_heads=32, mlp_dim=12288
    ).replace(tie_word_embeddings=False),
    "llama3_2_1b": ModelConfig(
        **_LLAMA3_2, embed_dim=2048, num_layers=16, num_heads=32, head_dim=64, mlp_dim=8192
    ),
    "llama3_2_3b": ModelConfig(
        **_LLAMA3_2, embed_dim=3072, num_layers=28, num_heads=24, head_dim=128, mlp_dim=8192
    ),
}

# The laboratory's candidate policy (issue #21): tiny's layout at 10x the parameters
# (0.8M), still trainable in minutes on one CPU core.
PRESETS["small"] = PRESETS["tiny"].replace(embed_dim=128, num_layers=4, head_dim=32, mlp_dim=384)


def preset_names() -> tuple[str, ...]:
    """Names accepted by `get_config`."""
    return tuple(PRESETS)


def get_config(name: str, **overrides: Any) -> ModelConfig:
    """The preset called `name` (a key of `PRESETS`) with `ModelConfig` fields replaced
    by `overrides`, validated; ValueError for an unknown name or an invalid override."""
    if name not in PRESETS:
        raise ValueError(f"Unknown model preset {name!r}; known presets: {preset_names()}.")
    known = [f.name for f in dataclasses.fields(ModelConfig)]
    unknown = sorted(set(overrides) - set(known))
    if unknown:
        raise ValueError(f"Unknown ModelConfig fields {unknown}; known fields: {known}.")
    return PRESETS[name].replace(**overrides)
