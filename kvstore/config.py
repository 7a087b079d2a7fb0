"""A process's settings sections (the node agent's, the metadata service's): each read from a
TOML table, then KVSTORE_<TABLE>_* environment variables, then CLI flags whose help and defaults
come from the same declarations (settings.py), all through one strict parser.

Runs in the CLI process, once, at start-up.
"""

from __future__ import annotations

import argparse
import ipaddress
import tomllib
from collections.abc import Collection, Mapping
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any

from kvstore.errors import ConfigError
from kvstore.settings import SIZE_UNITS, Setting, Spec, format_size, parse, settings_of
from kvstore.settings import parse_size as parse_size

_NOT_SHOWN = (MISSING, None, "")  # defaults a flag's help leaves out


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


@dataclass(frozen=True)
class Section:
    """One component's settings as a process reads them: its dataclass, its TOML table and
    environment prefix, and the Spec of each field its dataclass does not declare itself."""

    cls: type
    table: str  # "node": [node] in TOML, KVSTORE_NODE_* in the environment
    specs: Mapping[str, Spec] = field(default_factory=dict)

    @property
    def env_prefix(self) -> str:
        return f"KVSTORE_{self.table.upper()}_"

    def settings(self) -> list[Setting]:
        return settings_of(self.cls, self.specs)

    def load(
        self,
        file_values: Mapping[str, Any],
        env: Mapping[str, str],
        flags: Mapping[str, Any],
        where: str = "the config file",
    ) -> Any:
        """The component's config from the file's table, the environment and the flags (by
        setting name), each later one winning."""
        settings = {s.name: s for s in self.settings()}
        unknown = sorted(set(file_values) - set(settings))
        if unknown:
            raise ConfigError(
                f"unknown setting(s) {unknown} in [{self.table}] of {where}; "
                f"valid: {sorted(settings)}"
            )
        values = {}
        for name, setting in settings.items():
            env_name = self.env_prefix + name.upper()
            for source, raw, text in (
                (f"[{self.table}] {name} in {where}", file_values.get(name), False),
                (f"env {env_name}", env.get(env_name), True),
                (f"flag {setting.flag}", flags.get(name), True),
            ):
                if raw is not None:
                    values[name] = parse(setting, raw, source, text)
        return self.cls(**values)

    def add_flags(
        self,
        parser: argparse.ArgumentParser,
        omit: Collection[str] = (),
        shown_defaults: Mapping[str, Any] | None = None,
    ) -> None:
        """A flag for each flagged setting not in `omit`, its help the declared one with the
        default (`shown_defaults` where the command's differ); values stay raw for `load`."""
        shown_defaults = shown_defaults or {}
        for setting in self.settings():
            if not setting.flag or setting.name in omit:
                continue
            shown = shown_defaults.get(setting.name, setting.default)
            help_text = _flag_help(setting, shown).replace("%", "%%")
            if setting.kind is bool:
                parser.add_argument(setting.flag, action="store_true", default=None, help=help_text)
                continue
            metavar = setting.spec.metavar
            if setting.spec.choices:
                metavar = "{" + ",".join(setting.spec.choices) + "}"
            parser.add_argument(setting.flag, metavar=metavar, help=help_text)

    def flag_values(self, args: argparse.Namespace) -> dict[str, Any]:
        """The flags given on the command line, by setting name."""
        return {
            s.name: getattr(args, s.flag[2:].replace("-", "_"), None)
            for s in self.settings()
            if s.flag
        }


def _flag_help(setting: Setting, default: Any) -> str:
    if default in _NOT_SHOWN or isinstance(default, bool):
        return setting.spec.help
    if setting.unit in SIZE_UNITS:
        shown = format_size(default)
    else:
        shown = f"{default} {setting.unit}".strip()
    return f"{setting.spec.help} (default: {shown})".lstrip()


def build_config(
    section: Section,
    path: Path | None,
    env: Mapping[str, str],
    flags: Mapping[str, Any],
) -> Any:
    """`section`'s config from the `[table]` of the TOML file at `path` (if any), the
    environment and the flags."""
    file_values = read_toml_section(path, section.table)
    return section.load(file_values, env, flags, str(path))


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
