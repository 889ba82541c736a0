"""Flax NNX decoder (Qwen3 / Llama 3), KV-cache sampler with log-probabilities, scoring,
Hugging Face checkpoint import/export, and tokenizers.

Typical use::

    from flax import nnx
    from gac_jax import models

    model = models.load_hf_checkpoint("/ckpt/Qwen3-0.6B", mesh=models.make_mesh(fsdp=8))
    tokenizer = models.HFTokenizer.from_directory("/ckpt/Qwen3-0.6B")
    tokens, mask = models.left_pad([tokenizer.encode(p) for p in prompts], tokenizer.pad_id)
    sampler = models.Sampler(model.config, max_new_tokens=256,
                             eos_ids=tokenizer.eos_id, pad_id=tokenizer.pad_id)
    out = sampler(*nnx.split(model), tokens, mask, key, temperature=1.0, top_p=1.0)
    logps = models.per_token_logps(model, full_tokens, full_mask)  # for the learner
"""

from gac_jax.models.chunked_logprobs import chunked_token_logps_and_entropy
from gac_jax.models.compute import ComputeConfig, with_compute
from gac_jax.models.config import PRESETS, ModelConfig, RopeScaling, get_config, preset_names
from gac_jax.models.decoder import Decoder, create_model, init_cache, positions_from_mask
from gac_jax.models.hf_checkpoint import (
    config_from_hf,
    config_to_hf,
    load_hf_checkpoint,
    save_hf_checkpoint,
)
from gac_jax.models.layers import rope_inverse_frequencies
from gac_jax.models.lora import LoraConfig, apply_lora, lora_filter, merge_lora
from gac_jax.models.sampler import (
    InflightSampleOutput,
    SampleOutput,
    Sampler,
    filter_logits,
    left_pad,
    sample_step,
)
from gac_jax.models.scoring import (
    logps_of_tokens,
    per_token_logps,
    token_logps_and_entropy,
    token_logps_from_logits,
)
from gac_jax.models.sharding import (
    MeshConfig,
    ShardingRules,
    create_sharded,
    describe_shardings,
    make_mesh,
    shard_model,
    state_shardings,
)
from gac_jax.models.tokenizers import CharTokenizer, HFTokenizer, Tokenizer, decode_completion

__all__ = ["with_compute", "ComputeConfig", "PRESETS", "CharTokenizer", "Decoder", "HFTokenizer",
           "InflightSampleOutput", "LoraConfig", "ModelConfig", "RopeScaling", "SampleOutput",
           "Sampler", "MeshConfig", "ShardingRules", "Tokenizer", "decode_completion",
           "chunked_token_logps_and_entropy", "apply_lora", "lora_filter", "merge_lora",
           "config_from_hf", "config_to_hf", "create_model", "create_sharded", "describe_shardings",
           "filter_logits", "get_config", "init_cache", "left_pad", "load_hf_checkpoint",
           "logps_of_tokens", "make_mesh", "per_token_logps", "positions_from_mask", "preset_names",
           "rope_inverse_frequencies", "sample_step", "save_hf_checkpoint", "shard_model",
           "state_shardings", "token_logps_and_entropy", "token_logps_from_logits"]  # fmt: skip
