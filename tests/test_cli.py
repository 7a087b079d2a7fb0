"""The command line as a user runs it: `kvstore serve` starts, answers health checks, prints
stats and stops cleanly on SIGTERM; configuration comes from file, environment and flags."""

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.client import KVStoreClient
from kvstore.errors import ConfigError
from kvstore.keys import Namespace, chunk_keys
from kvstore.metadata.client import MetadataClient
from kvstore.sections import METADATA
from tests.metadata.servers import health_status, start_cli, wait_until

# Kubernetes' default terminationGracePeriodSeconds: a stop must fit in it (it takes ~2 s on an
# idle machine; a CI machine running other suites stretched it past 15 s once).
SIGTERM_GRACE_S = 30


def stop_cleanly(process) -> None:
    """SIGTERM, then exit 0 within the grace; a hung shutdown fails with the process's stderr
    (where it dumps every thread's stack after kvstore.serve.SHUTDOWN_STACKS_AFTER_S)."""
    process.send_signal(signal.SIGTERM)
    try:
        assert process.wait(timeout=SIGTERM_GRACE_S) == 0
    except subprocess.TimeoutExpired:
        process.kill()
        _, stderr = process.communicate(timeout=10)
        message = f"no exit {SIGTERM_GRACE_S} s after SIGTERM; stderr:\n{stderr}"
        raise AssertionError(message) from None


def kvstore(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvstore", *args], capture_output=True, text=True, timeout=60
    )


def test_the_readme_serve_command_starts_answers_health_and_stops_on_sigterm(tmp_path):
    process, address = start_cli(
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--data-dir",
        str(tmp_path / "data"),
        "--metrics-listen",
        "127.0.0.1:0",
        "--node-id",
        "host-1",
        "--host-capacity-bytes",
        "8MiB",
        "--page-size-bytes",
        "1MiB",
    )
    try:
        lines = [process.stdout.readline() for _ in range(2)]
        assert "metadata metrics on http://127.0.0.1:" in lines[0]
        assert "node agent host-1 serving workers on" in lines[1], lines
        assert health_status(address) == "SERVING"
        keys = chunk_keys(Namespace("m", "layout"), range(512), 256)
        with KVStoreClient(tmp_path / "data" / "agent.sock") as client:
            reservation = client.save("t", keys, payload_bytes=1000)
            for view in reservation.payloads:
                view.fill_(7)
            assert client.commit(reservation) == 2
        operator = (tmp_path / "data" / "operator.token").read_text().strip()
        with MetadataClient(address, token=operator) as metadata:
            assert wait_until(lambda: metadata.lookup("t", keys).prefix_length == 2)
        data_dir = ("--data-dir", str(tmp_path / "data"))
        table = kvstore("stats", "--address", address, *data_dir)
        assert table.returncode == 0, table.stderr
        assert "backend lmdb · 1 live nodes · 2 blocks" in table.stdout, table.stdout
        assert "host-1" in table.stdout
        as_json = json.loads(kvstore("stats", "--address", address, *data_dir, "--json").stdout)
        assert as_json["blocks"] == "2" and as_json["nodes"][0]["node"]["node_id"] == "host-1"
        without_token = kvstore("stats", "--address", address)
        assert without_token.returncode == 2 and "UNAUTHENTICATED" in without_token.stderr
        assert "the --data-dir of the `kvstore serve` asked" in without_token.stderr
    finally:
        stop_cleanly(process)
    assert "shutting down" in process.stderr.read()
    assert (tmp_path / "data" / "metadata.lmdb").exists()
    assert (tmp_path / "data" / "disk" / "data.mdb").exists()


def test_settings_come_from_file_then_environment_then_flags(tmp_path):
    path = tmp_path / "kvstore.toml"
    path.write_text('[metadata]\nlisten = "0.0.0.0:1"\nkey_quota_per_tenant = 5\nmax_workers = 8\n')
    from kvstore.config import build_config

    env = {"KVSTORE_METADATA_LISTEN": "127.0.0.1:2", "KVSTORE_METADATA_KEY_QUOTA_PER_TENANT": "7"}
    config = build_config(METADATA, path, env, {"listen": "127.0.0.1:3"})
    assert (config.listen, config.key_quota_per_tenant, config.max_workers) == ("127.0.0.1:3", 7, 8)


@pytest.mark.parametrize(
    ("section", "env", "message"),
    [
        ({"listn": "x"}, {}, "unknown setting"),
        ({}, {"KVSTORE_METADATA_MAX_WORKERS": "many"}, "max_workers must be an integer"),
        ({"backend": "etcd"}, {}, "backend 'etcd' unknown"),
        ({"tls_cert": "/c"}, {}, "both tls_cert and tls_key"),
    ],
)
def test_bad_settings_say_what_to_change(section, env, message):
    with pytest.raises(ConfigError, match=message):
        METADATA.load(section, env, {})


def test_cli_reports_config_errors_without_a_traceback(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[metadata]\nlisen = 1\n")
    result = kvstore("serve", "--config", str(bad))
    assert result.returncode == 2
    assert (
        "unknown setting(s) ['lisen'] in [metadata] of" in result.stderr
        and "Traceback" not in result.stderr
    )
    unknown_policy = kvstore("replay", "trace.jsonl", "--policy", "nope", "--capacity-blocks", "1")
    assert unknown_policy.returncode == 2 and "invalid choice: 'nope'" in unknown_policy.stderr


def test_the_readme_first_command_serves_metadata_and_an_agent(tmp_path):
    """Runs the `kvstore serve` part of the README's first command as written (listening on a
    free port instead of 50051, so a busy machine cannot fail it)."""
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    first_command = readme.split("```bash\n", 1)[1].split("\n", 1)[0]
    serve_args = first_command.split("kvstore serve", 1)[1].split()
    process, address = start_cli("serve", *serve_args, "--listen", "127.0.0.1:0", cwd=tmp_path)
    try:
        assert "node agent" in process.stdout.readline()
        assert health_status(address) == "SERVING"
        data_dir = tmp_path / serve_args[serve_args.index("--data-dir") + 1]
        with KVStoreClient(data_dir / "agent.sock") as client:
            assert client.lookup("t", chunk_keys(Namespace("m", "l"), range(256), 256)).total == 0
    finally:
        stop_cleanly(process)


def cli_help(capsys, command: str) -> str:
    """`kvstore <command> --help`, its lines joined (argparse wraps them)."""
    from kvstore.cli import main

    with pytest.raises(SystemExit):
        main([command, "--help"])
    return " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize(("command", "section"), [("node", "NODE"), ("metadata", "METADATA")])
def test_the_help_shows_each_settings_declared_help_and_default(capsys, command, section):
    import kvstore.sections

    help_text = cli_help(capsys, command)
    for setting in getattr(kvstore.sections, section).settings():
        if setting.flag:
            assert f"{setting.flag} " in help_text
            assert " ".join(setting.spec.help.split()) in help_text, setting.name
    if command == "node":
        assert "shared-memory arena size, e.g. 8GiB (default: 4GiB)" in help_text
        assert "worker connections at once (default: 256)" in help_text
        assert "--transfer {tcp,ucx,none} transfer engine (default: tcp)" in help_text


def test_the_serve_help_shows_the_defaults_serve_gives(capsys):
    help_text = cli_help(capsys, "serve")
    assert "shared-memory arena size, e.g. 8GiB (default: 1GiB)" in help_text
    assert "unix socket workers connect to (default: DATA_DIR/agent.sock)" in help_text
    assert "--backend" not in help_text and "--insecure-transfer" not in help_text


def test_the_readme_test_command_installs_what_ci_installs():
    """The README's second command must pass the tests on a fresh machine: it installs every
    extra, pinned package and tool script .ci/run installs for them (it lacked LMCache, whose
    tests then could not import), the docs build's extra aside."""
    root = Path(__file__).parents[1]
    command = (root / "README.md").read_text().split("```bash\n")[2].split("\n", 1)[0]
    ci = (root / ".ci" / "run").read_text()
    ci_extras = re.search(r"^deploy/install\.sh .*--extras (\S+)", ci, re.M).group(1)
    readme_extras = re.search(r"deploy/install\.sh .*--extras (\S+)", command).group(1)
    assert set(ci_extras.split(",")) - {"docs"} <= set(readme_extras.split(",")), command
    for package in re.findall(r'^pip install -q --no-deps "?([^"\s]+)', ci, re.M):
        assert f"pip install --no-deps {package}" in command, package
    for script in ("deploy/install-sglang.sh", "deploy/test-tools.sh"):
        assert script in command and script in ci
    assert command.endswith("python -m pytest") and ci.rstrip().endswith("python -m pytest")
