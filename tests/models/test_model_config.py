"""ModelConfig validation, presets, and Hugging Face config translation."""

import dataclasses

import pytest

from gac_jax.models import (
    PRESETS,
    RopeScaling,
    config_from_hf,
    config_to_hf,
    get_config,
    preset_names,
)

# Values from each checkpoint's config.json on the Hugging Face hub:
# (hidden, layers, heads, kv heads, head_dim, intermediate, vocab, theta, tied, eps)
HF_FACTS = {
    "qwen3_0_6b": (1024, 28, 16, 8, 128, 3072, 151936, 1e6, True, 1e-6),
    "qwen3_1_7b": (2048, 28, 16, 8, 128, 6144, 151936, 1e6, True, 1e-6),
    "qwen3_4b": (2560, 36, 32, 8, 128, 9728, 151936, 1e6, True, 1e-6),
    "qwen3_8b": (4096, 36, 32, 8, 128, 12288, 151936, 1e6, False, 1e-6),
    "llama3_2_1b": (2048, 16, 32, 8, 64, 8192, 128256, 5e5, True, 1e-5),
    "llama3_2_3b": (3072, 28, 24, 8, 128, 8192, 128256, 5e5, True, 1e-5),
}


@pytest.mark.parametrize("name", sorted(HF_FACTS))
def test_real_presets_match_hf_configs(name):
    c = get_config(name)
    got = (
        c.embed_dim,
        c.num_layers,
        c.num_heads,
        c.num_kv_heads,
        c.head_dim,
        c.mlp_dim,
        c.vocab_size,
        c.rope_theta,
        c.tie_word_embeddings,
        c.rms_norm_eps,
    )
    assert got == HF_FACTS[name]
    if name.startswith("llama"):
        assert c.family == "llama" and not c.qk_norm
        assert c.rope_scaling == RopeScaling(32.0, 1.0, 4.0, 8192)
    else:
        assert c.family == "qwen3" and c.qk_norm and c.rope_scaling is None


def test_unknown_preset_lists_names():
    with pytest.raises(ValueError, match="qwen3_0_6b") as info:
        get_config("qwen4_tiny")
    assert "qwen4_tiny" in str(info.value)
    assert set(preset_names()) == set(PRESETS)


def test_overrides_and_unknown_fields():
    c = get_config("tiny", dtype="bfloat16", remat="full")
    assert c.dtype == "bfloat16" and c.remat == "full"
    with pytest.raises(ValueError, match="hidden_size"):
        get_config("tiny", hidden_size=3)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(num_heads=6, num_kv_heads=4), "multiple of num_kv_heads=4"),
        (dict(family="gpt2"), "family='gpt2'"),
        (dict(head_dim=15), "head_dim=15"),
        (dict(vocab_size=0), "vocab_size=0"),
        (dict(dtype="float8"), "dtype='float8'"),
        (dict(remat="some"), "remat='some'"),
        (dict(scan_layers=1), "scan_layers=1"),
        (dict(eos_token_ids=(500,)), "500"),
        (dict(eos_token_ids=[2]), "tuple"),
    ],
)
def test_invalid_configs_name_the_value(changes, message):
    with pytest.raises(ValueError, match=message):
        get_config("tiny", **changes)


def test_rope_scaling_validation():
    with pytest.raises(ValueError, match="high_freq_factor"):
        RopeScaling(factor=8.0, low_freq_factor=4.0, high_freq_factor=1.0)


def test_configs_are_hashable_and_frozen():
    c = get_config("tiny")
    assert hash(c) == hash(get_config("tiny"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.vocab_size = 3  # type: ignore[misc]


@pytest.mark.parametrize("name", ["tiny", "tiny_llama", "qwen3_8b", "llama3_2_1b"])
def test_hf_config_round_trip(name):
    c = get_config(name)
    # How the model computes is not the checkpoint's: dtypes, and whether its layers scan
    # (a checkpoint's model does by default).
    back = config_from_hf(config_to_hf(c), dtype=c.dtype, param_dtype=c.param_dtype)
    assert back == c.replace(scan_layers=True)


def test_reads_transformers5_rope_parameters():
    hf = config_to_hf(get_config("llama3_2_1b"))
    scaling = hf.pop("rope_scaling")
    hf["rope_parameters"] = {**scaling, "rope_theta": hf.pop("rope_theta")}
    c = config_from_hf(hf)
    assert c.rope_theta == 500000.0
    assert c.rope_scaling == RopeScaling(32.0, 1.0, 4.0, 8192)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(model_type="mistral"), "model_type='mistral'"),
        (dict(hidden_act="gelu"), "hidden_act='gelu'"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}), "rope_type='yarn'"),
    ],
)
def test_unsupported_hf_configs(changes, message):
    hf = {**config_to_hf(get_config("tiny")), **changes}
    with pytest.raises(ValueError, match=message):
        config_from_hf(hf)
