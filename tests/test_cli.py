"""The command line as a user runs it: `kvstore serve` starts, answers health checks, prints
stats and stops cleanly on SIGTERM; configuration comes from file, environment and flags."""

import json
import signal
import subprocess
import sys

import pytest

from kvstore.config import build_config
from kvstore.errors import ConfigError
from kvstore.metadata.client import MetadataClient
from kvstore.metadata.index import BlockEntry, NodeRecord
from kvstore.metadata.server import MetadataConfig
from tests.metadata.servers import health_status, start_cli


def kvstore(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvstore", *args], capture_output=True, text=True, timeout=60
    )


def test_the_readme_serve_command_starts_answers_health_and_stops_on_sigterm(tmp_path):
    process, address = start_cli(
        "serve", "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "data"),
        "--metrics-listen", "127.0.0.1:0",
    )  # fmt: skip
    try:
        assert "metrics on http://127.0.0.1:" in process.stdout.readline()
        assert health_status(address) == "SERVING"
        with MetadataClient(address) as client:
            lease, _ = client.register_node(NodeRecord("n1", tcp_address="127.0.0.1:7000"))
            client.publish("n1", lease, "t", [BlockEntry(bytes(16), "host")])
        table = kvstore("stats", "--address", address)
        assert table.returncode == 0, table.stderr
        assert "backend lmdb · 1 live nodes · 1 blocks" in table.stdout
        assert "n1" in table.stdout and "127.0.0.1:7000" in table.stdout
        as_json = json.loads(kvstore("stats", "--address", address, "--json").stdout)
        assert as_json["blocks"] == "1" and as_json["nodes"][0]["node"]["node_id"] == "n1"
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=15) == 0
    assert "shutting down" in process.stderr.read()
    assert (tmp_path / "data" / "metadata.lmdb").exists()


def test_settings_come_from_file_then_environment_then_flags(tmp_path):
    path = tmp_path / "kvstore.toml"
    path.write_text('[metadata]\nlisten = "0.0.0.0:1"\nkey_quota_per_tenant = 5\nmax_workers = 8\n')
    from kvstore.config import read_toml_section

    section = read_toml_section(path, "metadata")
    env = {"KVSTORE_METADATA_LISTEN": "127.0.0.1:2", "KVSTORE_METADATA_KEY_QUOTA_PER_TENANT": "7"}
    config = build_config(
        MetadataConfig, section, env, {"listen": "127.0.0.1:3"}, "KVSTORE_METADATA_"
    )
    assert (config.listen, config.key_quota_per_tenant, config.max_workers) == ("127.0.0.1:3", 7, 8)


@pytest.mark.parametrize(
    ("section", "env", "message"),
    [
        ({"listn": "x"}, {}, "unknown setting"),
        ({}, {"KVSTORE_METADATA_MAX_WORKERS": "many"}, "not a valid int"),
        ({"backend": "etcd"}, {}, "backend 'etcd' unknown"),
        ({"tls_cert": "/c"}, {}, "both tls_cert and tls_key"),
    ],
)
def test_bad_settings_say_what_to_change(section, env, message):
    with pytest.raises(ConfigError, match=message):
        build_config(MetadataConfig, section, env, {}, "KVSTORE_METADATA_")


def test_cli_reports_config_errors_without_a_traceback(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[metadata]\nlisen = 1\n")
    result = kvstore("serve", "--config", str(bad))
    assert result.returncode == 2
    assert "unknown setting(s) ['lisen']" in result.stderr and "Traceback" not in result.stderr
    unknown_policy = kvstore("replay", "trace.jsonl", "--policy", "nope", "--capacity-blocks", "1")
    assert unknown_policy.returncode == 2 and "invalid choice: 'nope'" in unknown_policy.stderr
