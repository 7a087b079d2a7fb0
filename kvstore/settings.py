"""One declaration per setting (type and default from its dataclass field; help, unit, bounds
and choices from a `Spec`) and the one strict parser that every source goes through: TOML
tables, KVSTORE_* environment variables, CLI flags and a connector's JSON extra config.

Runs wherever settings are read: the CLI process at start-up, an engine's connector when built.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import MISSING, dataclass
from pathlib import Path
from typing import Any

from kvstore.errors import ConfigError

SIZE_UNITS = ("bytes", "bytes/s")  # units whose values may be written as sizes: 64MiB, 2GiB
_SIZE = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*([kmgt]?)i?b?", re.IGNORECASE)
_SIZE_SHIFTS = {"": 0, "k": 10, "m": 20, "g": 30, "t": 40}
_INTEGER = re.compile(r"[+-]?[0-9][0-9_]*")
_BOOLS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}
_UNIT_SUFFIXES = (
    ("_bytes_per_s", "bytes/s"),
    ("_per_s", "per s"),
    ("_bytes", "bytes"),
    ("_ms", "ms"),
    ("_us", "us"),
    ("_s", "s"),
)
_KEY = "kvstore"  # the key of a field's Spec in its dataclasses.field metadata


@dataclass(frozen=True)
class Spec:
    """What a setting means beyond its type and default: `flag` True gives it the CLI flag
    --its-name, a string gives it that flag; False keeps it to files, env and extra config."""

    help: str = ""
    unit: str = ""  # "bytes", "s", "ms", ...; SIZE_UNITS also take 64MiB-style text
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    choices: tuple[str, ...] = ()
    flag: bool | str = False
    metavar: str | None = None


def setting(default: Any = MISSING, *, default_factory: Any = MISSING, **spec: Any) -> Any:
    """A dataclass field declared with its Spec: `x: int = setting(0, help=..., ge=0)`."""
    return dataclasses.field(
        default=default, default_factory=default_factory, metadata={_KEY: Spec(**spec)}
    )


@dataclass(frozen=True)
class Setting:
    """One field of a settings dataclass, resolved: its name, type, default and Spec."""

    name: str
    kind: type  # str, int, float, bool or Path (the field may also allow None)
    default: Any  # MISSING where a default_factory makes it
    spec: Spec

    @property
    def unit(self) -> str:
        """The declared unit, else the one its name ends in (size_bytes, timeout_s)."""
        if self.spec.unit:
            return self.spec.unit
        return next((unit for end, unit in _UNIT_SUFFIXES if self.name.endswith(end)), "")

    @property
    def flag(self) -> str:
        """The CLI flag, "" when it has none."""
        if self.spec.flag is True:
            return "--" + self.name.replace("_", "-")
        return self.spec.flag or ""


def settings_of(cls: type, specs: Mapping[str, Spec] | None = None) -> list[Setting]:
    """`cls`'s settable fields; a field's Spec comes from its metadata, else from `specs` (for
    a dataclass declared elsewhere). Fields of other types (nested sections) are left out."""
    hints, specs = _field_types(cls), specs or {}
    found = []
    for field in dataclasses.fields(cls):
        options = typing.get_args(hints[field.name])
        if not isinstance(hints[field.name], types.UnionType):
            options = (hints[field.name],)
        kinds = [t for t in options if t is not type(None)]
        if not field.init or len(kinds) != 1 or kinds[0] not in (str, int, float, bool, Path):
            continue
        spec = field.metadata.get(_KEY) or specs.get(field.name, Spec())
        found.append(Setting(field.name, kinds[0], field.default, spec))
    return found


def _field_types(cls: type) -> dict[str, Any]:
    """The evaluated annotations of `cls` and its dataclass bases (not of other bases, whose
    annotations may name what their module imports only for type checkers)."""
    hints: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            hints.update(inspect.get_annotations(klass, eval_str=True))
    return hints


def parse(setting: Setting, raw: Any, source: str, text: bool) -> Any:
    """`raw` as `setting`'s type, or a ConfigError naming the setting, `source`, the value and
    what is allowed. `text`: raw is a string to parse (env, flags); else it must already have
    the type (TOML, JSON), except sizes, which may be written as text anywhere."""
    value = _typed(setting, raw, text or (isinstance(raw, str) and setting.unit in SIZE_UNITS))
    if value is None:
        raise _refusal(setting, raw, source, "must be " + _expected(setting))
    spec = setting.spec
    if spec.choices and value not in spec.choices:
        allowed = ", ".join(spec.choices)
        raise ConfigError(f"{setting.name} {raw!r} unknown; use one of {allowed} ({source})")
    low_ok = (spec.ge is None or value >= spec.ge) and (spec.gt is None or value > spec.gt)
    if setting.kind in (int, float) and not (low_ok and (spec.le is None or value <= spec.le)):
        raise _refusal(setting, raw, source, "must be " + _bounds(spec))
    return value


def _typed(setting: Setting, raw: Any, text: bool) -> Any:
    """`raw` as the setting's type; None where it is not one."""
    kind = setting.kind
    if text and isinstance(raw, str):
        if kind is int:
            return _size(raw) if setting.unit in SIZE_UNITS else _integer(raw)
        if kind is float:
            return _number(raw)
        if kind is bool:
            return _BOOLS.get(raw.strip().lower())
        return Path(raw) if kind is Path else raw
    if kind is bool or isinstance(raw, bool):
        return raw if kind is bool and isinstance(raw, bool) else None
    if kind is int:
        return raw if isinstance(raw, int) else None
    if kind is float:
        is_number = isinstance(raw, int | float) and math.isfinite(raw)
        return float(raw) if is_number else None
    if kind is Path and isinstance(raw, str | Path):
        return Path(raw)
    return raw if kind is str and isinstance(raw, str) else None


def _integer(text: str) -> int | None:
    return int(text) if _INTEGER.fullmatch(text.strip()) else None


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _size(text: str) -> int | None:
    match = _SIZE.fullmatch(text.strip())
    if match is None:
        return None
    number, unit = match.groups()
    value = float(number) * (1 << _SIZE_SHIFTS[unit.lower()])
    return int(value) if value.is_integer() else None


def parse_size(text: str) -> int:
    """'4096', '64MiB', '64Gi', '4G', '1.5GiB' -> bytes (binary units; the 'i' and 'B' are
    optional); ValueError where it is not a whole number of bytes."""
    value = _size(text)
    if value is None:
        raise ValueError(f"{text!r} is not a size such as 4096, 64MiB or 1.5GiB")
    return value


def format_size(value: int) -> str:
    """Bytes as the largest binary unit that divides them: 1073741824 -> '1GiB'."""
    for unit, shift in reversed(_SIZE_SHIFTS.items()):
        if shift and value and value % (1 << shift) == 0:
            return f"{value >> shift}{unit.upper()}iB"
    return str(value)


def _expected(setting: Setting) -> str:
    if setting.kind is int and setting.unit in SIZE_UNITS:
        return "a whole number of bytes such as 4096, 64MiB or 1.5GiB"
    return {
        int: "an integer",
        float: "a number",
        bool: "true or false",
        str: "a string",
        Path: "a path",
    }[setting.kind]


def _bounds(spec: Spec) -> str:
    low = spec.ge if spec.ge is not None else spec.gt
    if spec.le is not None and low is not None:
        return f"in {'[' if spec.ge is not None else '('}{_num(low)}, {_num(spec.le)}]"
    if spec.le is not None:
        return f"<= {_num(spec.le)}"
    return f"{'>=' if spec.ge is not None else '>'} {_num(low)}"


def _num(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else str(bound)


def _refusal(setting: Setting, raw: Any, source: str, allowed: str) -> ConfigError:
    return ConfigError(f"{setting.name} {allowed}, got {raw!r} ({source})")


def parse_values(
    cls: type, values: Mapping[str, Any], where: str, specs: Mapping[str, Spec] | None = None
) -> dict[str, Any]:
    """Typed values (a TOML table, a JSON object) as keyword arguments of `cls`; a key that
    is no setting of `cls` is refused by name, with the valid ones."""
    known = {s.name: s for s in settings_of(cls, specs)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ConfigError(f"unknown setting(s) {unknown} in {where}; valid: {sorted(known)}")
    return {
        name: parse(known[name], raw, f"{where} key {name!r}", text=False)
        for name, raw in values.items()
    }
