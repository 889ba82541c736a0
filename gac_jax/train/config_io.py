"""Configs to and from YAML, JSON and ``--set key=value`` overrides, with draccus.

draccus decodes nested dicts into the frozen dataclasses by their annotated types and
dumps YAML; this module adds the messages (an unknown key names its section's valid keys
and the closest one) and the ``--set`` syntax.

An override is ``dotted.key=value``; the value is read as YAML (``8``, ``1e-3``, ``true``,
``null`` or ``none``, ``{}``, a string), so ``rollout.lag=8``, ``ess={}`` (ESS scaling with
its defaults), ``ess=none``, ``loss.loss_kwargs.tau_m2=0.04``. A config file is YAML or JSON
holding a (possibly partial) config; ``base: <preset>`` starts from that preset instead of
the `TrainConfig` defaults.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import hashlib
import json
import os
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import draccus
import yaml

from gac_jax.train.config import PRESETS, TrainConfig, get_preset, preset_names

_NONE = ("none", "null", "~")
# Keys that moved or went, and what replaces them (so an old command or file gets one line).
MOVED_KEYS = {
    "rollout.devices": "placement.devices",
    "rollout.tensor_parallel": "placement.tensor_parallel",
    "rollout.on_actor_failure": "ray.on_actor_failure",
    "rollout.actor_gpus": "ray.actor_gpus",
    "generation.sampler": "generation.slots (there is one sampler; slots=N refills N slots)",
}
_BOOLEANS = ("true", "false", "yes", "no")


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _section_type(tp: Any) -> type | None:
    """The dataclass of a section annotated ``X`` or ``X | None``; None for a leaf."""
    inner = [a for a in _leaf_types(tp) if a is not type(None)]
    tp = inner[0] if len(inner) == 1 else None
    return tp if isinstance(tp, type) and dataclasses.is_dataclass(tp) else None


def _leaf_types(tp: Any) -> tuple[Any, ...]:
    if typing.get_origin(tp) in (types.UnionType, typing.Union):
        return typing.get_args(tp)
    return (tp,)


def _unknown_key(cls: type, prefix: str, name: str) -> ValueError:
    if f"{prefix}{name}" in MOVED_KEYS:
        return ValueError(f"'{prefix}{name}' is now {MOVED_KEYS[prefix + name]}.")
    fields = _field_types(cls)
    section = f"section '{prefix[:-1]}'" if prefix else "the top level"
    close = difflib.get_close_matches(name, list(fields), n=1)
    hint = f" Did you mean '{prefix}{close[0]}'?" if close else ""
    keys = ", ".join(
        f"{prefix}{k}" + (".*" if _section_type(tp) else "") for k, tp in fields.items()
    )
    return ValueError(
        f"Unknown config key '{prefix}{name}'.{hint} Valid keys of {section}: {keys}."
    )


def _is_sequence(tp: Any) -> bool:
    return any(typing.get_origin(t) in (tuple, list) for t in _leaf_types(tp))


def _checked(cls: type, values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """`values` checked against the fields of `cls` (recursively): ValueError for the first
    key that is not a field; a bare string given for a sequence field made a one-element
    list (``generation.stop=</answer>`` means one stop string: draccus would split it into
    characters)."""
    if not isinstance(values, Mapping):
        raise ValueError(f"'{prefix[:-1]}' is a section; got {values!r}, expected a mapping.")
    types_ = _field_types(cls)
    out = {}
    for name, value in values.items():
        if name not in types_:
            raise _unknown_key(cls, prefix, name)
        if isinstance(value, bool) and bool not in _leaf_types(types_[name]):
            # draccus would read true as 1: a number field never takes a boolean.
            raise ValueError(f"'{prefix}{name}': expected {types_[name]}, got {value!r}.")
        section = _section_type(types_[name])
        if section is not None and value is not None:
            value = _checked(section, value, f"{prefix}{name}.")
        elif isinstance(value, str) and _is_sequence(types_[name]):
            value = [value]
        out[name] = value
    return out


def config_to_dict(config: Any) -> dict[str, Any]:
    """The config as plain nested dicts, lists and scalars (what YAML and JSON hold)."""
    return draccus.encode(config)


def _merge(base: Any, update: Mapping[str, Any]) -> Any:
    """`update` laid over `base` key by key (a section given as None replaces it)."""
    merged = dict(base) if isinstance(base, Mapping) else {}
    for key, value in update.items():
        if isinstance(value, Mapping) and value:
            merged[key] = _merge(merged.get(key), value)
        else:
            merged[key] = value
    return merged


def config_from_dict(values: Mapping[str, Any], base: TrainConfig | None = None) -> TrainConfig:
    """The `TrainConfig` of a (partial) dict laid over `base` (the defaults if None),
    validated. Unknown keys, ill-typed values and failed checks are `ValueError`s naming
    the field."""
    values = dict(values)
    if "base" in values:
        base = get_preset(values.pop("base"), validate=False)  # Validated whole below.
    merged = _merge(config_to_dict(base or TrainConfig()), _checked(TrainConfig, values))
    try:
        config = draccus.decode(TrainConfig, merged)
    except draccus.utils.DecodingError as error:
        raise ValueError(str(error).replace("`", "'")) from None
    config.validate()
    return config


def parse_value(raw: str) -> Any:
    """An override's value, read as YAML; ``none`` (any case) is null too."""
    text = raw.strip()
    if text.lower() in _NONE:
        return None
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(value, bool) and text.lower() not in _BOOLEANS:
        return text  # YAML 1.1 reads on/off/y/n as booleans; only these words are.
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            return float(value)  # YAML 1.1 leaves "1e-3" (no dot) a string.
    return value


def _override_dict(override: str) -> dict[str, Any]:
    key, sep, raw = override.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"Override {override!r} is not of the form key=value.")
    parts = key.strip().split(".")
    nested: dict[str, Any] = {parts[-1]: parse_value(raw)}
    for part in reversed(parts[:-1]):
        nested = {part: nested}
    return nested


def apply_overrides(config: TrainConfig, overrides: Sequence[str]) -> TrainConfig:
    """`config` with each ``dotted.key=value`` applied in order, validated."""
    values: dict[str, Any] = {}
    for override in overrides:
        values = _merge(values, _override_dict(override))
    return config_from_dict(values, base=config)


def to_yaml(config: Any) -> str:
    """The config as YAML (what `show-config` prints)."""
    return draccus.dump(config)


def save_config(config: TrainConfig, path: str | os.PathLike) -> Path:
    """Writes the config as JSON (``.json``) or YAML (any other suffix); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    as_json = path.suffix == ".json"
    path.write_text(json.dumps(config_to_dict(config), indent=2) if as_json else to_yaml(config))
    return path


def load_config(name_or_path: str | os.PathLike) -> TrainConfig:
    """A preset by name, or a YAML/JSON config file (partial; ``base:`` names a preset).

    A preset comes back as defined, not yet validated: `apply_overrides` validates the
    result, so an override can settle what the preset alone would fail on (a preset's
    checkpoint directory holding another architecture, with ``--set model=...``).
    """
    name = str(name_or_path)
    if name in PRESETS:
        return get_preset(name, validate=False)
    path = Path(name)
    if not path.is_file():
        raise ValueError(
            f"{name!r} is neither a preset ({', '.join(preset_names())}) nor a config file."
        )
    text = path.read_text()
    try:
        values = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as error:
        raise ValueError(f"{path} is not valid {path.suffix[1:] or 'YAML'}: {error}") from None
    if not isinstance(values, Mapping):
        raise ValueError(f"{path} must hold a mapping of config keys, got {type(values).__name__}.")
    return config_from_dict(values)


def config_hash(config: Any, exclude: Sequence[str] = ()) -> str:
    """A short stable hash of a config's fields but the top-level `exclude` ones: the one
    hash of runs, sweeps and warm starts (names what a checkpoint or cache depends on)."""
    fields = {k: v for k, v in config_to_dict(config).items() if k not in exclude}
    text = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# What may change when a run is resumed: how long it runs and how it is evaluated and
# checkpointed, nothing that changes what it trains.
RESUMABLE_FIELDS = ("steps", "eval_every", "eval_size", "eval_samples", "checkpoint_every",
                    "keep_checkpoints", "samples_every", "samples_per_log", "wandb_project",
                    "wandb_mode")  # fmt: skip


def run_hash(config: Any) -> str:
    """The hash of what a run's results depend on: the config but for `steps` (resuming
    with more steps is how a finished run is trained further)."""
    return config_hash(config, exclude=("steps",))


def resume_hash(config: Any) -> str:
    """The hash a checkpoint records: the config but for `RESUMABLE_FIELDS`."""
    return config_hash(config, exclude=RESUMABLE_FIELDS)


def config_diff(old: Any, new: Any) -> list[tuple[str, Any, Any]]:
    """The fields that differ between two configs (or their dicts), as ``(dotted key, old
    value, new value)`` in field order."""
    old = old if isinstance(old, Mapping) else config_to_dict(old)
    new = new if isinstance(new, Mapping) else config_to_dict(new)
    changes = []
    for key in dict.fromkeys([*old, *new]):
        a, b = old.get(key), new.get(key)
        if isinstance(a, Mapping) and isinstance(b, Mapping) and a and b:
            changes += [(f"{key}.{k}", x, y) for k, x, y in config_diff(a, b)]
        elif a != b:
            changes.append((key, a, b))
    return changes
