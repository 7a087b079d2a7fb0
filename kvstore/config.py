"""Configuration loading: a TOML file section, then KVSTORE_* environment variables, then flags.

Runs in the CLI process, once, at start-up. Builds one frozen dataclass per component and
rejects unknown names and unparsable values with a message saying what to change.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from kvstore.errors import ConfigError

T = TypeVar("T")


def read_toml_section(path: Path | None, section: str) -> dict[str, Any]:
    """The `[section]` table of a TOML file ({} when no file is given)."""
    if path is None:
        return {}
    try:
        document = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from exc
    table = document.get(section, {})
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [{section}] must be a table")
    return table


def build_config(
    cls: type[T],
    file_values: Mapping[str, Any],
    env: Mapping[str, str],
    flags: Mapping[str, Any],
    env_prefix: str,
) -> T:
    """Merge the three sources (later wins) into `cls`, coercing each value to its field type."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = set(file_values) - names
    if unknown:
        raise ConfigError(f"unknown setting(s) {sorted(unknown)}; valid: {sorted(names)}")
    values: dict[str, Any] = {}
    for name in names:
        env_name = f"{env_prefix}{name.upper()}"
        for source, raw in (
            ("file", file_values.get(name)),
            (env_name, env.get(env_name)),
            ("--" + name.replace("_", "-"), flags.get(name)),
        ):
            if raw is not None:
                values[name] = _coerce(raw, hints[name], f"{source} {name}")
    return cls(**values)


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """'4096', '64MiB', '4G', '1.5GiB' -> bytes (binary units; a trailing 'iB'/'B' is optional)."""
    cleaned = text.strip().lower().removesuffix("b").removesuffix("i")
    number, unit = cleaned.rstrip("kmgt"), cleaned[len(cleaned.rstrip("kmgt")) :]
    if len(unit) > 1:
        raise ValueError(text)
    return int(float(number) * _UNITS[unit])


def _coerce(raw: Any, hint: Any, where: str) -> Any:
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    target = next(t for t in options if t is not type(None))
    if dataclasses.is_dataclass(target):
        raise ConfigError(f"{where}: cannot be set here")
    try:
        if target is bool and isinstance(raw, str):
            return {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}[
                raw.lower()
            ]
        if target is Path:
            return Path(raw)
        if target is int and isinstance(raw, str):
            return parse_size(raw)
        return target(raw)
    except (KeyError, TypeError, ValueError):
        raise ConfigError(f"{where}: {raw!r} is not a valid {target.__name__}") from None


def read_secret_file(path: Path, what: str) -> str:
    """The stripped text of a secret file (a mounted Kubernetes Secret); ConfigError if it
    cannot be read or is empty."""
    try:
        secret = path.read_text().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} from {path}: {exc}") from None
    if not secret:
        raise ConfigError(f"{what} file {path} is empty")
    return secret


def is_loopback_host(host: str) -> bool:
    """Whether `host` (a name, an address, or a bracketed IPv6 one) is this machine's loopback
    only; "" (every address) and other names are not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
