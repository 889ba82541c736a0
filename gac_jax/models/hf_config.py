"""Hugging Face `config.json` <-> `ModelConfig`, for Qwen3 and Llama decoders.

Both config dialects are read: transformers 4's `rope_theta` + `rope_scaling` and
transformers 5's `rope_parameters`. Export writes the transformers 4 keys, which both
versions read. The weights are handled by `gac_jax.models.hf_checkpoint`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from gac_jax.models.config import ModelConfig, RopeScaling

CONFIG_FILE = "config.json"
#: Keys of `config.json` that `config_from_hf` cannot default.
REQUIRED_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
)

_ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}


def _as_int_tuple(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def config_from_hf(hf_config: dict[str, Any], **overrides: Any) -> ModelConfig:
    """A `ModelConfig` from a parsed Hugging Face `config.json`, with `overrides` (e.g.
    `dtype="float32"`) set. ValueError naming the key and value for a model type,
    activation, bias or RoPE type this decoder does not implement.
    """
    model_type = hf_config.get("model_type")
    if model_type not in _ARCHITECTURES:
        raise ValueError(
            f"config.json has model_type={model_type!r}; expected one of {tuple(_ARCHITECTURES)}."
        )
    act = hf_config.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json has hidden_act={act!r}; only 'silu' is supported.")
    for key in ("attention_bias", "mlp_bias"):
        if hf_config.get(key, False):
            raise ValueError(f"config.json has {key}=true; biases are not supported.")
    if hf_config.get("use_sliding_window", False):
        raise ValueError("config.json has use_sliding_window=true; not supported.")

    rope = {**(hf_config.get("rope_scaling") or {}), **(hf_config.get("rope_parameters") or {})}
    theta = rope.get("rope_theta", hf_config.get("rope_theta", 10_000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        scaling = None
    elif rope_type == "llama3":
        # Each field is read as the type of its default (float, int for the context).
        scaling_fields = dataclasses.fields(RopeScaling)
        scaling = RopeScaling(**{f.name: type(f.default)(rope[f.name]) for f in scaling_fields})
    else:
        raise ValueError(
            f"config.json has rope_type={rope_type!r}; supported: 'default', 'llama3'."
        )

    num_heads = int(hf_config["num_attention_heads"])
    head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // num_heads
    fields = dict(
        family=model_type,
        vocab_size=int(hf_config["vocab_size"]),
        embed_dim=int(hf_config["hidden_size"]),
        num_layers=int(hf_config["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(hf_config.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        mlp_dim=int(hf_config["intermediate_size"]),
        rope_theta=float(theta),
        rope_scaling=scaling,
        rms_norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
        max_position_embeddings=int(hf_config.get("max_position_embeddings", 4096)),
        bos_token_id=hf_config.get("bos_token_id"),
        eos_token_ids=_as_int_tuple(hf_config.get("eos_token_id")),
        pad_token_id=hf_config.get("pad_token_id"),
    )
    return ModelConfig(**fields | overrides)


def config_to_hf(config: ModelConfig, *, dtype: str | None = None) -> dict[str, Any]:
    """The Hugging Face `config.json` contents for `config`, whose weights are stored in
    `dtype` (`config.param_dtype` by default)."""
    eos = list(config.eos_token_ids)
    hf: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[config.family]],
        "model_type": config.family,
        "vocab_size": config.vocab_size,
        "hidden_size": config.embed_dim,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.mlp_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": config.tie_word_embeddings,
        "max_position_embeddings": config.max_position_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "pad_token_id": config.pad_token_id,
        "torch_dtype": dtype or config.param_dtype,
        "use_cache": True,
    }
    if config.rope_scaling is not None:
        hf["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(config.rope_scaling)}
    if config.family == "llama":
        hf["mlp_bias"] = False
    else:
        hf["use_sliding_window"] = False
        hf["sliding_window"] = None
    return hf


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
    """The parsed `config.json` of a checkpoint directory. FileNotFoundError without one;
    ValueError naming the file if it is not a JSON object or lacks a `REQUIRED_KEYS` key.
    """
    config_path = Path(path) / CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(f"No {CONFIG_FILE} in checkpoint directory {str(path)!r}.")
    hf_config = read_json_object(config_path)
    missing = [key for key in REQUIRED_KEYS if key not in hf_config]
    if missing:
        raise ValueError(f"{str(config_path)!r} lacks the required keys {missing}.")
    return hf_config


def read_json_object(file: Path) -> dict[str, Any]:
    """The JSON object `file` holds; ValueError naming the file if it holds none."""
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{str(file)!r} is not valid JSON: {error}.") from error
    if not isinstance(data, dict):
        raise ValueError(f"{str(file)!r} holds a JSON {type(data).__name__}, not an object.")
    return data
