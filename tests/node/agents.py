"""Helpers that run real node agents for tests: in-process, or as `kvstore node` processes."""

from __future__ import annotations

import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

from kvstore.node.agent import NodeAgent, NodeConfig

SMALL = {"host_capacity_bytes": 16 << 20, "page_size_bytes": 1 << 20}
UCX_ENV = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo", "UCX_WARN_UNUSED_ENV_VARS": "n"}
TEST_CLUSTER_SECRET = "kvstore-tests-cluster-secret-0123456789"


def cluster_secret_file(directory: Path) -> Path:
    """The tests' one cluster secret, as a file in `directory`: every agent a test starts
    with it serves the others, wherever each one's file is."""
    path = directory / "tests-cluster.secret"
    if not path.exists():
        path.write_text(TEST_CLUSTER_SECRET)
    return path


def _with_a_secret(tmp_path: Path, options: dict) -> dict:
    """An agent with a transfer engine needs a cluster secret (or to be told to run open)."""
    if options["transfer"] == "none" or {"cluster_secret_file", "insecure_transfer"} & set(options):
        return options
    return {**options, "cluster_secret_file": cluster_secret_file(tmp_path)}


@contextmanager
def running_agent(tmp_path: Path, name: str = "node-a", **settings):
    options = _with_a_secret(tmp_path, {**SMALL, "transfer": "none", **settings})
    agent = NodeAgent(NodeConfig(node_id=name, socket_path=tmp_path / f"{name}.sock", **options))
    agent.start()
    try:
        yield agent
    finally:
        agent.stop()


def start_node_process(tmp_path: Path, name: str, *args: str, env: dict | None = None):
    """`python -m kvstore node ...`; returns (process, socket path) once it announced itself."""
    socket_path = tmp_path / f"{name}.sock"
    command = [
        sys.executable,
        "-m",
        "kvstore",
        "node",
        "--node-id",
        name,
        "--socket-path",
        str(socket_path),
        "--host-capacity-bytes",
        "16MiB",
        "--page-size-bytes",
        "1MiB",
        *args,
        *_secret_flags(tmp_path, args),
    ]
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **UCX_ENV, **(env or {})},
    )
    line = process.stdout.readline()
    if "serving workers on" not in line:
        process.kill()
        raise AssertionError(f"node {name} did not start: {line!r} {process.stderr.read()}")
    return process, socket_path


def _secret_flags(tmp_path: Path, args: tuple[str, ...]) -> list[str]:
    """--cluster-secret-file of the tests' secret, unless `args` set one, say --insecure-transfer
    or --transfer none (tcp is the default)."""
    transfer = args[args.index("--transfer") + 1] if "--transfer" in args else "tcp"
    if transfer == "none" or {"--cluster-secret-file", "--insecure-transfer"} & set(args):
        return []
    return ["--cluster-secret-file", str(cluster_secret_file(tmp_path))]
