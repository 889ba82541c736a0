"""`gac-jax export-hf`: a trained run's policy as a Hugging Face model that transformers
loads, with the run's own logits."""

import os
import stat
from types import SimpleNamespace

import numpy as np
import pytest
from flax import nnx

from gac_jax import models
from gac_jax.rollout import GenerationConfig, RolloutConfig
from gac_jax.train import config_io, export, loop
from gac_jax.train import run as run_lib
from gac_jax.train.cli import main
from gac_jax.train.config import TrainConfig

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.mark.slow
def test_an_exported_run_has_the_runs_logits_in_transformers(tmp_path, digit_task):
    config = TrainConfig(
        task="arithmetic/add2",
        data_dir=str(tmp_path / "tfds"),
        init="random",
        steps=2,
        eval_every=0,
        checkpoint_every=2,
        rollout=RolloutConfig(mode="lagged", lag=1, groups_per_batch=2),
        generation=GenerationConfig(group_size=2, prompt_length=12, max_new_tokens=5),
    )
    config = config_io.apply_overrides(config, ["mesh.data=1"])
    run_dir = loop.train(config, tmp_path / "run")
    assert main(["export-hf", str(run_dir), "--step", "2", "--out", str(tmp_path / "hf")]) == 0

    run, step = run_lib.load_checkpoint(config, run_dir)
    assert step == 2
    model = nnx.merge(run.learner.graphdef, run.learner.params)
    tokens = np.random.default_rng(0).integers(3, model.config.vocab_size, (2, 9))
    ours = np.asarray(model(tokens)[0], np.float64)
    exported = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", torch_dtype=torch.float32
    ).eval()
    with torch.no_grad():
        theirs = exported(torch.as_tensor(tokens)).logits.double().numpy()
    scale = np.abs(ours).max()
    assert np.abs(ours - theirs).max() <= 1e-5 * scale
    # Trained weights, not the initial ones: the export is of the checkpoint.
    fresh = run_lib.build_run(config)
    initial = np.asarray(nnx.merge(fresh.learner.graphdef, fresh.learner.params)(tokens)[0])
    assert np.abs(initial - ours).max() > 1e-6 * scale


def test_export_of_a_missing_step_fails_in_one_line(tmp_path, capsys):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "config.json").write_text("{}")
    with pytest.raises(SystemExit) as e:
        main(["export-hf", str(tmp_path / "run"), "--step", "7", "--out", str(tmp_path / "hf")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "no checkpoint of step 7" in err and "Traceback" not in err


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_the_exported_weights_have_the_modes_of_the_other_files(tmp_path, monkeypatch, umask):
    model = models.create_model(models.get_config("tiny"), seed=0)
    graphdef, params = nnx.split(model)
    policy = SimpleNamespace(graphdef=graphdef, params=lambda: params)
    monkeypatch.setattr(
        export, "load_checkpoint", lambda *a, **k: (SimpleNamespace(policy=policy), 1)
    )
    previous = os.umask(umask)
    try:
        out = export.export_checkpoint(
            TrainConfig(init="random"), tmp_path / "run", tmp_path / "hf"
        )
    finally:
        os.umask(previous)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert modes == {"model.safetensors": 0o666 & ~umask, "config.json": 0o666 & ~umask}
