"""`kvstore serve | node | metadata --check`: every setting validated as a start would, nothing
started; "ok" and exit 0, or exit 2 naming every problem."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.cli import main
from tests.deploy.mounts import SECRET_CONTENT


@pytest.fixture
def files(tmp_path):
    """A socket directory the agent accepts and one Secret file of each kind."""
    (tmp_path / "run").mkdir(mode=0o750)
    for key, content in SECRET_CONTENT.items():
        (tmp_path / key).write_bytes(content)
    return tmp_path


def node_args(files: Path, *extra: str) -> list[str]:
    return [
        "node",
        "--socket-path",
        str(files / "run" / "agent.sock"),
        "--host-capacity-bytes",
        "64MiB",
        "--page-size-bytes",
        "1MiB",
        "--disk-dir",
        str(files / "disk"),
        "--disk-capacity-bytes",
        "1GiB",
        "--metadata-address",
        "meta.kvstore.svc:50051",
        "--metadata-token-file",
        str(files / "agent.token"),
        "--worker-credentials",
        str(files / "workers.conf"),
        "--cluster-secret-file",
        str(files / "cluster.secret"),
        "--transfer-host",
        "0.0.0.0",
        "--transfer-port",
        "50060",
        "--advertise-host",
        "10.0.0.5",
        "--node-metrics-listen",
        "0.0.0.0:9101",
        *extra,
        "--check",
    ]


def metadata_args(files: Path, *extra: str) -> list[str]:
    return [
        "metadata",
        "--listen",
        "0.0.0.0:50051",
        "--data-dir",
        str(files / "meta"),
        "--token-file",
        str(files / "tokens.txt"),
        "--tls-cert",
        str(files / "tls.crt"),
        "--tls-key",
        str(files / "tls.key"),
        "--metrics-listen",
        "0.0.0.0:9100",
        *extra,
        "--check",
    ]


def test_a_valid_node_prints_ok_and_creates_nothing(files, capsys):
    before = sorted(files.rglob("*"))
    assert main(node_args(files)) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "ok"
    assert sorted(files.rglob("*")) == before  # no disk dir, no socket, no LMDB


def test_a_valid_metadata_service_and_embedded_default_print_ok(files, capsys):
    assert main(metadata_args(files)) == 0
    assert main(["serve", "--data-dir", str(files / "data"), "--check"]) == 0
    assert capsys.readouterr().out.splitlines() == ["ok", "ok"]
    assert not (files / "data").exists() and not (files / "meta").exists()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("--worker-credentials", "{f}/tokens.txt"), "expected 'token:T', 'uid:N' or 'gid:N'"),
        (("--metadata-token-file", "{f}/missing"), "cannot read metadata token"),
        (("--cluster-secret-file", "{f}/empty"), "cluster secret file"),
        (("--host-capacity-bytes", "512KiB"), "host tier: capacity_bytes=524288 holds no page"),
        (("--disk-dir", "{f}/tokens.txt/disk"), "is not a directory"),
        (("--host-policy", "mru"), "host_policy 'mru' unknown"),
        (("--metadata-address", "meta.kvstore.svc"), "is not host:port"),
        (("--advertise-host", "$(POD_IP)"), "unexpanded variable"),
        (("--transfer-port", "70000"), "is not a port"),
    ],
)
def test_each_bad_node_setting_exits_2_with_its_message(files, capsys, change, message):
    (files / "empty").write_text("")
    flag, value = change
    args = node_args(files)
    if flag in args:
        args[args.index(flag) + 1] = value.format(f=files)
    else:
        args[-1:-1] = [flag, value]
    assert main(args) == 2
    assert message in capsys.readouterr().err


def test_every_problem_is_named_at_once(files, capsys):
    args = node_args(files, "--host-policy", "mru", "--node-metrics-listen", "nohost")
    args[args.index("--metadata-token-file") + 1] = str(files / "missing")
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "check failed" in err and err.count("\n  - ") == 3


@pytest.mark.parametrize(
    ("mode", "message"),
    [(0o770, "writable by group or others"), (0o757, "writable by group or others")],
)
def test_the_socket_directory_follows_the_agents_rules(files, capsys, mode, message):
    (files / "run").chmod(mode)
    assert main(node_args(files)) == 2
    assert message in capsys.readouterr().err


def test_a_socket_path_too_long_for_a_unix_socket_is_refused(files, capsys):
    deep = files / "run" / ("d" * 120)
    args = node_args(files)
    args[args.index("--socket-path") + 1] = str(deep / "agent.sock")
    assert main(args) == 2
    assert "longer than 107 bytes" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("--tls-key", "{f}/tokens.txt"), "cannot be loaded"),
        (("--token-file", "{f}/agent.token"), "expected 'TOKEN TENANT [node=NODE_ID]'"),
        (("--data-dir", "{f}/tokens.txt/meta"), "is not a directory"),
        (("--listen", ":50051"), "names no host"),
    ],
)
def test_each_bad_metadata_setting_exits_2_with_its_message(files, capsys, change, message):
    flag, value = change
    args = metadata_args(files)
    args[args.index(flag) + 1] = value.format(f=files)
    assert main(args) == 2
    assert message in capsys.readouterr().err


def test_a_redis_backend_checks_its_url_without_connecting(files, capsys):
    good = ["metadata", "--backend", "redis", "--redis-url", "redis://127.0.0.1:1/0", "--check"]
    assert main(good) == 0
    assert main(["metadata", "--backend", "redis", "--redis-url", "http://x", "--check"]) == 2
    assert "Redis URL must specify one of the following schemes" in capsys.readouterr().err


def test_settings_from_a_config_file_and_the_environment_are_checked(files, capsys, monkeypatch):
    (files / "metadata.toml").write_text('[metadata]\nbackend = "etcd"\n')
    assert main(["metadata", "--config", str(files / "metadata.toml"), "--check"]) == 2
    assert "backend 'etcd' unknown" in capsys.readouterr().err
    monkeypatch.setenv("KVSTORE_NODE_METADATA_TLS_CA", str(files / "agent.token"))
    assert main(node_args(files)) == 2
    assert "metadata_tls_ca" in capsys.readouterr().err


def test_the_cli_check_listens_on_nothing(files):
    """As a process: exit 0, "ok", and the ports it was given are still free."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    args = node_args(files, "--node-metrics-listen", f"127.0.0.1:{port}")
    result = subprocess.run(
        [sys.executable, "-m", "kvstore", *args], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "ok"
    with socket.socket() as again:
        again.bind(("127.0.0.1", port))
    assert not (files / "run" / "agent.sock").exists()
