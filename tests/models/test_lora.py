"""LoRA adapters: the adapted model starts as the base, equals the base with W + (alpha/r)
A@B (a NumPy float64 reference), merges into a plain decoder, and exports to transformers
with the adapted model's logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gac_jax import models
from gac_jax.models.lora import PROJECTIONS, LoraConfig, LoraWeight

CONFIG = models.get_config("tiny")
LORA = LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "v_proj", "o_proj", "down_proj"))


def _tokens(seed=0, shape=(2, 9)):
    return np.random.default_rng(seed).integers(3, CONFIG.vocab_size, shape).astype(np.int32)


def _logits(model, tokens):
    graphdef, state = nnx.split(model)
    run = jax.jit(lambda state, tokens: nnx.merge(graphdef, state)(tokens)[0])
    return np.asarray(run(state, tokens), np.float64)


def _adapted_with_random_b(seed=1, config=CONFIG):
    """The tiny model with adapters whose B factors are random (not the zero init)."""
    model = models.apply_lora(models.create_model(config, seed=0), LORA, rngs=nnx.Rngs(seed))
    adapters = nnx.state(model, models.lora_filter)
    leaves, treedef = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    noisy = [
        x + 0.05 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys, strict=True)
    ]
    nnx.update(model, jax.tree.unflatten(treedef, noisy))
    return model


def _reference_model(adapted):
    """A plain tiny decoder whose adapted weights are W + (alpha/r) A@B in NumPy float64."""
    plain = models.create_model(CONFIG, seed=0)
    for name in LORA.targets:  # Each weight stacked over the layers, [L, ...].
        module_name, attribute, _ = PROJECTIONS[name]
        weight = getattr(getattr(adapted.layers, module_name), attribute)
        a = np.asarray(weight.lora_a[...], np.float64)
        b = np.asarray(weight.lora_b[...], np.float64)
        delta = np.stack([np.tensordot(a_i, b_i, axes=1) for a_i, b_i in zip(a, b, strict=True)])
        merged = np.asarray(weight.base[...], np.float64) + LORA.alpha / LORA.rank * delta
        target = getattr(getattr(plain.layers, module_name), attribute)
        target[...] = jnp.asarray(merged, jnp.float32)
    return plain


def test_adapted_model_starts_as_the_base():
    base = models.create_model(CONFIG, seed=0)
    adapted = models.apply_lora(models.create_model(CONFIG, seed=0), LORA, rngs=nnx.Rngs(3))
    tokens = _tokens()
    assert np.array_equal(_logits(adapted, tokens), _logits(base, tokens))
    adapters = nnx.state(adapted, models.lora_filter)
    shapes = {jax.tree_util.keystr(p): x.shape for p, x in jax.tree.leaves_with_path(adapters)}
    d, n, h, layers = CONFIG.embed_dim, CONFIG.num_heads, CONFIG.head_dim, CONFIG.num_layers
    assert shapes["['layers']['attn']['q_dnh']['lora_a'].value"] == (layers, d, 4)
    assert shapes["['layers']['attn']['q_dnh']['lora_b'].value"] == (layers, 4, n, h)
    assert shapes["['layers']['attn']['o_nhd']['lora_a'].value"] == (layers, n, h, 4)
    assert shapes["['layers']['mlp']['down_fd']['lora_b'].value"] == (layers, 4, d)
    assert len(shapes) == 2 * len(LORA.targets)


def test_adapted_and_merged_models_equal_the_reference_weights():
    adapted = _adapted_with_random_b()
    tokens = _tokens(1)
    ours = _logits(adapted, tokens)
    reference = _logits(_reference_model(adapted), tokens)
    scale = np.abs(reference).max()
    assert np.abs(ours - reference).max() <= 1e-5 * scale
    assert np.abs(ours - _logits(models.create_model(CONFIG, seed=0), tokens)).max() > 1e-3 * scale

    merged = models.merge_lora(adapted)
    assert isinstance(merged, models.Decoder)
    assert not jax.tree.leaves(nnx.state(merged, models.lora_filter))
    assert nnx.graphdef(merged) == nnx.graphdef(models.create_model(CONFIG, seed=0))
    assert np.abs(_logits(merged, tokens) - ours).max() <= 1e-5 * scale
    # The adapted model is left as it was.
    assert isinstance(adapted.layers.attn.q_dnh, LoraWeight)
    assert np.array_equal(_logits(adapted, tokens), ours)


def test_rank_zero_leaves_the_model_alone_and_adapting_twice_fails():
    model = models.create_model(CONFIG, seed=0)
    assert models.apply_lora(model, LoraConfig(), rngs=nnx.Rngs(0)) is model
    assert not jax.tree.leaves(nnx.state(model, models.lora_filter))
    models.apply_lora(model, LORA, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        models.apply_lora(model, LORA, rngs=nnx.Rngs(0))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"rank": -1}, "rank=-1 must be"),
        ({"rank": 2.0}, "rank=2.0 must be"),
        ({"alpha": 0.0}, "alpha=0.0 must be"),
        ({"alpha": float("nan")}, "alpha=nan must be"),
        ({"targets": ()}, "targets=\\(\\) must be"),
        ({"targets": ("q_proj", "q_proj")}, "distinct"),
        ({"targets": ("query",)}, "unknown \\['query'\\]"),
    ],
)
def test_bad_configs_raise_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LoraConfig(**kwargs).validate()


def test_merged_export_loads_in_transformers_with_the_adapted_logits(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    adapted = _adapted_with_random_b(seed=2)
    models.save_hf_checkpoint(models.merge_lora(adapted), tmp_path / "hf")
    exported = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", torch_dtype=torch.float32
    ).eval()
    tokens = _tokens(2)
    with torch.no_grad():
        theirs = exported(torch.as_tensor(tokens, dtype=torch.long)).logits.double().numpy()
    ours = _logits(adapted, tokens)
    assert np.abs(ours - theirs).max() <= 1e-5 * np.abs(ours).max()


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_adapters_train_under_remat_with_the_base_frozen(remat):
    # A LoRA run differentiates the adapters only, the base passed in as a frozen state;
    # remat must give the gradient without it (it once failed: nnx.remat wrote the frozen
    # weights back across traces).
    tokens = _tokens(3)

    def adapter_grads(remat_name):
        model = _adapted_with_random_b(config=CONFIG.replace(remat=remat_name))
        graphdef, adapters, frozen = nnx.split(model, models.lora_filter, ...)

        def loss(adapters):
            return jnp.mean(nnx.merge(graphdef, adapters, frozen)(tokens)[0] ** 2)

        return jax.jit(jax.value_and_grad(loss))(adapters)

    base_loss, base_grads = adapter_grads("none")
    loss, grads = adapter_grads(remat)
    np.testing.assert_allclose(loss, base_loss, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(base_grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)
    assert any(np.any(np.asarray(g) != 0) for g in jax.tree.leaves(grads))
