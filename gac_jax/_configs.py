"""Configs that mirror a factory's arguments one to one: a frozen dataclass whose fields are
the keyword arguments of the function that builds the component (same names and defaults,
checked by a test), so a new argument is settable from a config file with no other change.
Validation is the factory's own: a config is valid exactly when its component builds.
"""

from __future__ import annotations

import dataclasses
from typing import Any


def arguments(config: Any) -> dict[str, Any]:
    """The config's fields as keyword arguments (shallow, unlike `dataclasses.asdict`)."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
