"""Every field of every component config is settable with ``--set``, reaches its component,
and a bad value fails when the config is shown, with a message naming the field.

`FIELDS` must list exactly the components' fields (a test checks it against the
dataclasses), so a new argument cannot be added without saying how it is observed. A value
is observed in what the run builds (the learner, the optax factories it calls, the sampler,
the generator, the rollout source, the mesh), never read back from the config. Factories
are observed through spies that record the arguments they receive and call the real one.
"""

import dataclasses
import inspect
import json
import typing

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from gac_jax import models
from gac_jax.learner.optimizer import injected_learning_rate
from gac_jax.rollout import OverlongConfig
from gac_jax.train import loop
from gac_jax.train.cli import main
from gac_jax.train.config import TrainConfig, get_preset
from gac_jax.train.config_io import apply_overrides
from gac_jax.transforms import alignment, controlled, ess_scaling

SECTIONS = (
    "optimizer",
    "gac",
    "ess",
    "loss",
    "learner",
    "generation",
    "rollout",
    "placement",
    "ray",
    "buffer",
    "mesh",
    "compute",
    "reward_guard",
)


def _model(built):
    learner = built["run"].learner
    return nnx.merge(learner.graphdef, learner.params)


def _step_arguments(built):
    """The settings the learner's train step is made with (its `LearnerConfig`)."""
    return dataclasses.asdict(built["run"].learner._train_step.args[0].config)


def _guard(built):
    """The settings of the reward the generator scores with (the run's `GuardedReward`)."""
    return built["run"].generator.task.reward.config


def _objective(built):
    return built["run"].learner.objective


def _NoFunction():  # The observed "function" of a run without a correction.
    pass


# key: (value to set, observe(built, config) -> the value the component got, expected,
#       a bad value). `built` holds the run, its rollout source and the spied calls.
def _gac(name):
    return lambda b, _: b["calls"]["gac"][name]


def _gac_wrap(name):
    return lambda b, _: b["calls"]["gac_wrap"][name]


def _ess(name):
    return lambda b, _: b["calls"]["ess"][name]


OPTIMIZER_SPIES = ("adamw", "adafactor", "lion", "sgd")
SCHEDULE_SPIES = ("constant_schedule", "warmup_cosine_decay_schedule", "linear_schedule")


def _spied_among(names):
    return lambda b, _: sorted(name for name in names if name in b["calls"])


def _warmup_cosine(name):
    return lambda b, _: b["calls"]["warmup_cosine_decay_schedule"][name]


def _initial_learning_rate(b, _):
    # The rate the first update will use, as the optimizer state holds it (float32).
    return float(injected_learning_rate(b["run"].learner.opt_state))


FIELDS = {
    "optimizer.name": ("lion", _spied_among(OPTIMIZER_SPIES), ["lion"], "adam"),
    "optimizer.learning_rate": (
        "3e-4",
        _initial_learning_rate,
        float(np.float32(3e-4)),
        "-1",
    ),
    "optimizer.weight_decay": (
        "0.1",
        lambda b, _: b["calls"]["adamw"]["weight_decay"],
        0.1,
        "-0.5",
    ),
    "optimizer.b1": ("0.8", lambda b, _: b["calls"]["adamw"]["b1"], 0.8, "1.5"),
    "optimizer.b2": ("0.99", lambda b, _: b["calls"]["adamw"]["b2"], 0.99, "1.0"),
    "optimizer.clip_norm": ("0.5", lambda b, _: b["calls"]["clip"]["max_norm"], 0.5, "0"),
    "optimizer.momentum": ("0.5", lambda b, _: b["calls"]["sgd"]["momentum"], 0.5, "1.5"),
    "optimizer.schedule": (
        "warmup_linear",
        _spied_among(SCHEDULE_SPIES),
        ["linear_schedule"],
        "cosine",
    ),
    "optimizer.warmup_steps": ("5", _warmup_cosine("warmup_steps"), 5, "-1"),
    "optimizer.decay_steps": ("50", _warmup_cosine("decay_steps"), 50, "0"),
    "optimizer.end_lr_ratio": (
        "0.1",
        lambda b, _: _warmup_cosine("end_value")(b, _) / _warmup_cosine("peak_value")(b, _),
        pytest.approx(0.1),
        "1.5",
    ),
    "gac.tau_low": ("0.3", _gac("tau_low"), 0.3, "0.95"),
    "gac.tau_high": ("0.9", _gac("tau_high"), 0.9, "0.1"),
    "gac.projection": ("full", _gac("projection"), "full", "half"),
    "gac.skip": ("false", _gac("skip"), False, "maybe"),
    "gac.reference": ("ema", _gac("reference"), "ema", "latest"),
    "gac.ema_decay": ("0.5", _gac("ema_decay"), 0.5, "1.5"),
    "gac.scope": ("per_leaf", _gac("scope"), "per_leaf", "per_layer"),
    "gac.thresholds": ("adaptive", _gac("thresholds"), "adaptive", "dynamic"),
    "gac.adaptive_k": ("3.0", _gac("adaptive_k"), 3.0, "-1"),
    "gac.adaptive_decay": ("0.9", _gac("adaptive_decay"), 0.9, "1.0"),
    "gac.adaptive_warmup": ("4", _gac("adaptive_warmup"), 4, "-2"),
    "gac.monitor_only": ("false", _gac("monitor_only"), False, "perhaps"),
    "gac.reference_dtype": ("bfloat16", _gac("reference_dtype"), "bfloat16", "float7"),
    "gac.acts_on": ("update", _gac_wrap("acts_on"), "update", "params"),
    "gac.reference_after_skip": ("held", _gac_wrap("reference_after_skip"), "held", "never"),
    "gac.max_consecutive_skips": ("3", _gac("max_consecutive_skips"), 3, "0"),
    "gac.random_skip_rate": (
        "0.3",
        lambda b, _: b["calls"].get("random_skip", {}).get("rate"),
        0.3,
        "1.5",
    ),
    "gac.random_skip_streak": (
        "2.5",
        lambda b, _: b["calls"].get("random_skip", {}).get("mean_streak"),
        2.5,
        "0.5",
    ),
    "ess.rho_base": ("0.5", _ess("rho_base"), 0.5, "2.0"),
    "ess.power": ("linear", _ess("power"), "linear", "cubic"),
    "ess.ema_decay": ("0.5", _ess("ema_decay"), 0.5, "1.0"),
    "ess.truncation_cap": ("8.0", _ess("truncation_cap"), 8.0, "0"),
    "loss.policy_loss": (
        "cispo",
        lambda b, _: b["run"].learner.objective.spec.fn.__name__,
        "cispo_loss",
        "ppo3",
    ),
    "loss.loss_kwargs": (
        "{eps_high: 0.3}",
        lambda b, _: b["run"].learner.objective.loss_kwargs,
        {"eps_high": 0.3},
        "{eps_hi: 0.3}",
    ),
    "loss.advantage": (
        "rloo",
        lambda b, _: b["run"].learner.objective.advantage_spec.fn.__name__,
        "rloo_advantages",
        "gae",
    ),
    "loss.advantage_kwargs": (
        "{scope: batch}",
        lambda b, _: b["run"].learner.objective.advantage_kwargs,
        {"scope": "batch"},
        "{scope: prompt}",
    ),
    "loss.grad_norm": (
        "length",
        lambda b, _: b["run"].learner.objective.grad_norm,
        "length",
        "approx",
    ),
    "loss.correction": (
        "mis",
        lambda b, _: getattr(b["run"].learner.objective.correct, "func", _NoFunction).__name__,
        "masked_importance_weights",
        "trunc",
    ),
    "loss.correction_kwargs": (
        "{cap: 3.0}",
        lambda b, _: b["run"].learner.objective.correct.keywords,
        {"cap": 3.0},
        "{cup: 3.0}",
    ),
    "learner.micro_batches": ("4", lambda b, _: _step_arguments(b)["micro_batches"], 4, "3"),
    "learner.max_consecutive_nonfinite": (
        "5",
        lambda b, _: _step_arguments(b)["max_consecutive_nonfinite"],
        5,
        "0",
    ),
    "learner.logits_chunk_size": (
        "64",
        lambda b, _: _step_arguments(b)["logits_chunk_size"],
        64,
        "0",
    ),
    "learner.max_tokens_per_micro_batch": (
        "4096",
        lambda b, _: _step_arguments(b)["max_tokens_per_micro_batch"],
        4096,
        "0",
    ),
    "learner.mini_batches": ("2", lambda b, _: _step_arguments(b)["mini_batches"], 2, "0"),
    "learner.epochs": ("2", lambda b, _: _step_arguments(b)["epochs"], 2, "0"),
    "learner.shuffle": ("false", lambda b, _: _step_arguments(b)["shuffle"], False, "maybe"),
    "learner.shuffle_seed": ("7", lambda b, _: _step_arguments(b)["shuffle_seed"], 7, "-1"),
    "learner.noise_scale": (
        "true",
        lambda b, _: _step_arguments(b)["noise_scale"],
        True,
        "sometimes",
    ),
    "learner.policy_change": (
        "true",
        lambda b, _: _step_arguments(b)["policy_change"],
        True,
        "sometimes",
    ),
    "learner.reference_offload": (
        "true",
        lambda b, _: jax.tree.leaves(b["run"].learner.reference)[0].sharding.memory_kind,
        "pinned_host",
        "sometimes",
    ),
    "loss.kl_coef": ("0.1", lambda b, _: _objective(b).config.kl_coef, 0.1, "-1"),
    "loss.kl_estimator": ("k2", lambda b, _: _objective(b).config.kl_estimator, "k2", "k4"),
    "loss.kl_penalty": ("reward", lambda b, _: _objective(b).config.kl_penalty, "reward", "both"),
    "loss.entropy_coef": ("0.01", lambda b, _: _objective(b).config.entropy_coef, 0.01, "-0.1"),
    "generation.group_size": ("4", lambda b, _: b["run"].generator.group_size, 4, "1"),
    "generation.prompt_length": ("40", lambda b, _: b["run"].generator.prompt_length, 40, "0"),
    "generation.max_new_tokens": ("12", lambda b, _: b["run"].sampler.max_new_tokens, 12, "0"),
    "generation.temperature": (
        "0.7",
        lambda b, _: b["run"].generator.sampling["temperature"],
        0.7,
        "0",
    ),
    "generation.top_k": ("5", lambda b, _: b["run"].generator.sampling["top_k"], 5, "-1"),
    "generation.top_p": ("0.9", lambda b, _: b["run"].generator.sampling["top_p"], 0.9, "1.5"),
    "generation.greedy": (
        "true",
        lambda b, _: b["run"].generator.sampling["temperature"],
        0.0,
        "sometimes",
    ),
    "generation.slots": ("4", lambda b, _: getattr(b["run"].sampler, "slots", None), 4, "0"),
    "generation.stop": ('["</a>"]', lambda b, _: b["run"].generator.stop, ("</a>",), '[""]'),
    "generation.overlong": (
        "{filter: true, buffer: 4, penalty: 0.5}",
        lambda b, _: b["run"].generator.overlong,
        OverlongConfig(filter=True, buffer=4, penalty=0.5),
        "{buffer: -1}",
    ),
    "rollout.mode": ("async", lambda b, _: type(b["source"]).__name__, "AsyncRollouts", "never"),
    "rollout.lag": ("3", lambda b, _: b["source"].lag, 3, "-1"),
    "rollout.groups_per_batch": ("4", lambda b, _: b["source"].buffer.groups_per_batch, 4, "0"),
    "rollout.num_workers": ("2", lambda b, _: len(b["source"].worker._threads), 2, "0"),
    "rollout.groups_per_call": ("2", lambda b, _: b["source"].worker._groups_per_call, 2, "0"),
    "rollout.version_choice": (
        "oldest_allowed",
        lambda b, _: b["source"].worker._version_choice,
        "oldest_allowed",
        "newest",
    ),
    "placement.devices": ("4", lambda b, _: len(b["run"].placement.devices), 4, "-1"),
    "placement.tensor_parallel": (
        "2",
        lambda b, _: b["run"].placement.mesh.shape["tensor"],
        2,
        "0",
    ),
    "rollout.backend": (
        "ray",
        lambda b, _: type(b["run"].rollout_pool).__name__,
        "FakePool",
        "mpi",
    ),
    "ray.on_actor_failure": (
        "stop",
        lambda b, _: b["run"].rollout_pool.kwargs["on_actor_failure"],
        "stop",
        "retry",
    ),
    "ray.actor_gpus": (
        "1",
        lambda b, _: (b["run"].rollout_pool.kwargs["actor_options"] or {}).get("num_gpus"),
        1,
        "-1",
    ),
    "rollout.inflight_updates": (
        "true",
        lambda b, _: b["run"].generator.latest_params is not None,
        True,
        "sometimes",
    ),
    "rollout.inflight_chunk_steps": ("4", lambda b, _: b["run"].generator.chunk_steps, 4, "0"),
    "rollout.dynamic_sampling": (
        "true",
        lambda b, _: b["source"].buffer.max_filtered is not None,
        True,
        "often",
    ),
    "rollout.max_draws": ("3", lambda b, _: b["source"].buffer.max_filtered, 16, "0"),
    "buffer.max_staleness": ("3", lambda b, _: b["source"].buffer.max_staleness, 3, "-1"),
    "buffer.stale_policy": ("drop", lambda b, _: b["source"].buffer.stale_policy, "drop", "wait"),
    "buffer.capacity": ("24", lambda b, _: b["source"].buffer.capacity, 24, "0"),
    "buffer.take_timeout": ("30.0", lambda b, _: b["source"]._take_timeout, 30.0, "-1"),
    "mesh.data": ("2", lambda b, _: b["run"].learner.mesh.shape["data"], 2, "0"),
    "reward_guard.timeout": ("2.5", lambda b, _: _guard(b).timeout, 2.5, "0"),
    "reward_guard.failure_score": ("-1.0", lambda b, _: _guard(b).failure_score, -1.0, "nan"),
    "reward_guard.max_failure_fraction": (
        "0.5",
        lambda b, _: _guard(b).max_failure_fraction,
        0.5,
        "2.0",
    ),
    "mesh.fsdp": ("2", lambda b, _: b["run"].learner.mesh.shape["fsdp"], 2, "-2"),
    "mesh.tensor": ("2", lambda b, _: b["run"].learner.mesh.shape["tensor"], 2, "0"),
    "compute.dtype": ("float16", lambda b, _: _model(b).config.dtype, "float16", "int8"),
    "compute.param_dtype": (
        "bfloat16",
        lambda b, _: str(b["run"].learner.params["embedding_vd"][...].dtype),
        "bfloat16",
        "float64",
    ),
    "compute.remat": ("dots", lambda b, _: _model(b).config.remat, "dots", "some"),
}

# Settings a field needs from another section to take effect or to be valid.
CONTEXT = {
    "optimizer.momentum": ["optimizer.name=sgd"],
    "optimizer.warmup_steps": ["optimizer.schedule=warmup_cosine"],
    "optimizer.decay_steps": ["optimizer.schedule=warmup_cosine"],
    "optimizer.end_lr_ratio": ["optimizer.schedule=warmup_cosine"],
    "ess": ["ess={}"],
    "loss.grad_norm": ["loss.advantage=vcpo"],
    "loss.advantage_kwargs": ["loss.advantage=vcpo"],
    "rollout.max_draws": ["rollout.dynamic_sampling=true"],
    "loss.kl_estimator": ["loss.kl_coef=0.1"],
    "loss.kl_penalty": ["loss.kl_coef=0.1"],
    "learner.reference_offload": ["loss.kl_coef=0.1"],
    "learner.noise_scale": ["learner.micro_batches=2"],
    "loss.correction": ["loss.policy_loss=reinforce"],
    "loss.correction_kwargs": ["loss.policy_loss=reinforce", "loss.correction=mis"],
    "rollout.num_workers": ["rollout.mode=async"],
    "gac.random_skip_streak": ["gac.random_skip_rate=0.3"],
    "rollout.groups_per_call": ["rollout.mode=async"],
    "rollout.version_choice": ["rollout.mode=async"],
    "placement.tensor_parallel": ["placement.devices=4"],
    "rollout.backend": ["rollout.mode=async"],
    "ray.on_actor_failure": ["rollout.mode=async", "rollout.backend=ray"],
    "ray.actor_gpus": ["rollout.mode=async", "rollout.backend=ray"],
    "rollout.inflight_updates": ["rollout.mode=async"],
    "buffer": ["rollout.mode=async"],
    "mesh.fsdp": ["mesh.data=-1"],
    "reward_guard": ["reward=lenient"],
    "mesh.tensor": ["mesh.data=-1"],
}
# Settings that are only valid together with the field's new value.
WITH_VALUE = {"generation.greedy": ["generation.temperature=0"]}


def _component_fields():
    hints = typing.get_type_hints(TrainConfig)
    keys = []
    for section in SECTIONS:
        tp = hints[section]
        inner = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
        keys += [f"{section}.{f.name}" for f in dataclasses.fields(inner[0])]
    return keys


def _context(key):
    return [o for prefix, extra in CONTEXT.items() if key.startswith(prefix) for o in extra]


def test_the_table_lists_every_component_field():
    assert sorted(FIELDS) == sorted(_component_fields())


@pytest.fixture(scope="module")
def model():
    return models.create_model(models.get_config("tiny"), seed=0), models.CharTokenizer()


SPIED = {
    "adamw": (optax, "adamw"),
    "adafactor": (optax, "adafactor"),
    "lion": (optax, "lion"),
    "sgd": (optax, "sgd"),
    **{name: (optax.schedules, name) for name in SCHEDULE_SPIES},
    "clip": (optax, "clip_by_global_norm"),
    "gac": (alignment, "gradient_alignment_control"),
    "gac_wrap": (controlled, "alignment_controlled"),
    "random_skip": (controlled, "random_skip"),
    "ess": (ess_scaling, "scale_by_ess"),
}
ORIGINALS = {name: getattr(owner, attribute) for name, (owner, attribute) in SPIED.items()}


def _spied(monkeypatch, calls):
    def record(name, real):
        def spy(*args, **kwargs):
            bound = dict(inspect.signature(real).bind(*args, **kwargs).arguments)
            # The wrapper's monitors (built by gradient_alignment_monitor, no thresholds)
            # are not the configured control.
            if name != "gac" or "tau_low" in bound:
                calls[name] = bound
            return real(*args, **kwargs)

        return spy

    for name, (owner, attribute) in SPIED.items():
        monkeypatch.setattr(owner, attribute, record(name, ORIGINALS[name]))


class FakePool:
    """Stands in for `RayRolloutPool` (no Ray cluster is started): records its arguments."""

    def __init__(self, factory, num_actors, **kwargs):
        self.factory, self.num_actors, self.kwargs = factory, num_actors, kwargs
        self.replacements = 0

    def __call__(self, params, version, requests, key):
        raise AssertionError("nothing is published, so nothing is generated")

    def close(self):
        pass


def _build(config, model, monkeypatch):
    import ray

    from gac_jax.rollout import ray_rollouts
    from gac_jax.train import build

    calls = {}
    _spied(monkeypatch, calls)
    monkeypatch.setattr(build, "build_model", lambda config, mesh, **kwargs: model)
    monkeypatch.setattr(ray_rollouts, "RayRolloutPool", FakePool)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    run = loop.build_run(config)
    # No version is published, so the async source's workers wait and generate nothing.
    run.start()
    source = run.source
    try:
        return {"run": run, "source": source, "calls": calls}
    finally:
        source.close()


@pytest.mark.slow
@pytest.mark.parametrize("key", sorted(FIELDS))
def test_each_field_reaches_its_component(key, model, monkeypatch):
    value, observe, expected, _ = FIELDS[key]
    base = apply_overrides(
        TrainConfig(init="random", eval_every=0, checkpoint_every=0), _context(key)
    )
    config = apply_overrides(base, [*WITH_VALUE.get(key, []), f"{key}={value}"])
    built = _build(config, model, monkeypatch)
    assert observe(built, config) == expected
    # The default reaches it too, and differs: the observation is of this field.
    assert observe(_build(base, model, monkeypatch), base) != expected


@pytest.mark.parametrize("key", sorted(FIELDS))
def test_a_bad_value_fails_at_show_config_naming_the_field(key, capsys):
    bad = FIELDS[key][3]
    argv = ["show-config", "--config", "countdown_sync", "--set", *_context(key), f"{key}={bad}"]
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    # The whole dotted key, or the field with this bad value (a check of two fields, such
    # as tau_low < tau_high, leads with the other one), so the message is about this field.
    named = key in err or f"{key.split('.')[-1]}={bad}" in err
    assert named and "Traceback" not in err, err


@pytest.mark.parametrize(
    ("config_type", "factory"),
    [
        (controlled.GACConfig, ORIGINALS["gac"]),
        (ess_scaling.ESSConfig, ORIGINALS["ess"]),
    ],
)
def test_transform_configs_mirror_their_factories_one_to_one(config_type, factory):
    # Same names, same defaults: an argument added to the factory must be added here, and
    # is then settable with --set (the walk above) with no change to the loop.
    params = dict(inspect.signature(factory).parameters)
    if config_type is controlled.GACConfig:  # And where the wrapper puts it.
        wrapper = inspect.signature(ORIGINALS["gac_wrap"]).parameters
        params.update({name: wrapper[name] for name in controlled.WRAPPER_FIELDS})
        # And `random_skip`'s rate and mean streak, off (0, None) by default.
        skipper = inspect.signature(ORIGINALS["random_skip"]).parameters
        assert {"rate", "mean_streak"} <= set(skipper)
    fields = {f.name: f.default for f in dataclasses.fields(config_type)}
    fields = {k: v for k, v in fields.items() if k not in controlled.RANDOM_SKIP_FIELDS}
    assert fields == {name: p.default for name, p in params.items()}


def _hf_dir(path, preset):
    """A checkpoint directory's config.json (no weights: validation reads only this)."""
    path.mkdir()
    hf = models.config_to_hf(models.get_config(preset))
    (path / "config.json").write_text(json.dumps(hf))
    return str(path)


def test_model_must_be_the_architecture_of_an_hf_init(tmp_path):
    tiny = _hf_dir(tmp_path / "tiny", "tiny")
    base = TrainConfig(task="arithmetic/add2", init=tiny)
    base.validate()  # The default model: the checkpoint's own architecture.
    dataclasses.replace(base, model="tiny").validate()
    message = (
        r"model='tiny_llama' is not the architecture of init='.*tiny' "
        r"\(model vs checkpoint: family llama vs qwen3"
    )
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(base, model="tiny_llama").validate()
    with pytest.raises(ValueError, match="model='qwen3_0_6b' is not the architecture"):
        dataclasses.replace(base, model="qwen3_0_6b").validate()
    qwen = _hf_dir(tmp_path / "qwen", "qwen3_0_6b")
    dataclasses.replace(base, model="qwen3_0_6b", init=qwen).validate()
    with pytest.raises(ValueError, match="model='qwen3_1_7b' is not the architecture"):
        dataclasses.replace(base, model="qwen3_1_7b", init=qwen).validate()


def test_a_random_model_must_stop_within_the_character_tokenizer(capsys, monkeypatch):
    # Random weights run on the character tokenizer (no checkpoint, no tokenizer): Qwen3's
    # EOS id 151645 is one it can never sample, so every completion would run to the end.
    # A model without EOS ids stops at the tokenizer's own (the sampler's fallback).
    no_eos = models.get_config("tiny").replace(eos_token_ids=())
    monkeypatch.setitem(models.config.PRESETS, "tiny_no_eos", no_eos)
    for model in ("tiny", "tiny_llama", "small", "tiny_no_eos"):
        TrainConfig(task="arithmetic/add2", init="random", model=model).validate()
    with pytest.raises(ValueError, match=r"model='qwen3_0_6b' with init=random: its EOS id 151645"):
        TrainConfig(task="arithmetic/add2", init="random", model="qwen3_0_6b").validate()
    argv = ["show-config", "--set", "init=random", "model=llama3_2_1b"]
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "use a small preset (model=tiny or small)" in err[0]


@pytest.mark.parametrize(
    ("preset", "directory", "repo"),
    [
        ("qwen3_0_6b_gsm8k", "checkpoints/Qwen3-0.6B", "Qwen/Qwen3-0.6B"),
        ("qwen3_1_7b_gsm8k", "checkpoints/Qwen3-1.7B", "Qwen/Qwen3-1.7B"),
    ],
)
def test_the_qwen_presets_train_their_downloaded_checkpoint(
    preset, directory, repo, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)  # No checkpoints/ here.
    config = get_preset(preset)  # Valid without it: `plan` and `show-config` work.
    assert config.init == directory
    with pytest.raises(SystemExit) as e:
        # Another task: the GSM8K files are checked first (and are not here either).
        main(["train", "--config", preset, "--set", "task=arithmetic/add2", "--out", "run"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert f"init={directory} does not exist: download {repo} there" in err[-1]
    assert not any("Traceback" in line for line in err)
    # Downloaded (here: its config.json), the directory is the run's init.
    (tmp_path / "checkpoints").mkdir()
    _hf_dir(tmp_path / directory, config.model)
    assert apply_overrides(config, ["steps=3"]).init == directory
