"""Tests of configs to and from YAML/JSON and of ``--set`` overrides (draccus underneath)."""

import dataclasses
import json

import pytest

from gac_jax.train.config import TrainConfig, get_preset, preset_names
from gac_jax.train.config_io import (
    apply_overrides,
    config_from_dict,
    config_hash,
    config_to_dict,
    load_config,
    parse_value,
    save_config,
    to_yaml,
)


@pytest.mark.parametrize(
    ("override", "get", "expected"),
    [
        ("rollout.lag=8", lambda c: c.rollout.lag, 8),
        ("mesh.data=-1", lambda c: c.mesh.data, -1),
        ("gac.monitor_only=false", lambda c: c.gac.monitor_only, False),
        ("gac.skip=no", lambda c: c.gac.skip, False),
        ("optimizer.learning_rate=3e-4", lambda c: c.optimizer.learning_rate, 3e-4),
        ("optimizer.learning_rate=1", lambda c: c.optimizer.learning_rate, 1.0),
        ("optimizer.clip_norm=none", lambda c: c.optimizer.clip_norm, None),
        ("optimizer.clip_norm=Null", lambda c: c.optimizer.clip_norm, None),
        ("optimizer.clip_norm=0.5", lambda c: c.optimizer.clip_norm, 0.5),
        ("buffer.max_staleness=3", lambda c: c.buffer.max_staleness, 3),
        ("buffer.stale_policy=drop", lambda c: c.buffer.stale_policy, "drop"),
        ("data_dir=/tmp/tfds", lambda c: c.data_dir, "/tmp/tfds"),
        ("data_dir=none", lambda c: c.data_dir, None),
        ("rollout.mode=sync", lambda c: c.rollout.mode, "sync"),
        ("ess.power=linear", lambda c: c.ess.power, "linear"),
        ("ess.power=0.25", lambda c: c.ess.power, 0.25),
        ("gac.reference_dtype=bfloat16", lambda c: c.gac.reference_dtype, "bfloat16"),
    ],
)
def test_each_type_is_parsed(override, get, expected):
    config = apply_overrides(TrainConfig(), [override])
    value = get(config)
    assert value == expected
    assert type(value) is type(expected)


def test_overrides_do_not_change_the_input_and_later_ones_win():
    base = TrainConfig()
    config = apply_overrides(base, ["rollout.lag=2", "seed=5", "rollout.lag=4"])
    assert (config.rollout.lag, config.seed) == (4, 5)
    assert (base.rollout.lag, base.seed) == (0, 0)
    # The other fields of the section are kept.
    assert config.rollout.groups_per_batch == base.rollout.groups_per_batch


def test_an_optional_section_is_switched_on_and_off():
    assert TrainConfig().ess is None
    on = apply_overrides(TrainConfig(), ["ess={}"])
    assert on.ess is not None and on.ess.rho_base == 1.0
    tuned = apply_overrides(TrainConfig(), ["ess.rho_base=0.5"])
    assert tuned.ess.rho_base == 0.5 and tuned.ess.power == "sqrt"
    assert apply_overrides(tuned, ["ess=none"]).ess is None


def test_dict_entries():
    config = apply_overrides(
        TrainConfig(), ["loss.policy_loss=m2po", "loss.loss_kwargs.tau_m2=0.05"]
    )
    assert config.loss.loss_kwargs == {"tau_m2": 0.05}
    config = apply_overrides(config, ["loss.loss_kwargs.variant=harmful_budget"])
    assert config.loss.loss_kwargs == {"tau_m2": 0.05, "variant": "harmful_budget"}


def test_parse_value():
    assert parse_value("1e-3") == pytest.approx(1e-3)
    assert parse_value("FALSE") is False
    assert parse_value("null") is None and parse_value("None") is None
    assert parse_value("sqrt") == "sqrt"
    assert parse_value("{}") == {}


def test_unknown_key_names_it_and_lists_the_section():
    with pytest.raises(ValueError) as e:
        apply_overrides(TrainConfig(), ["rollout.lagg=8"])
    message = str(e.value)
    assert "Unknown config key 'rollout.lagg'" in message
    assert "rollout.lag," in message and "rollout.groups_per_batch" in message
    assert "Did you mean 'rollout.lag'" in message

    with pytest.raises(ValueError, match="Valid keys of section 'optimizer'") as e:
        apply_overrides(TrainConfig(), ["optimizer.lr=1"])
    assert "optimizer.learning_rate" in str(e.value)

    with pytest.raises(ValueError, match="'nosuch'") as e:
        apply_overrides(TrainConfig(), ["nosuch=1"])
    assert "steps" in str(e.value) and "rollout.*" in str(e.value)
    with pytest.raises(ValueError, match=r"'ess\.rhob'.*Did you mean 'ess\.rho_base'"):
        apply_overrides(TrainConfig(), ["ess.rhob=1"])


@pytest.mark.parametrize(
    ("override", "key", "value"),
    [
        ("rollout.lag=eight", "rollout.lag", "eight"),
        ("rollout.lag=1.5", "rollout.lag", "1.5"),
        ("gac.skip=maybe", "gac.skip", "maybe"),
        ("optimizer.learning_rate=fast", "optimizer.learning_rate", "fast"),
        ("optimizer.clip_norm=off", "optimizer.clip_norm", "off"),
        ("steps=true", "steps", "True"),
    ],
)
def test_ill_typed_value_names_key_and_value(override, key, value):
    with pytest.raises(ValueError) as e:
        apply_overrides(TrainConfig(), [override])
    message = str(e.value)
    assert f"'{key}'" in message and value in message


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("rollout.lag", "Override 'rollout.lag' is not of the form key=value"),
        ("=3", "Override '=3' is not of the form key=value"),
        ("rollout=3", "'rollout' is a section"),
    ],
)
def test_malformed_overrides(override, needle):
    with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
        apply_overrides(TrainConfig(), [override])


@pytest.mark.parametrize("name", preset_names())
def test_round_trip_through_json_and_yaml(name, tmp_path):
    config = apply_overrides(
        get_preset(name),
        ["loss.policy_loss=m2po", "loss.loss_kwargs.tau_m2=0.04", "optimizer.clip_norm=none"],
    )
    d = json.loads(json.dumps(config_to_dict(config)))
    assert d["rollout"]["mode"] == config.rollout.mode
    assert config_from_dict(d) == config
    assert load_config(save_config(config, tmp_path / "c.yaml")) == config
    assert load_config(save_config(config, tmp_path / "c.json")) == config
    assert "loss_kwargs:\n    tau_m2: 0.04" in to_yaml(config)


def test_config_from_dict_is_strict():
    with pytest.raises(ValueError, match="'rollout.lagg'"):
        config_from_dict({"rollout": {"lagg": 1}})
    with pytest.raises(ValueError, match="'extra'"):
        config_from_dict({"extra": 1})
    with pytest.raises(ValueError, match="'rollout' is a section"):
        config_from_dict({"rollout": 3})
    # Ints are floats; missing fields keep their defaults.
    config = config_from_dict({"optimizer": {"learning_rate": 1}})
    assert config.optimizer.learning_rate == 1.0
    assert type(config.optimizer.learning_rate) is float
    assert dataclasses.replace(config, optimizer=TrainConfig().optimizer) == TrainConfig()


def test_load_config_preset_and_files(tmp_path):
    assert load_config("countdown_sync") == get_preset("countdown_sync")
    path = tmp_path / "mine.yaml"
    path.write_text("base: demo\nsteps: 7\nbuffer:\n  max_staleness: 3\n")
    config = load_config(path)
    demo = get_preset("demo")
    assert config.steps == 7 and config.buffer.max_staleness == 3
    # Fields not in the file come from the base preset, not from the TrainConfig defaults.
    assert config.rollout.mode == demo.rollout.mode == "async"
    assert not config.gac.monitor_only
    assert config.rollout.groups_per_call == demo.rollout.groups_per_call
    as_json = tmp_path / "mine.json"
    as_json.write_text(json.dumps({"base": "demo", "steps": 7, "buffer": {"max_staleness": 3}}))
    assert load_config(as_json) == config


def test_load_config_errors(tmp_path):
    with pytest.raises(ValueError, match="'nosuch'.*countdown_sync"):
        load_config("nosuch")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json is not valid json"):
        load_config(bad)
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("base: demo\ngac:\n  tau: 1\n")
    with pytest.raises(ValueError, match="'gac.tau'"):
        load_config(wrong)
    listed = tmp_path / "list.yaml"
    listed.write_text("- 1\n")
    with pytest.raises(ValueError, match="must hold a mapping"):
        load_config(listed)
    unknown_base = tmp_path / "base.json"
    unknown_base.write_text(json.dumps({"base": "nosuch"}))
    with pytest.raises(ValueError, match="Unknown config preset 'nosuch'"):
        load_config(unknown_base)


def test_importance_correction_is_validated_and_takes_its_arguments():
    config = apply_overrides(
        get_preset("countdown_sweep"),
        ["loss.correction=tis", "loss.correction_kwargs.level=sequence"],
    )
    assert config.loss.correction == "tis"
    assert config.loss.correction_kwargs == {"level": "sequence"}
    off = apply_overrides(config, ["loss.correction=none", "loss.correction_kwargs={}"])
    assert off.loss.correction is None
    with pytest.raises(ValueError, match="Unknown importance correction 'trunc'"):
        apply_overrides(config, ["loss.correction=trunc"])
    with pytest.raises(ValueError, match="correction_kwargs.cup is not an argument"):
        apply_overrides(config, ["loss.correction_kwargs.cup=2"])
    with pytest.raises(ValueError, match="needs a policy loss that takes is_weights"):
        apply_overrides(config, ["loss.policy_loss=cispo"])


def test_init_is_a_mode_or_a_checkpoint_directory(tmp_path):
    base = get_preset("countdown_sweep")
    assert apply_overrides(base, [f"init={tmp_path}"]).init == str(tmp_path)
    with pytest.raises(ValueError, match="init='warm'.*nor an existing directory"):
        apply_overrides(base, ["init=warm"])


def test_config_hash_ignores_only_the_excluded_fields():
    base = get_preset("countdown_sweep")
    longer = apply_overrides(base, ["steps=999"])
    assert config_hash(base, exclude=("steps",)) == config_hash(longer, exclude=("steps",))
    assert config_hash(base) != config_hash(longer)
    other = apply_overrides(base, ["gac.adaptive_k=3"])
    assert config_hash(base, exclude=("steps",)) != config_hash(other, exclude=("steps",))
    assert len(config_hash(base)) == 16


def test_a_bare_string_for_a_sequence_field_is_one_item():
    config = apply_overrides(TrainConfig(), ["generation.stop=</answer>", "lora.targets=q_proj"])
    assert config.generation.stop == ("</answer>",)
    assert config.lora.targets == ("q_proj",)
    config = apply_overrides(TrainConfig(), ['generation.stop=["a", "</b>"]'])
    assert config.generation.stop == ("a", "</b>")


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("rollout.devices=2", "placement.devices"),
        ("rollout.tensor_parallel=2", "placement.tensor_parallel"),
        ("rollout.on_actor_failure=stop", "ray.on_actor_failure"),
        ("rollout.actor_gpus=1", "ray.actor_gpus"),
        ("generation.sampler=refill", "generation.slots"),
    ],
)
def test_a_moved_key_names_its_replacement(old, new):
    with pytest.raises(ValueError, match=rf"^'{old.split('=')[0]}' is now {new}") as error:
        apply_overrides(TrainConfig(), [old])
    assert "\n" not in str(error.value)
    # A file with the old key says the same.
    section, key = old.split("=")[0].split(".")
    with pytest.raises(ValueError, match=f"is now {new}"):
        config_from_dict({section: {key: 2}})
