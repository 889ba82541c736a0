"""Equivalence with Hugging Face transformers, and checkpoint import/export round trips.

The reference is `transformers`' own PyTorch Qwen3ForCausalLM and LlamaForCausalLM
(randomly initialised, tiny), which nobody here wrote.
"""

import copy
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gac_jax.models import (
    Sampler,
    config_from_hf,
    create_model,
    get_config,
    left_pad,
    load_hf_checkpoint,
    rope_inverse_frequencies,
    save_hf_checkpoint,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

VOCAB = 128
COMMON = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    vocab_size=VOCAB,
    max_position_embeddings=256,
    # Wider than the default 0.02, so logits are far from uniform and greedy choices
    # are not near-ties.
    initializer_range=0.1,
)
FAMILIES = {
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(head_dim=16, tie_word_embeddings=True, rope_theta=10_000.0),
    ),
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            tie_word_embeddings=False,
            rms_norm_eps=1e-5,
            rope_theta=500_000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            ),
        ),
    ),
}


def _torch_logits(hf_model, tokens):
    with torch.no_grad():
        return hf_model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()


@jax.jit
def _logits(graphdef, state, tokens):
    return nnx.merge(graphdef, state)(tokens)[0]


def _rel_error(got, want):
    return float(np.max(np.abs(np.asarray(got) - want)) / np.max(np.abs(want)))


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def hf(request, tmp_path_factory):
    """(family, transformers model, its save_pretrained directory)."""
    config_cls, model_cls, extra = FAMILIES[request.param]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**COMMON, **extra)
    model = getattr(transformers, model_cls)(config).eval()
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return request.param, model, path


@pytest.fixture(scope="module")
def tokens():
    return np.random.RandomState(0).randint(0, VOCAB, size=(2, 40))


def test_logits_match_transformers(hf, tokens):
    family, hf_model, path = hf
    model = load_hf_checkpoint(path, dtype="float32")
    assert model.config.family == family
    if family == "llama":
        assert model.config.rope_scaling is not None
    want = _torch_logits(hf_model, tokens)
    got = _logits(*nnx.split(model), jnp.asarray(tokens))
    error = _rel_error(got, want)
    print(f"{family}: max |ours - transformers| / max |transformers| = {error:.2e}")
    assert error < 1e-4


def test_a_float32_checkpoint_computes_in_float32_by_default(hf, tokens):
    family, hf_model, path = hf
    stored = json.loads((path / "config.json").read_text())
    assert "float32" in (stored.get("dtype"), stored.get("torch_dtype"))
    model = load_hf_checkpoint(path)  # No dtype given: the checkpoint's own.
    assert (model.config.dtype, model.config.param_dtype) == ("float32", "float32")
    got = np.asarray(_logits(*nnx.split(model), jnp.asarray(tokens)), np.float64)
    # The reference: transformers on the same weights in float64, where its own float32
    # rounding (about 7e-7 of the largest logit here) is gone.
    exact = copy.deepcopy(hf_model).double()
    with torch.no_grad():
        want = exact(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()
    error = _rel_error(got, want)
    print(f"{family}, default dtype: max |ours - transformers f64| / max |logit| = {error:.2e}")
    assert error < 1e-6
    # Against transformers' float32 run both roundings add up (measured 7.7e-7, 1.2e-6).
    assert _rel_error(got, _torch_logits(hf_model, tokens)) < 2e-6


def test_rope_frequencies_match_transformers(hf):
    _, hf_model, _ = hf
    config = config_from_hf(hf_model.config.to_dict())
    ours = rope_inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
    theirs = hf_model.model.rotary_emb.inv_freq.numpy()
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)


def test_greedy_continuation_matches_transformers(hf):
    family, hf_model, path = hf
    model = load_hf_checkpoint(path, dtype="float32")
    rng = np.random.RandomState(1)
    prompts = [rng.randint(3, VOCAB - 1, size=9).tolist(), rng.randint(3, VOCAB - 1, 4).tolist()]
    eos = VOCAB - 1
    sampler = Sampler(model.config, max_new_tokens=10, eos_ids=eos, pad_id=0)
    prompt_tokens, prompt_mask = left_pad(prompts, pad_id=0)
    out = sampler.generate(model, prompt_tokens, prompt_mask, jax.random.key(0), temperature=0.0)
    for row, prompt in enumerate(prompts):
        with torch.no_grad():
            generated = hf_model.generate(
                torch.tensor([prompt]),
                do_sample=False,
                max_new_tokens=10,
                eos_token_id=eos,
                pad_token_id=0,
            )[0, len(prompt) :].numpy()
        length = int(out.lengths[row])
        assert length == len(generated) or generated[length:].tolist() == [0] * (
            len(generated) - length
        )
        np.testing.assert_array_equal(np.asarray(out.tokens[row, :length]), generated[:length])


def _safetensors_tensors(path):
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(safetensors_numpy.load_file(str(file)))
    return tensors


def test_export_reimport_round_trips_exactly(hf, tokens, tmp_path):
    family, hf_model, path = hf
    model = load_hf_checkpoint(path, dtype="float32")
    save_hf_checkpoint(model, tmp_path)

    # The exported tensors are bit-for-bit the ones transformers wrote.
    original, exported = _safetensors_tensors(path), _safetensors_tensors(tmp_path)
    assert set(exported) == set(original)
    for name, value in original.items():
        assert exported[name].dtype == value.dtype
        np.testing.assert_array_equal(exported[name], value, err_msg=name)

    again = load_hf_checkpoint(tmp_path, dtype="float32")
    assert again.config == model.config
    for a, b in zip(
        jax.tree.leaves(nnx.state(again)), jax.tree.leaves(nnx.state(model)), strict=True
    ):
        np.testing.assert_array_equal(a, b)

    # transformers loads the export and computes the same logits.
    reloaded = type(hf_model).from_pretrained(tmp_path).eval()
    np.testing.assert_array_equal(_torch_logits(reloaded, tokens), _torch_logits(hf_model, tokens))


def test_a_one_layer_model_round_trips(tmp_path):
    # Its layers' params are stacked [1, ...]: one tensor per layer, still.
    model = create_model(get_config("tiny_llama", num_layers=1, scan_layers=True), seed=2)
    save_hf_checkpoint(model, tmp_path)
    assert "model.layers.0.mlp.up_proj.weight" in _safetensors_tensors(tmp_path)
    again = load_hf_checkpoint(tmp_path)
    for a, b in zip(
        jax.tree.leaves(nnx.state(again)), jax.tree.leaves(nnx.state(model)), strict=True
    ):
        np.testing.assert_array_equal(a, b)


def test_sharded_safetensors_with_index(hf, tokens, tmp_path):
    family, hf_model, path = hf
    hf_model.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 1
    model = load_hf_checkpoint(tmp_path / "hf", dtype="float32")
    reference = load_hf_checkpoint(path, dtype="float32")
    for a, b in zip(
        jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(reference)), strict=True
    ):
        np.testing.assert_array_equal(a, b)

    # Our own sharded export, read back by transformers.
    save_hf_checkpoint(model, tmp_path / "ours", max_shard_bytes=40_000)
    index = json.loads((tmp_path / "ours" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    reloaded = type(hf_model).from_pretrained(tmp_path / "ours").eval()
    np.testing.assert_array_equal(_torch_logits(reloaded, tokens), _torch_logits(hf_model, tokens))


def test_bfloat16_checkpoint(hf, tmp_path):
    family, hf_model, _ = hf
    bf16_model = type(hf_model)(hf_model.config).to(torch.bfloat16)
    bf16_model.load_state_dict(hf_model.state_dict())
    bf16_model.save_pretrained(tmp_path)
    model = load_hf_checkpoint(tmp_path, param_dtype="bfloat16")
    assert model.config.param_dtype == "bfloat16" and model.config.dtype == "bfloat16"
    embedding = model.embedding_vd[...]
    assert embedding.dtype == jnp.bfloat16
    want = bf16_model.model.embed_tokens.weight.detach().float().numpy()
    np.testing.assert_array_equal(np.asarray(embedding, np.float32), want)
    # By default a bfloat16 checkpoint computes in bfloat16, its params kept in float32.
    default = load_hf_checkpoint(tmp_path)
    assert (default.config.dtype, default.config.param_dtype) == ("bfloat16", "float32")
    assert load_hf_checkpoint(tmp_path, dtype="float32").config.dtype == "float32"


def test_checkpoint_errors(hf, tmp_path):
    family, hf_model, path = hf
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_checkpoint(tmp_path)

    tensors = _safetensors_tensors(path)
    config = json.loads((path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_hf_checkpoint(tmp_path)

    missing = dict(tensors)
    del missing["model.layers.1.mlp.up_proj.weight"]
    safetensors_numpy.save_file(missing, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_hf_checkpoint(tmp_path)

    extra = {**tensors, "model.layers.0.self_attn.q_proj.bias": np.zeros(64, np.float32)}
    safetensors_numpy.save_file(extra, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="q_proj.bias"):
        load_hf_checkpoint(tmp_path)

    safetensors_numpy.save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 80}))
    with pytest.raises(ValueError, match=r"gate_proj.weight.*\(96, 64\)"):
        load_hf_checkpoint(tmp_path)


def _copy_checkpoint(source, target):
    target.mkdir()
    for file in source.iterdir():
        (target / file.name).write_bytes(file.read_bytes())
    return target


@pytest.mark.parametrize("entry", ["../elsewhere/w.safetensors", "/abs/w.safetensors"])
def test_index_entries_outside_the_directory_are_rejected(hf, tmp_path, entry):
    _, hf_model, _ = hf
    checkpoint = tmp_path / "ckpt"
    hf_model.save_pretrained(checkpoint, max_shard_size="40KB")
    (tmp_path / "elsewhere").mkdir()
    index_path = checkpoint / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.norm.weight"] = entry
    index_path.write_text(json.dumps(index))
    want = (
        f"model.safetensors.index.json maps 'model.norm.weight' to {entry!r}, outside the "
        f"checkpoint directory {str(checkpoint)!r}."
    )
    with pytest.raises(ValueError) as error:
        load_hf_checkpoint(checkpoint)
    assert str(error.value) == want


def test_corrupt_config_json_names_the_file(hf, tmp_path):
    _, _, path = hf
    checkpoint = _copy_checkpoint(path, tmp_path / "ckpt")
    config_path = checkpoint / "config.json"
    config = json.loads(config_path.read_text())

    config_path.write_text('{"model_type": "qwen3",')
    with pytest.raises(ValueError) as error:
        load_hf_checkpoint(checkpoint)
    assert str(error.value) == (
        f"{str(config_path)!r} is not valid JSON: Expecting property name enclosed in double "
        "quotes: line 1 column 24 (char 23)."
    )

    config_path.write_text("[1, 2]")
    with pytest.raises(ValueError) as error:
        load_hf_checkpoint(checkpoint)
    assert str(error.value) == f"{str(config_path)!r} holds a JSON list, not an object."

    del config["hidden_size"], config["vocab_size"]
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError) as error:
        load_hf_checkpoint(checkpoint)
    assert str(error.value) == (
        f"{str(config_path)!r} lacks the required keys ['vocab_size', 'hidden_size']."
    )


def test_truncated_or_corrupt_safetensors_names_the_file(hf, tmp_path):
    _, _, path = hf
    checkpoint = _copy_checkpoint(path, tmp_path / "ckpt")
    weights = checkpoint / "model.safetensors"
    whole = weights.read_bytes()
    for damaged, reason in [
        (whole[: len(whole) // 2], "incomplete metadata, file not fully covered"),
        (b"garbage", "header too small"),
    ]:
        weights.write_bytes(damaged)
        with pytest.raises(ValueError) as error:
            load_hf_checkpoint(checkpoint)
        assert str(error.value) == (
            f"Safetensors file {str(weights)!r} is corrupt or truncated: "
            f"Error while deserializing header: {reason}."
        )
