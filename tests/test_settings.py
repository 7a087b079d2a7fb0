"""The one settings parser: a value is refused with the same message from every source (a TOML
table, an environment variable, a flag, a connector's JSON extra config), naming the setting,
the source, the value and what is allowed."""

from dataclasses import dataclass
from pathlib import Path

import pytest

from kvstore.config import Section, build_config
from kvstore.errors import ConfigError
from kvstore.settings import parse_size, parse_values, setting


@dataclass(frozen=True)
class Example:
    workers: int = setting(4, help="threads", ge=1, le=64, flag=True)
    buffer_bytes: int = setting(1 << 20, help="one buffer", flag=True)
    timeout_s: float = setting(1.5, help="one call", gt=0, flag=True)
    verify: bool = setting(True, help="checksums")
    mode: str = setting("fast", help="how", choices=("fast", "safe"), flag=True)
    state_dir: Path | None = None  # no Spec: files and env only


EXAMPLE = Section(Example, "example")


def refusals(name: str, value, tmp_path) -> dict[str, str]:
    """The refusal of `value` for setting `name` by each source: a TOML table and a JSON extra
    config as typed, the environment and a flag as text; by the source's label."""
    toml = tmp_path / "kvstore.toml"
    literal = f'"{value}"' if isinstance(value, str) else value
    toml.write_text(f"[example]\n{name} = {literal}\n")
    env_name = f"KVSTORE_EXAMPLE_{name.upper()}"
    attempts = {
        f"[example] {name} in {toml}": lambda: build_config(EXAMPLE, toml, {}, {}),
        f"env {env_name}": lambda: build_config(EXAMPLE, None, {env_name: str(value)}, {}),
        f"flag --{name.replace('_', '-')}": lambda: EXAMPLE.load({}, {}, {name: str(value)}),
        f"extra config key {name!r}": lambda: parse_values(Example, {name: value}, "extra config"),
    }
    messages = {}
    for source, attempt in attempts.items():
        with pytest.raises(ConfigError) as refused:
            attempt()
        messages[source] = str(refused.value)
    return messages


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("workers", "many", "workers must be an integer, got {value}"),
        ("workers", 0, "workers must be in [1, 64], got {value}"),
        ("timeout_s", -0.5, "timeout_s must be > 0, got {value}"),
        ("mode", "slow", "mode {value} unknown; use one of fast, safe"),
        (
            "buffer_bytes",
            150.9,
            "buffer_bytes must be a whole number of bytes such as 4096, 64MiB or 1.5GiB, "
            "got {value}",
        ),
    ],
)
def test_a_bad_value_gets_one_message_from_every_source(tmp_path, name, value, message):
    """The value as the source holds it: typed in TOML and JSON, text in env and flags."""
    typed, text = repr(value), repr(str(value))
    for source, refusal in refusals(name, value, tmp_path).items():
        shown = text if source.startswith(("env", "flag")) else typed
        assert refusal == f"{message.format(value=shown)} ({source})"


@pytest.mark.parametrize("value", [True, 150.9, -0.5, "4", None])
def test_typed_sources_refuse_values_of_another_type(value):
    with pytest.raises(ConfigError, match="workers must be an integer"):
        parse_values(Example, {"workers": value}, "the extra config")


def test_text_sources_parse_text_and_sizes_may_be_text_anywhere():
    env = {
        "KVSTORE_EXAMPLE_WORKERS": "8",
        "KVSTORE_EXAMPLE_VERIFY": "no",
        "KVSTORE_EXAMPLE_STATE_DIR": "/var/lib/x",
        "KVSTORE_EXAMPLE_TIMEOUT_S": "2",
    }
    config = EXAMPLE.load({"buffer_bytes": "1.5KiB"}, env, {"mode": "safe"})
    assert config == Example(8, 1536, 2.0, False, "safe", Path("/var/lib/x"))
    assert parse_values(Example, {"buffer_bytes": "64MiB"}, "x") == {"buffer_bytes": 64 << 20}
    with pytest.raises(ConfigError, match="verify must be true or false, got 'maybe'"):
        EXAMPLE.load({}, {"KVSTORE_EXAMPLE_VERIFY": "maybe"}, {})


def test_unknown_keys_are_refused_by_name_with_the_valid_ones():
    with pytest.raises(ConfigError, match=r"unknown setting\(s\) \['worker'\] in x; valid: \["):
        parse_values(Example, {"worker": 1}, "x")


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("4096", 4096),
        ("64MiB", 64 << 20),
        ("4G", 4 << 30),
        ("1.5GiB", 3 << 29),
        ("8 kb", 8192),
        ("64Gi", 64 << 30),
    ],
)
def test_sizes_take_binary_units(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["150.9", "-1", "1.5", "8XiB", "", "true"])
def test_a_size_that_is_no_whole_number_of_bytes_is_refused(text):
    with pytest.raises(ValueError, match="is not a size"):
        parse_size(text)
