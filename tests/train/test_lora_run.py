"""A LoRA run (`--set lora.rank=4`): trains, checkpoints only its adapters, resumes, and
exports merged weights that transformers loads with the adapted model's logits."""

import jax
import numpy as np
import pytest
from flax import nnx

from gac_jax.rollout import GenerationConfig, RolloutConfig
from gac_jax.train import config_io, loop
from gac_jax.train import run as run_lib
from gac_jax.train.cli import main
from gac_jax.train.config import TrainConfig

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.mark.slow
def test_a_lora_run_resumes_and_exports_its_merged_policy(tmp_path, digit_task):
    config = TrainConfig(
        task="arithmetic/add2",
        data_dir=str(tmp_path / "tfds"),
        init="random",
        steps=2,
        eval_every=0,
        checkpoint_every=1,
        rollout=RolloutConfig(mode="lagged", lag=1, groups_per_batch=2),
        generation=GenerationConfig(group_size=2, prompt_length=12, max_new_tokens=5),
    )
    config = config_io.apply_overrides(config, ["mesh.data=1", "lora.rank=4"])
    run_dir = loop.train(config, tmp_path / "run")
    resumed = config_io.apply_overrides(config, ["steps=3"])
    loop.train(resumed, run_dir, resume=True)
    assert main(["export-hf", str(run_dir), "--step", "3", "--out", str(tmp_path / "hf")]) == 0

    run, step = run_lib.load_checkpoint(resumed, run_dir)
    assert step == 3
    fresh = run_lib.build_run(resumed)
    # Only adapters were saved and trained; the frozen base is the one `init` rebuilds.
    assert {type(v) for v in jax.tree.leaves(run.learner.params, is_leaf=_is_var)} == {
        nnx.LoRAParam
    }
    jax.tree.map(np.testing.assert_array_equal, run.learner.frozen, fresh.learner.frozen)
    model = run.learner.model()
    tokens = np.random.default_rng(0).integers(3, model.config.vocab_size, (2, 9))
    ours = np.asarray(jax.jit(lambda m, t: m(t)[0])(model, tokens), np.float64)
    exported = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", torch_dtype=torch.float32
    ).eval()
    with torch.no_grad():
        theirs = exported(torch.as_tensor(tokens)).logits.double().numpy()
    scale = np.abs(ours).max()
    assert np.abs(ours - theirs).max() <= 1e-5 * scale
    initial = np.asarray(jax.jit(lambda m, t: m(t)[0])(fresh.learner.model(), tokens))
    assert np.abs(initial - ours).max() > 1e-6 * scale  # Trained adapters, not B = 0.


def _is_var(x):
    return isinstance(x, nnx.Variable)
