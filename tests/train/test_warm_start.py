"""The supervised warm start: its loss, a short run end to end, and the shipped checkpoint."""

import dataclasses
import functools
import subprocess
import sys
from pathlib import Path

import draccus
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from gac_jax.models import (
    CharTokenizer,
    create_model,
    get_config,
    make_mesh,
    token_logps_from_logits,
)
from gac_jax.train import config_io
from gac_jax.train.build import warm_start_directory
from gac_jax.train.checkpoint import model_params, read_metadata
from gac_jax.train.config import get_preset
from gac_jax.train.config_io import config_to_dict
from gac_jax.train.metrics import read_metrics
from gac_jax.train.warm_start import (
    SHIPPED_WARM_START_DIR,
    SHIPPED_WARM_STARTS,
    SFTConfig,
    WarmStartConfig,
    config_hash,
    encode_sft_batch,
    ensure_warm_start,
    load_warm_start,
    masked_nll,
    sft_loss,
    train_sft,
    warm_start,
    weights_digest,
)
from tests.conftest import process_env


def _log_softmax64(logits):
    logits = np.asarray(logits, np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


@functools.partial(jax.jit, static_argnums=0)
def _jitted_logits(graphdef, state, tokens):
    return nnx.merge(graphdef, state)(tokens)[0]


def _logits(model, tokens) -> np.ndarray:
    return np.asarray(_jitted_logits(*nnx.split(model), tokens))


def test_encode_sft_batch_layout():
    tokenizer = CharTokenizer()
    batch = encode_sft_batch(tokenizer, ["Use 1 2: ", "ab"], ["1+2", "c"], length=16)
    tokens, mask, loss_mask = batch["tokens"], batch["mask"], batch["loss_mask"]
    assert tokens.shape == mask.shape == loss_mask.shape == (2, 16)
    expected = [tokenizer.bos_id, *tokenizer.encode("Use 1 2: 1+2"), tokenizer.eos_id]
    assert tokens[0, : len(expected)].tolist() == expected
    assert (tokens[0, len(expected) :] == tokenizer.pad_id).all()
    assert mask[0].sum() == len(expected)
    # The loss covers exactly the completion and its EOS: "1+2<eos>" is 4 tokens at 10..13.
    assert np.flatnonzero(loss_mask[0]).tolist() == [10, 11, 12, 13]
    assert np.flatnonzero(loss_mask[1]).tolist() == [3, 4]
    with pytest.raises(ValueError, match="max_length"):
        encode_sft_batch(tokenizer, ["x" * 10], ["y" * 10], length=16)


def test_sft_loss_matches_numpy_and_ignores_the_prompt():
    tokenizer = CharTokenizer()
    model = create_model(get_config("tiny", dtype="float32"), seed=0)
    batch = encode_sft_batch(tokenizer, ["Use 3 4: ", "Use 9 1 2: "], ["3*4", "9+1*2"], 20)
    tokens, mask, loss_mask = (jnp.asarray(batch[k]) for k in ("tokens", "mask", "loss_mask"))

    graphdef, state = nnx.split(model)

    @jax.jit
    def loss_and_logits(state, tokens, mask, loss_mask):
        model = nnx.merge(graphdef, state)
        return sft_loss(model, tokens, mask, loss_mask), model(tokens, None, mask)[0]

    loss, logits = loss_and_logits(state, tokens, mask, loss_mask)
    # NumPy float64: -mean over completion tokens t of log softmax(logits[t-1])[tokens[t]].
    logp = _log_softmax64(logits)
    picked = [
        logp[b, t - 1, int(batch["tokens"][b, t])]
        for b in range(2)
        for t in range(20)
        if batch["loss_mask"][b, t]
    ]
    np.testing.assert_allclose(float(loss), -np.mean(picked), rtol=1e-5)

    # The loss has no gradient through the logits that predict prompt tokens (or padding).
    def loss_of_logits(logits):
        return masked_nll(token_logps_from_logits(logits, tokens, mask), loss_mask)

    grad = np.asarray(jax.jit(jax.grad(loss_of_logits))(logits))
    predicts_completion = np.zeros((2, 20), bool)
    predicts_completion[:, :-1] = batch["loss_mask"][:, 1:]
    assert np.abs(grad[~predicts_completion]).max() == 0.0
    assert np.abs(grad[predicts_completion]).sum(axis=-1).min() > 0.0


def test_masked_nll_reference():
    logps = jnp.asarray([[-1.0, -2.0, -3.0], [-0.5, -4.0, 0.0]], jnp.float32)
    mask = jnp.asarray([[False, True, True], [True, False, False]])
    np.testing.assert_allclose(float(jax.jit(masked_nll)(logps, mask)), (2 + 3 + 0.5) / 3)
    assert float(masked_nll(logps, jnp.zeros_like(mask))) == 0.0


def test_config_validation_and_hash():
    config = WarmStartConfig()
    assert draccus.decode(WarmStartConfig, config_to_dict(config)) == config
    assert config_hash(config) == config_hash(WarmStartConfig())
    assert config_hash(dataclasses.replace(config, steps=config.steps + 1)) != config_hash(config)
    with pytest.raises(ValueError, match="WarmStartConfig.steps=0"):
        WarmStartConfig(steps=0)
    with pytest.raises(ValueError, match="WarmStartConfig.eval_samples=0"):
        WarmStartConfig(eval_samples=0)
    with pytest.raises(ValueError, match="SFTConfig.batch_size=0"):
        SFTConfig(batch_size=0)
    # One hash for runs, sweeps and warm starts; the shipped checkpoint's still matches.
    assert config_hash is config_io.config_hash
    assert read_metadata(SHIPPED_WARM_START_DIR)["config_hash"] == config_hash(config)


# A run short enough for a test: a few steps, four test problems, two samples each.
_SHORT = WarmStartConfig(
    steps=3,
    batch_size=8,
    warmup_steps=1,
    train_examples=64,
    eval_problems=4,
    eval_samples=2,
    eval_batch_size=8,
)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tfds")


@pytest.fixture(scope="module")
def short_run(data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("warm_start")
    return out, warm_start(_SHORT, out, data_dir=data_dir)


def test_short_run_writes_a_checkpoint_with_its_metrics(short_run):
    out, metrics = short_run
    for key in ("pass@1", "pass@2", "greedy_accuracy"):
        assert 0.0 <= metrics[key] <= 1.0
    assert metrics["pass@2"] >= metrics["pass@1"]
    assert metrics["eval_problems"] == 4 and metrics["checkpoint_bytes"] > 0
    metadata = read_metadata(out)
    assert metadata["config"] == config_to_dict(_SHORT)
    # Training reported through the RL loop's metric writer: one record per step.
    records = read_metrics(out / "sft_metrics")
    assert [r["step"] for r in records] == list(range(_SHORT.steps))
    assert all(r["loss"] > 0 and r["grad_norm"] > 0 for r in records)
    assert metadata["config_hash"] == config_hash(_SHORT)
    assert metadata["metrics"]["pass@1"] == metrics["pass@1"]
    assert metadata["prompt_format"]["add_bos"] is True


def test_reload_gives_the_trained_params_and_logits(short_run, data_dir):
    out, _ = short_run
    # Training is deterministic and reads only the training's fields, so a second run
    # from them alone gives the params the checkpoint holds.
    fields = {f.name: getattr(_SHORT, f.name) for f in dataclasses.fields(SFTConfig)}
    trained, _, _ = train_sft(SFTConfig(**fields), data_dir=data_dir)
    loaded, tokenizer, _ = load_warm_start(out)
    assert loaded.config == trained.config
    assert tokenizer.characters == CharTokenizer().characters
    trained_params, loaded_params = model_params(trained), model_params(loaded)
    assert jax.tree.structure(trained_params) == jax.tree.structure(loaded_params)
    for a, b in zip(jax.tree.leaves(trained_params), jax.tree.leaves(loaded_params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    tokens = jnp.asarray([tokenizer.encode("Use 3 4 5 to make 17: 3*4+5", add_bos=True)])
    np.testing.assert_array_equal(_logits(loaded, tokens), _logits(trained, tokens))


def test_reload_onto_a_mesh(short_run):
    out, _ = short_run
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    sharded, _, _ = load_warm_start(out, mesh=mesh)
    plain, _, _ = load_warm_start(out)
    params = model_params(sharded)
    assert any(len(x.sharding.device_set) > 1 for x in jax.tree.leaves(params))
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(model_params(plain)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_load_rejects_a_checkpoint_that_is_not_a_warm_start(tmp_path):
    from gac_jax.train.checkpoint import save_checkpoint

    save_checkpoint(tmp_path, 0, {"w": jnp.zeros(3)}, {"kind": "something else"})
    with pytest.raises(ValueError, match="no warm start"):
        load_warm_start(tmp_path)


def test_the_shipped_checkpoint_is_the_default_configs_and_solves_some_problems():
    metadata = read_metadata(SHIPPED_WARM_START_DIR)
    assert metadata["config"] == config_to_dict(WarmStartConfig())
    assert metadata["config_hash"] == config_hash(WarmStartConfig())
    metrics = metadata["metrics"]
    n = WarmStartConfig().eval_samples
    assert 0.1 <= metrics["pass@1"] <= 0.4, metrics
    assert metrics[f"pass@{n}"] >= metrics["pass@1"] + 0.2, metrics
    assert metrics["eval_problems"] >= 500
    size = sum(p.stat().st_size for p in SHIPPED_WARM_START_DIR.rglob("*") if p.is_file())
    assert size < 10 * 2**20

    model, tokenizer, loaded_metadata = load_warm_start()
    assert loaded_metadata == metadata
    assert model.config.vocab_size >= tokenizer.vocab_size
    assert ensure_warm_start() == SHIPPED_WARM_START_DIR  # Served without training.


def test_the_laboratorys_warm_start_is_shipped_so_every_machine_starts_from_its_weights(
    monkeypatch,
):
    # Trained again on another CPU it would be another policy (float reductions differ).
    module = sys.modules[WarmStartConfig.__module__]
    monkeypatch.setattr(module, "warm_start", lambda *a, **k: pytest.fail("trained again"))
    lab = WarmStartConfig(steps=300)
    directory = ensure_warm_start(lab, cache_dir="/nonexistent")
    assert directory.parent == SHIPPED_WARM_STARTS and directory != SHIPPED_WARM_START_DIR
    assert read_metadata(directory)["config_hash"] == config_hash(lab)
    assert 0.03 <= read_metadata(directory)["metrics"]["pass@1"] <= 0.15


def test_the_calculator_presets_warm_start_is_shipped_and_served_untrained(monkeypatch):
    """Trained again its quality is a lottery: from the same seed, float differences too
    small to see (another optimizer chain's fusions, another commit) gave greedy accuracy
    0.50, 0.39 and 0.07. The tool cell of experiments/RESULTS.md started from this one."""
    module = sys.modules[WarmStartConfig.__module__]
    monkeypatch.setattr(module, "warm_start", lambda *a, **k: pytest.fail("trained again"))
    directory = warm_start_directory(get_preset("calculator"))
    assert directory.parent == SHIPPED_WARM_STARTS
    metrics = read_metadata(directory)["metrics"]
    assert metrics["greedy_accuracy"] == 0.499 and metrics["pass@1"] == 0.2025


def test_the_weights_digest_is_the_parameters_own(monkeypatch):
    digest = weights_digest(SHIPPED_WARM_START_DIR)
    assert len(digest) == 64 and digest == weights_digest()  # The default is that one.
    lab = ensure_warm_start(WarmStartConfig(steps=300))
    assert weights_digest(lab) != digest
    # It reads the parameters, not the files: one changed weight changes it.
    model, _, _ = load_warm_start()
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda x: x.at[(0,) * x.ndim].add(1e-3), params))
    module = sys.modules[WarmStartConfig.__module__]
    monkeypatch.setattr(module, "load_warm_start", lambda *a, **k: (model, None, None))
    assert weights_digest() != digest


_ENSURE = """
import sys
from gac_jax.train.warm_start import WarmStartConfig, ensure_warm_start
config = WarmStartConfig(steps=3, batch_size=8, warmup_steps=1, train_examples=64,
    eval_problems=4, eval_samples=2, eval_batch_size=8, seed=7)
print(ensure_warm_start(config, cache_dir=sys.argv[1], data_dir=sys.argv[2]))
"""


@pytest.mark.slow
def test_processes_asking_for_one_warm_start_at_once_train_it_once(tmp_path, data_dir):
    # A sweep's first runs start together: without the lock, each trains the same warm
    # start and all but the first fail on saving a step that is already saved.
    env = process_env(1)
    children = [
        subprocess.Popen(
            [sys.executable, "-c", _ENSURE, str(tmp_path / "cache"), str(data_dir)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(3)
    ]
    outputs = [child.communicate(timeout=300) for child in children]
    for child, (_, err) in zip(children, outputs, strict=True):
        assert child.returncode == 0, err[-2000:]
    places = {out.strip().splitlines()[-1] for out, _ in outputs}
    assert len(places) == 1
    trained = Path(places.pop())
    assert read_metadata(trained)["config"]["seed"] == 7
    # Trained once: one metrics log of 3 steps, not three runs appended.
    assert [r["step"] for r in read_metrics(trained / "sft_metrics")] == [0, 1, 2]
    # The one that trained said so first (the others found it trained and said nothing).
    said = [err for _, err in outputs if "training the warm start once (3 supervised" in err]
    assert len(said) == 1, [err[-500:] for _, err in outputs]
