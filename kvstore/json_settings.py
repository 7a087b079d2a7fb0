"""Settings given as one JSON object (a connector's extra config: SGLang's
--hicache-storage-backend-extra-config, LMCache's adapter_params): the fields of a dataclass,
parsed strictly. A key the dataclass lacks is refused by name, with the valid ones; a value of
the wrong JSON type is refused (a string where a number belongs, a bool where an integer does,
a negative integer). Runs wherever a connector is built.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from kvstore.errors import ConfigError


def parse_fields(cls: type, values: dict[str, Any], where: str) -> dict[str, Any]:
    """`values` typed as `cls`'s fields (declared as "str", "int" or "float"); `where` names
    the setting in the message of a refusal."""
    known = {field.name: field.type for field in fields(cls)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ConfigError(f"unknown kvstore keys {unknown} in {where}; valid: {sorted(known)}")
    return {name: _coerce(name, value, known[name]) for name, value in values.items()}


def _coerce(name: str, value: Any, type_name: str) -> Any:
    if type_name == "str":
        if not isinstance(value, str):
            raise ConfigError(f"{name} must be a string, got {value!r}")
        return value
    if type_name == "int":
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{name} must be a non-negative integer, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    return float(value)
