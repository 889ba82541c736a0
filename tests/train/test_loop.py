"""The training loop end to end: lagged resume reproduces an uninterrupted run exactly."""

import dataclasses
import json
import time

import jax
import numpy as np
import pytest

from gac_jax import models
from gac_jax.learner import LossConfig
from gac_jax.models import MeshConfig
from gac_jax.rollout import GenerationConfig, PromptOrder, RolloutConfig
from gac_jax.train import build, loop
from gac_jax.train import run as run_lib
from gac_jax.train.checkpoint import restore_checkpoint
from gac_jax.train.config import TrainConfig
from gac_jax.train.config_io import apply_overrides
from gac_jax.train.metrics import read_metrics
from gac_jax.transforms import GACConfig

# Metrics that depend on wall-clock time or thread timing (how full the buffer happened to
# be when the learner took its batch).
TIMING = ("per_s", "seconds", "wait", "buffer_depth")


def _config(tmp_path, steps):
    return TrainConfig(
        task="arithmetic/add2",
        data_dir=str(tmp_path / "tfds"),
        init="random",
        steps=steps,
        eval_every=3,
        eval_size=4,
        eval_samples=2,
        checkpoint_every=3,
        keep_checkpoints=2,
        rollout=RolloutConfig(mode="lagged", lag=2, groups_per_batch=2),
        generation=GenerationConfig(group_size=2, prompt_length=12, max_new_tokens=5),
        mesh=MeshConfig(data=1),
    )


def _comparable(records):
    return [{k: v for k, v in r.items() if not any(t in k for t in TIMING)} for r in records]


_STRAIGHT_RUNS = {}  # One uninterrupted run per mode, shared by its stop points.


def _stop_and_resume(tmp_path, make_config, stop, steps=6):
    """An uninterrupted run of `steps` and one stopped after `stop` steps (its last
    checkpoint) then resumed to `steps`; returns both run directories."""
    name = make_config(steps).rollout.mode
    if name not in _STRAIGHT_RUNS:
        _STRAIGHT_RUNS[name] = loop.train(make_config(steps), tmp_path / "straight")
    straight = _STRAIGHT_RUNS[name]
    loop.train(make_config(stop), tmp_path / "resumed")
    resumed = loop.train(make_config(steps), tmp_path / "resumed", resume=True)
    return straight, resumed


def _assert_same_runs(straight, resumed, steps=6):
    a, b = read_metrics(straight / "metrics.jsonl"), read_metrics(resumed / "metrics.jsonl")
    assert [r["step"] for r in b] == list(range(steps))
    assert _comparable(a) == _comparable(b)
    assert any(r["grad_norm"] > 0 for r in a)  # Something was learned and compared.
    params_a = restore_checkpoint(straight / "checkpoints").state["params"]
    params_b = restore_checkpoint(resumed / "checkpoints").state["params"]
    for x, y in zip(jax_leaves(params_a), jax_leaves(params_b), strict=True):
        np.testing.assert_array_equal(x, y)
    return a


@pytest.mark.slow
@pytest.mark.parametrize("stop", [3, 4])
def test_lagged_resume_reproduces_the_uninterrupted_run(tmp_path, digit_task, stop):
    straight, resumed = _stop_and_resume(tmp_path, lambda n: _config(tmp_path, n), stop)
    a = _assert_same_runs(straight, resumed)
    assert [r["version_gap_max"] for r in a] == [0, 1, 2, 2, 2, 2]
    assert (straight / "plot.png").stat().st_size > 0
    assert json.loads((straight / "config.json").read_text())["rollout"]["lag"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("stop", [2, 3])
def test_one_worker_async_resume_reproduces_the_uninterrupted_run(tmp_path, digit_task, stop):
    # "oldest_allowed" fixes each group's version by its slot, so one worker is
    # deterministic; with "latest" thread timing picks the version and no two runs agree.
    def make_config(steps):
        config = _async_config(tmp_path, steps, workers=1)
        return apply_overrides(config, ["rollout.version_choice=oldest_allowed"])

    straight, resumed = _stop_and_resume(tmp_path, make_config, stop)
    a = _assert_same_runs(straight, resumed)
    assert [r["version_gap_max"] for r in a] == [0, 1, 1, 1, 1, 1]
    assert all(r["buffer_dropped"] == 0 for r in a)


def jax_leaves(tree):
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_resume_refuses_a_different_config(tmp_path, digit_task):
    loop.train(dataclasses.replace(_config(tmp_path, 1), eval_every=0), tmp_path / "run")
    written = (tmp_path / "run" / "config.json").read_text()
    other = dataclasses.replace(_config(tmp_path, 2), eval_every=0, seed=7)
    with pytest.raises(ValueError, match=r"different config \(seed changed\); only steps, "):
        loop.train(other, tmp_path / "run", resume=True)
    # A fresh run into a directory that holds one is refused before it trains; neither
    # refusal overwrites the run's config.
    with pytest.raises(loop.RunExistsError, match="holds a run .checkpoints, metrics.jsonl"):
        loop.train(other, tmp_path / "run")
    assert (tmp_path / "run" / "config.json").read_text() == written
    # Steps and the evaluation cadence may change on resume.
    longer = dataclasses.replace(_config(tmp_path, 2), eval_every=1, eval_size=2)
    loop.train(longer, tmp_path / "run", resume=True)
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [0, 1]


def test_a_run_without_checkpoints_is_not_overwritten_unless_asked(tmp_path, digit_task):
    config = dataclasses.replace(_config(tmp_path, 1), eval_every=0, checkpoint_every=0)
    loop.train(config, tmp_path / "run")
    assert not (tmp_path / "run" / "checkpoints").exists() or not any(
        (tmp_path / "run" / "checkpoints").iterdir()
    )
    with pytest.raises(loop.RunExistsError, match="holds a run .*metrics.jsonl"):
        loop.train(config, tmp_path / "run")
    (tmp_path / "run" / "metrics.jsonl").write_text("")
    loop.train(config, tmp_path / "run", overwrite=True)
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [0]


@pytest.mark.parametrize(
    "change, fragment",
    [
        (dict(generation=GenerationConfig(group_size=1)), "generation.group_size=1"),
        (dict(mesh=MeshConfig(data=16)), "does not divide the 8 devices"),
        (dict(mesh=MeshConfig(data=8)), "not divisible by the 8 devices of the mesh"),
        (dict(loss=LossConfig(policy_loss="ppo3")), "Unknown policy loss 'ppo3'"),
        (dict(gac=GACConfig(tau_low=0.9, tau_high=0.3)), "tau_low=0.9"),
    ],
)
def test_config_errors_are_clear(tmp_path, digit_task, change, fragment):
    config = dataclasses.replace(_config(tmp_path, 1), eval_every=0, **change)
    with pytest.raises(ValueError, match=fragment):
        loop.train(config, tmp_path / "bad")


def test_eval_at_start_logs_the_initial_policys_evaluation(tmp_path, digit_task, capsys):
    config = dataclasses.replace(
        _config(tmp_path, 2), eval_at_start=True, eval_every=2, checkpoint_every=0
    )
    loop.train(config, tmp_path / "run")
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    initial = {k.removeprefix("eval_start/"): v for k, v in records[0].items() if "start/" in k}
    fresh = run_lib.build_run(config)  # The same init (seeded), before any update.
    expected = fresh.evaluate(jax.random.key(config.seed + 3))
    assert initial == {k.removeprefix("eval/"): v for k, v in expected.items()}
    assert "pass@1" in initial and not any("eval_start/" in k for r in records[1:] for k in r)
    # Every evaluation is printed too, with the record's numbers.
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("eval ")]
    last = {k.removeprefix("eval/"): v for k, v in records[1].items() if k.startswith("eval/")}
    assert said == [
        "eval before the first step: " + " ".join(f"{k} {v:.3f}" for k, v in initial.items()),
        "eval at step 1 (after 2 updates): " + " ".join(f"{k} {v:.3f}" for k, v in last.items()),
    ]


def test_a_warm_start_shorter_than_its_warm_up_is_refused(tmp_path):
    config = dataclasses.replace(_config(tmp_path, 1), init="warm_start", warm_start_steps=50)
    with pytest.raises(ValueError, match="warm_start_steps=50 must be an int >= 101"):
        config.validate()
    from gac_jax.train.config import WARM_START_WARMUP
    from gac_jax.train.warm_start import WarmStartConfig

    assert WARM_START_WARMUP == WarmStartConfig().warmup_steps


def test_warm_start_init_asks_for_the_warm_start_of_the_task_and_model(monkeypatch):
    import importlib

    warm_start = importlib.import_module("gac_jax.train.warm_start")  # Not the function.
    asked, steps = [], []

    def fake_ensure(config, *, data_dir=None):
        asked.append((config.task, config.model, data_dir))
        steps.append(config.steps)
        return warm_start.SHIPPED_WARM_START_DIR

    monkeypatch.setattr(warm_start, "ensure_warm_start", fake_ensure)
    config = TrainConfig(task="arithmetic/add3", model="tiny", data_dir="/data")
    model, tokenizer = build.build_model(config, models.make_mesh(1, 1, 1))
    assert asked == [("arithmetic/add3", "tiny", "/data")] and steps == [800]
    # A shorter warm start is its own (cached) checkpoint.
    build.build_model(dataclasses.replace(config, warm_start_steps=300), models.make_mesh(1, 1, 1))
    assert steps == [800, 300]
    assert model.config == models.get_config("tiny") and tokenizer.pad_id is not None
    # The default task and model are served by the shipped checkpoint, untrained.
    shipped = warm_start.WarmStartConfig(task=TrainConfig().task, model=TrainConfig().model)
    assert warm_start.config_hash(shipped) == warm_start.config_hash(warm_start.WarmStartConfig())


def _async_config(tmp_path, steps, workers):
    config = dataclasses.replace(_config(tmp_path, steps), eval_every=0, checkpoint_every=3)
    return apply_overrides(
        config, ["rollout.mode=async", f"rollout.num_workers={workers}", "buffer.max_staleness=1"]
    )


@pytest.mark.slow
@pytest.mark.parametrize("stop", [2, 3])
def test_async_resume_reuses_no_group_and_keeps_the_bound(tmp_path, digit_task, monkeypatch, stop):
    consumed = []
    real_collate = run_lib.collate

    def recording_collate(rollouts, prompt_length, *overlong):
        consumed.extend((r.group_id, r.prompt_id) for r in rollouts)
        time.sleep(0.5)  # A slow learner: the workers run ahead to the staleness bound.
        return real_collate(rollouts, prompt_length, *overlong)

    monkeypatch.setattr(run_lib, "collate", recording_collate)
    first = dataclasses.replace(_async_config(tmp_path, stop, workers=2), checkpoint_every=stop)
    loop.train(first, tmp_path / "run")
    loop.train(_async_config(tmp_path, 6, workers=2), tmp_path / "run", resume=True)
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(6))
    ids = [g for g, _ in consumed]
    assert len(ids) == len(set(ids)) == 6 * 2  # No group trained twice.
    order = PromptOrder(
        len(digit_task.data_source("train", data_dir=str(tmp_path / "tfds"))), seed=0
    )
    assert all(p == order.prompt_id(g) for g, p in consumed)  # Each id keeps its prompt.
    assert max(r["version_gap_max"] for r in records) <= 1
    # Two workers finishing out of order make the block policy drop a group now and then
    # (a later slot consumed first), resumed or not: 0 or 1 in 6 steps when measured. A
    # resume that forgot the buffer's reservation count let the workers run ahead with old
    # versions: 4 drops in the 3 steps after the resume.
    assert records[-1]["buffer_dropped"] <= 2


def test_hooks_run_at_their_cadence_in_order_and_at_the_end():
    calls = []
    hooks = loop.Hooks()
    hooks.add(lambda info: calls.append(("every2", info.step)), every=2)
    hooks.add(lambda info: calls.append(("end", info.step)), every=0, at_end=True)
    hooks.add(lambda info: calls.append(("ckpt", info.step)), every=3, at_end=True)
    for step in range(5):
        hooks(loop.StepInfo(None, step, {}, [], last=step == 4))
    assert calls == [
        ("every2", 1),
        ("ckpt", 2),
        ("every2", 3),
        ("end", 4),
        ("ckpt", 4),
    ]


def test_a_checkpoints_evaluation_draws_what_the_runs_own_did(tmp_path, digit_task):
    # digit_share scores partial answers, so the sampled reward is a fine-grained number
    # that other draws would change.
    config = dataclasses.replace(_config(tmp_path, 3), eval_every=3, checkpoint_every=3)
    loop.train(config, tmp_path / "run")
    own = read_metrics(tmp_path / "run" / "metrics.jsonl")[-1]
    standalone = run_lib.evaluate_checkpoint(config, tmp_path / "run", step=3)
    assert own["eval/sampled_reward"] > 0
    for name in ("eval/sampled_reward", "eval/pass@1", "eval/greedy_accuracy"):
        assert standalone[name] == own[name], name
    run, _ = run_lib.load_checkpoint(config, tmp_path / "run", step=3)
    draws = {
        run.evaluate(run_lib.evaluation_key(config.seed, n))["eval/sampled_reward"]
        for n in range(1, 9)
    }
    assert len(draws) > 1, draws  # Other draws give other scores: the match means something.
