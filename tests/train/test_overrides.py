"""Tests of dotted-name overrides and of configs to and from JSON."""

import dataclasses
import json

import pytest

from gac_jax.train.config import TrainConfig, get_preset, preset_names
from gac_jax.train.overrides import (
    apply_overrides,
    config_from_dict,
    config_to_dict,
    load_config,
    parse_entry_value,
    save_config,
)


@pytest.mark.parametrize(
    ("override", "get", "expected"),
    [
        ("rollout.lag=8", lambda c: c.rollout.lag, 8),
        ("mesh.data=-1", lambda c: c.mesh.data, -1),
        ("gac.enabled=true", lambda c: c.gac.enabled, True),
        ("gac.enabled=Yes", lambda c: c.gac.enabled, True),
        ("gac.skip=0", lambda c: c.gac.skip, False),
        ("gac.skip=no", lambda c: c.gac.skip, False),
        ("optimizer.learning_rate=3e-4", lambda c: c.optimizer.learning_rate, 3e-4),
        ("optimizer.learning_rate=1", lambda c: c.optimizer.learning_rate, 1.0),
        ("optimizer.clip_norm=none", lambda c: c.optimizer.clip_norm, None),
        ("optimizer.clip_norm=Null", lambda c: c.optimizer.clip_norm, None),
        ("optimizer.clip_norm=0.5", lambda c: c.optimizer.clip_norm, 0.5),
        ("rollout.max_staleness=none", lambda c: c.rollout.max_staleness, None),
        ("rollout.max_staleness=3", lambda c: c.rollout.max_staleness, 3),
        ("task=countdown/other", lambda c: c.task, "countdown/other"),
        ("data_dir=/tmp/tfds", lambda c: c.data_dir, "/tmp/tfds"),
        ("data_dir=none", lambda c: c.data_dir, None),
        ("rollout.mode=sync", lambda c: c.rollout.mode, "sync"),
        ("steps = 7", lambda c: c.steps, 7),
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
    assert config.rollout.group_size == base.rollout.group_size


def test_dict_entries():
    config = apply_overrides(
        TrainConfig(),
        [
            "objective.loss_kwargs.tau_m2=0.04",
            "objective.loss_kwargs.n=3",
            "objective.loss_kwargs.flag=true",
            "objective.loss_kwargs.off=none",
            "objective.loss_kwargs.name=token",
        ],
    )
    assert config.objective.loss_kwargs == {
        "tau_m2": 0.04,
        "n": 3,
        "flag": True,
        "off": None,
        "name": "token",
    }
    assert type(config.objective.loss_kwargs["n"]) is int
    # The default dict is not mutated in place.
    assert TrainConfig().objective.loss_kwargs == {}
    whole = apply_overrides(config, ['objective.loss_kwargs={"eps_low": 0.1}'])
    assert whole.objective.loss_kwargs == {"eps_low": 0.1}


def test_parse_entry_value():
    assert parse_entry_value("1e-3") == pytest.approx(1e-3)
    assert parse_entry_value("FALSE") is False
    assert parse_entry_value("null") is None
    assert parse_entry_value("sqrt") == "sqrt"


def test_unknown_key_names_it_and_lists_the_section():
    with pytest.raises(ValueError) as e:
        apply_overrides(TrainConfig(), ["rollout.lagg=8"])
    message = str(e.value)
    assert "rollout.lagg" in message
    assert "rollout.lag" in message and "rollout.group_size" in message
    assert "Did you mean 'rollout.lag'" in message

    with pytest.raises(ValueError, match="'nosuch'") as e:
        apply_overrides(TrainConfig(), ["nosuch=1"])
    assert "steps" in str(e.value) and "rollout.*" in str(e.value)

    with pytest.raises(ValueError, match="'nosuch.lag'"):
        apply_overrides(TrainConfig(), ["nosuch.lag=1"])


@pytest.mark.parametrize(
    ("override", "key", "expected"),
    [
        ("rollout.lag=eight", "rollout.lag", "int"),
        ("rollout.lag=1.5", "rollout.lag", "int"),
        ("gac.enabled=maybe", "gac.enabled", "bool"),
        ("optimizer.learning_rate=fast", "optimizer.learning_rate", "float"),
        ("optimizer.learning_rate=nan", "optimizer.learning_rate", "finite float"),
        ("optimizer.clip_norm=off", "optimizer.clip_norm", "float"),
        ("objective.loss_kwargs=[1]", "objective.loss_kwargs", "JSON object"),
    ],
)
def test_ill_typed_value_names_key_value_and_type(override, key, expected):
    value = override.partition("=")[2]
    with pytest.raises(ValueError) as e:
        apply_overrides(TrainConfig(), [override])
    message = str(e.value)
    assert f"'{key}'" in message and repr(value) in message and expected in message


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("rollout.lag", "Malformed override 'rollout.lag'"),
        ("=3", "Malformed override '=3'"),
        ("rollout=3", "'rollout' is a section"),
        ("rollout.lag.x=3", "'rollout.lag' is a int field"),
        ("objective.loss_kwargs.a.b=3", "'objective.loss_kwargs' is a dict"),
    ],
)
def test_malformed_overrides(override, needle):
    with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
        apply_overrides(TrainConfig(), [override])


def test_result_is_validated():
    with pytest.raises(ValueError, match="rollout.group_size=1"):
        apply_overrides(TrainConfig(), ["rollout.group_size=1"])
    with pytest.raises(ValueError, match="rollout.mode='never'"):
        apply_overrides(TrainConfig(), ["rollout.mode=never"])


def test_a_single_string_is_refused():
    with pytest.raises(TypeError):
        apply_overrides(TrainConfig(), "rollout.lag=1")


@pytest.mark.parametrize("name", preset_names())
def test_round_trip_through_json(name):
    config = apply_overrides(
        get_preset(name), ["objective.loss_kwargs.tau_m2=0.04", "optimizer.clip_norm=none"]
    )
    d = json.loads(json.dumps(config_to_dict(config)))
    assert d["rollout"]["mode"] == config.rollout.mode
    assert config_from_dict(d) == config


def test_config_from_dict_is_strict():
    with pytest.raises(ValueError, match="'rollout.lagg'"):
        config_from_dict({"rollout": {"lagg": 1}})
    with pytest.raises(ValueError, match="'extra'"):
        config_from_dict({"extra": 1})
    with pytest.raises(ValueError, match="'steps'.*expected int"):
        config_from_dict({"steps": "10"})
    with pytest.raises(ValueError, match="'gac.enabled'.*expected bool"):
        config_from_dict({"gac": {"enabled": 1}})
    with pytest.raises(ValueError, match="'rollout' is a section"):
        config_from_dict({"rollout": 3})
    # Ints are floats; missing fields keep their defaults.
    config = config_from_dict({"optimizer": {"learning_rate": 1}})
    assert config.optimizer.learning_rate == 1.0
    assert type(config.optimizer.learning_rate) is float
    assert dataclasses.replace(config, optimizer=TrainConfig().optimizer) == TrainConfig()


def test_load_config_preset_and_file(tmp_path):
    assert load_config("countdown_sync") == get_preset("countdown_sync")

    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"base": "demo", "steps": 7, "rollout": {"max_staleness": None}}))
    config = load_config(path)
    demo = get_preset("demo")
    assert config.steps == 7 and config.rollout.max_staleness is None
    # Fields not in the file come from the base preset, not from the TrainConfig defaults.
    assert config.rollout.mode == demo.rollout.mode == "async"
    assert config.gac.enabled and config.rollout.groups_per_call == demo.rollout.groups_per_call

    saved = save_config(config, tmp_path / "run" / "config.json")
    assert load_config(str(saved)) == config


def test_load_config_errors(tmp_path):
    with pytest.raises(ValueError, match="'nosuch'.*countdown_sync"):
        load_config("nosuch")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json.*not valid JSON"):
        load_config(bad)
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"base": "demo", "gac": {"tau": 1}}))
    with pytest.raises(ValueError, match="wrong.json.*'gac.tau'"):
        load_config(wrong)
    unknown_base = tmp_path / "base.json"
    unknown_base.write_text(json.dumps({"base": "nosuch"}))
    with pytest.raises(ValueError, match="Unknown config preset 'nosuch'"):
        load_config(unknown_base)


def test_importance_correction_is_validated_and_takes_its_arguments():
    config = apply_overrides(
        get_preset("countdown_sweep"),
        ["objective.correction=tis", "objective.correction_kwargs.level=sequence"],
    )
    assert config.objective.correction == "tis"
    assert config.objective.correction_kwargs == {"level": "sequence"}
    assert apply_overrides(config, ["objective.correction=none"]).objective.correction is None
    with pytest.raises(ValueError, match="objective.correction='trunc' is unknown"):
        apply_overrides(config, ["objective.correction=trunc"])


def test_init_is_a_mode_or_a_checkpoint_directory(tmp_path):
    base = get_preset("countdown_sweep")
    assert apply_overrides(base, [f"init={tmp_path}"]).init == str(tmp_path)
    with pytest.raises(ValueError, match="init='warm'.*nor an existing directory"):
        apply_overrides(base, ["init=warm"])
