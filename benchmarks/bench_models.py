"""The tiny Qwen3-shaped models the benchmarks share (`vs_tunix.py`, `sampler.py`): the
same sizes, vocabulary and special ids, so their figures describe the same models."""

from __future__ import annotations

from gac_jax import models

PAD, EOS = 0, 2  # Random prompt / completion tokens are drawn from [3, vocab).

SIZES = {
    "small": dict(num_layers=4, embed_dim=256, mlp_dim=768, num_heads=4, num_kv_heads=2),
    "10M": dict(num_layers=6, embed_dim=384, mlp_dim=1024, num_heads=6, num_kv_heads=2),
}


def gac_config(size: dict) -> models.ModelConfig:
    """A float32 Qwen3-style config of `size` with a 512-token vocabulary."""
    return models.get_config(
        "tiny",
        vocab_size=512,
        head_dim=64,
        rope_theta=1_000_000.0,
        dtype="float32",
        param_dtype="float32",
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_ids=(EOS,),
        pad_token_id=PAD,
        **size,
    )
