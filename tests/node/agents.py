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


@contextmanager
def running_agent(tmp_path: Path, name: str = "node-a", **settings):
    options = {**SMALL, "transfer": "none", **settings}
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
        sys.executable, "-m", "kvstore", "node", "--node-id", name,
        "--socket-path", str(socket_path), "--host-capacity-bytes", "16MiB",
        "--page-size-bytes", "1MiB", *args,
    ]  # fmt: skip
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, **UCX_ENV, **(env or {})},
    )  # fmt: skip
    line = process.stdout.readline()
    if "serving workers on" not in line:
        process.kill()
        raise AssertionError(f"node {name} did not start: {line!r} {process.stderr.read()}")
    return process, socket_path
