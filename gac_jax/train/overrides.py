"""Change a `TrainConfig` by dotted name, and move configs to and from JSON.

An override is ``dotted.key=value``: ``rollout.lag=8``, ``gac.enabled=true``,
``optimizer.clip_norm=none``, ``objective.loss_kwargs.tau_m2=0.04``. The type of each field
is read from the dataclass annotations, so the dataclasses in `gac_jax.train.config` stay the
one place that lists fields and defaults. Every error is a `ValueError` naming the key.

A config file is JSON holding a (possibly partial) config dict; ``"base": "<preset>"`` starts
from that preset instead of the `TrainConfig` defaults.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import os
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gac_jax.train.config import PRESETS, TrainConfig, get_preset, preset_names, validate

_TRUE = ("true", "1", "yes")
_FALSE = ("false", "0", "no")
_NONE = ("none", "null")


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    """Field name -> resolved annotation (the config module uses postponed annotations)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _optional_inner(tp: Any) -> Any | None:
    """X for ``X | None`` (or ``Optional[X]``); None for any other type."""
    if typing.get_origin(tp) in (types.UnionType, typing.Union):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0]
    return None


def _is_dict(tp: Any) -> bool:
    return tp is dict or typing.get_origin(tp) is dict


def _type_name(tp: Any) -> str:
    inner = _optional_inner(tp)
    if inner is not None:
        return f"{_type_name(inner)} or none"
    if _is_dict(tp):
        return "dict"
    return getattr(tp, "__name__", str(tp))


def _valid_keys(cls: type, prefix: str) -> str:
    """The keys of a section, sections shown as ``name.*``, for error messages."""
    names = []
    for name, tp in _field_types(cls).items():
        suffix = ".*" if _is_section(tp) or _is_dict(tp) else ""
        names.append(f"{prefix}{name}{suffix}")
    return ", ".join(names)


def _unknown_key(cls: type, prefix: str, name: str, full_key: str) -> ValueError:
    section = f"section '{prefix[:-1]}'" if prefix else "the top level"
    close = difflib.get_close_matches(name, list(_field_types(cls)), n=1)
    hint = f" Did you mean '{prefix}{close[0]}'?" if close else ""
    return ValueError(
        f"Unknown config key '{full_key}'.{hint} Valid keys of {section}: "
        f"{_valid_keys(cls, prefix)}."
    )


def _parse_scalar(tp: Any, raw: str, key: str) -> Any:
    """Parses the text of an override as a value of annotation `tp`."""

    def bad(expected: str) -> ValueError:
        return ValueError(f"Bad value {raw!r} for config key '{key}': expected {expected}.")

    text = raw.strip()
    inner = _optional_inner(tp)
    if inner is not None:
        return None if text.lower() in _NONE else _parse_scalar(inner, raw, key)
    if tp is bool:
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise bad("bool (true/false, 1/0, yes/no)")
    if tp is int:
        try:
            return int(text)
        except ValueError:
            raise bad("int") from None
    if tp is float:
        try:
            value = float(text)
        except ValueError:
            raise bad("float") from None
        if not math.isfinite(value):
            raise bad("a finite float")
        return value
    if tp is str:
        return text
    if _is_dict(tp):
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = None
        if not isinstance(value, dict):
            raise bad(f"a JSON object, or set one entry with '{key}.<name>=<value>'")
        return value
    raise bad(_type_name(tp))  # A field type this module does not know how to parse.


def parse_entry_value(raw: str) -> Any:
    """A dict entry's value: bool (true/false), None (none/null), int, float, else the string."""
    text = raw.strip()
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if text.lower() in _NONE:
        return None
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return text


def _set(obj: Any, parts: Sequence[str], raw: str, full_key: str, prefix: str = "") -> Any:
    """A copy of dataclass `obj` with the field at `parts` parsed from `raw`."""
    cls = type(obj)
    name, rest = parts[0], parts[1:]
    field_types = _field_types(cls)
    if name not in field_types:
        raise _unknown_key(cls, prefix, name, full_key)
    tp = field_types[name]
    path = f"{prefix}{name}"
    if _is_section(tp):
        if not rest:
            raise ValueError(
                f"Config key '{full_key}' is a section, not a field; set one of its fields: "
                f"{_valid_keys(tp, path + '.')}."
            )
        value = _set(getattr(obj, name), rest, raw, full_key, path + ".")
    elif _is_dict(tp) and rest:
        if len(rest) != 1 or not rest[0]:
            raise ValueError(
                f"Config key '{full_key}': '{path}' is a dict; its entries are set as "
                f"'{path}.<name>=<value>' with a name without dots."
            )
        value = {**getattr(obj, name), rest[0]: parse_entry_value(raw)}
    elif rest:
        raise ValueError(
            f"Config key '{full_key}': '{path}' is a {_type_name(tp)} field, not a section."
        )
    else:
        value = _parse_scalar(tp, raw, full_key)
    return dataclasses.replace(obj, **{name: value})


def split_override(override: str) -> tuple[str, str]:
    """``"a.b=v"`` -> ``("a.b", "v")``; ValueError naming a malformed override."""
    key, sep, raw = override.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ValueError(f"Malformed override {override!r}: expected 'dotted.key=value'.")
    return key, raw


def apply_overrides(config: TrainConfig, overrides: Sequence[str]) -> TrainConfig:
    """Returns `config` with each ``dotted.key=value`` applied in order, then validated.

    Later overrides of the same key win. Values are parsed by the field's annotation: bool
    (true/false/1/0/yes/no), int, float (ints accepted), str, ``X | None`` ("none"/"null" is
    None), and ``dict[str, Any]``, whose entries are set as ``section.dict_name.entry=value``
    (value parsed as bool/none/int/float, else kept as a string) or whole as a JSON object.

    Raises:
      ValueError: naming a malformed override, an unknown key (listing the valid keys of its
        section), an ill-typed value (naming key, value and expected type), or the first field
        `gac_jax.train.config.validate` rejects.
    """
    if isinstance(overrides, str):
        raise TypeError("overrides must be a sequence of 'key=value' strings, not one string.")
    for override in overrides:
        key, raw = split_override(override)
        config = _set(config, key.split("."), raw, key)
    return validate(config)


def config_to_dict(config: TrainConfig) -> dict[str, Any]:
    """The config as nested plain dicts (JSON-able; `config_from_dict` inverts it)."""
    return dataclasses.asdict(config)


def _from_json_value(tp: Any, value: Any, key: str) -> Any:
    """Checks a JSON value against annotation `tp`; ints are accepted for floats."""

    def bad() -> ValueError:
        return ValueError(f"Bad value {value!r} for config key '{key}': expected {_type_name(tp)}.")

    inner = _optional_inner(tp)
    if inner is not None:
        return None if value is None else _from_json_value(inner, value, key)
    if tp is bool:
        if not isinstance(value, bool):
            raise bad()
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad()
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise bad()
        if not math.isfinite(value):
            raise bad()
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise bad()
        return value
    if _is_dict(tp):
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise bad()
        return dict(value)
    raise bad()


def _merge(obj: Any, d: Mapping[str, Any], prefix: str = "") -> Any:
    """A copy of dataclass `obj` with the fields given in `d` (recursively) replaced."""
    cls = type(obj)
    if not isinstance(d, Mapping):
        raise ValueError(f"Config section '{prefix[:-1]}' must be a dict, got {d!r}.")
    field_types = _field_types(cls)
    changes = {}
    for name, value in d.items():
        if name not in field_types:
            raise _unknown_key(cls, prefix, name, f"{prefix}{name}")
        tp = field_types[name]
        if _is_section(tp):
            if not isinstance(value, Mapping):
                raise ValueError(
                    f"Config key '{prefix}{name}' is a section: expected a dict, got {value!r}."
                )
            changes[name] = _merge(getattr(obj, name), value, f"{prefix}{name}.")
        else:
            changes[name] = _from_json_value(tp, value, f"{prefix}{name}")
    return dataclasses.replace(obj, **changes)


def config_from_dict(d: Mapping[str, Any]) -> TrainConfig:
    """A validated config from a (possibly partial) dict, such as `config_to_dict` makes.

    Missing fields keep their defaults: those of `TrainConfig`, or of the preset named by an
    optional top-level ``"base"`` key. Dict fields (``loss_kwargs``) are replaced whole.
    Unknown keys and values of the wrong JSON type are errors.
    """
    d = dict(d)
    base = d.pop("base", None)
    if base is None:
        config = TrainConfig()
    elif isinstance(base, str):
        config = get_preset(base)
    else:
        raise ValueError(f"Config key 'base' must be a preset name, got {base!r}.")
    return validate(_merge(config, d))


def save_config(config: TrainConfig, path: str | os.PathLike) -> Path:
    """Writes the config as indented JSON that `load_config` reads back; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config_to_dict(config), indent=2, sort_keys=True) + "\n")
    return path


def load_config(name_or_path: str | os.PathLike) -> TrainConfig:
    """A preset by name, or the config in a JSON file (see `config_from_dict`)."""
    if isinstance(name_or_path, str) and name_or_path in PRESETS:
        return get_preset(name_or_path)
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(
            f"Config {str(name_or_path)!r} is neither a preset ({', '.join(preset_names())}) "
            "nor a JSON file."
        )
    try:
        d = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"Config file {str(path)!r} is not valid JSON: {e}.") from None
    if not isinstance(d, dict):
        raise ValueError(f"Config file {str(path)!r} must hold a JSON object.")
    try:
        return config_from_dict(d)
    except ValueError as e:
        raise ValueError(f"Config file {str(path)!r}: {e}") from None
