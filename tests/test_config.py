"""A settings section as a process reads it: flags built from the declarations, then defaults,
the TOML table, the environment and the flags, each later one winning."""

import argparse

import pytest

from kvstore.config import build_config
from kvstore.errors import ConfigError
from kvstore.sections import METADATA, NODE
from tests.test_settings import EXAMPLE, Example


def example_parser(**shown_defaults) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="example", formatter_class=WideHelp)
    EXAMPLE.add_flags(parser, shown_defaults=shown_defaults)
    return parser


class WideHelp(argparse.HelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, width=200, max_help_position=60)


def test_flags_and_their_help_come_from_the_declarations():
    help_text = example_parser().format_help()
    assert "--workers WORKERS" in help_text and "threads (default: 4)" in help_text
    assert "one buffer (default: 1MiB)" in help_text
    assert "one call (default: 1.5 s)" in help_text
    assert "--mode {fast,safe}" in help_text and "how (default: fast)" in help_text
    assert "--verify" not in help_text and "--state-dir" not in help_text  # no flag declared
    assert "one buffer (default: 64MiB)" in example_parser(buffer_bytes=64 << 20).format_help()


def test_flags_stay_text_until_the_section_parses_them():
    args = example_parser().parse_args(["--workers", "many"])
    with pytest.raises(ConfigError, match=r"workers must be an integer, got 'many' \(flag"):
        EXAMPLE.load({}, {}, EXAMPLE.flag_values(args))
    args = example_parser().parse_args(["--workers", "8", "--buffer-bytes", "2MiB"])
    assert EXAMPLE.load({}, {}, EXAMPLE.flag_values(args)) == Example(8, 2 << 20)


def test_the_file_then_the_environment_then_the_flags(tmp_path):
    path = tmp_path / "kvstore.toml"
    path.write_text('[example]\nworkers = 2\nbuffer_bytes = 3\ntimeout_s = 3\nmode = "safe"\n')
    env = {"KVSTORE_EXAMPLE_BUFFER_BYTES": "4", "KVSTORE_EXAMPLE_TIMEOUT_S": "4"}
    config = build_config(EXAMPLE, path, env, {"timeout_s": "5"})
    assert config == Example(workers=2, buffer_bytes=4, timeout_s=5.0, mode="safe")


def test_an_unknown_key_of_the_table_is_named_with_its_file(tmp_path):
    path = tmp_path / "kvstore.toml"
    path.write_text("[example]\nworker = 2\n")
    with pytest.raises(
        ConfigError, match=rf"unknown setting\(s\) \['worker'\] in \[example\] of {path}"
    ):
        build_config(EXAMPLE, path, {}, {})


def test_the_agent_and_the_service_keep_their_flags_and_environment_names():
    """The chart (deploy/helm) and users pass these; their names must not drift."""
    node_flags = {s.flag for s in NODE.settings() if s.flag}
    assert {"--node-id", "--host-capacity-bytes", "--node-metrics-listen"} <= node_flags
    assert len(node_flags) == 26  # with --max-block-bytes
    metadata_flags = {s.flag for s in METADATA.settings() if s.flag}
    assert {"--listen", "--backend", "--redis-wait-timeout-ms"} <= metadata_flags
    assert len(metadata_flags) == 22  # with --redis-shards
    env = {"KVSTORE_NODE_DISK_READ_BYTES_PER_S": "256KiB", "KVSTORE_NODE_TRANSFER": "none"}
    assert NODE.load({}, env, {}).disk_read_bytes_per_s == 256 << 10
