"""Helpers that start real metadata services on loopback: in-process, or as a child process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from contextlib import contextmanager

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.metadata.client import MetadataClient
from kvstore.metadata.records import BlockEntry, NodeRecord
from kvstore.metadata.server.server import MetadataConfig, MetadataServer
from kvstore.metadata.server.service import ServiceLimits

FAST_LIMITS = ServiceLimits(min_lease_ttl_ms=200, watch_poll_s=0.1)


@contextmanager
def running_server(tmp_path, **settings):
    settings = {
        "listen": "127.0.0.1:0",
        "data_dir": tmp_path / "meta",
        "limits": FAST_LIMITS,
        **settings,
    }
    config = MetadataConfig(**settings)
    server = MetadataServer(config)
    server.start()
    try:
        yield server
    finally:
        server.stop(grace_s=0.5)


def client_for(server: MetadataServer, **options) -> MetadataClient:
    return MetadataClient(f"127.0.0.1:{server.port}", **options)


def health_status(address: str, service: str = "", timeout_s: float = 2.0) -> str:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def start_cli(*args: str, env: dict | None = None, cwd=None) -> tuple[subprocess.Popen, str]:
    """Run `python -m kvstore ARGS` and wait for its 'listening on HOST:PORT' line."""
    process = subprocess.Popen(
        [sys.executable, "-m", "kvstore", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
        cwd=cwd,
    )
    line = process.stdout.readline()
    if "listening on" not in line:
        process.kill()
        raise AssertionError(f"service did not start: {line!r} {process.stderr.read()}")
    address = line.split("listening on ", 1)[1].split(",", 1)[0]
    return process, address


def wait_until(predicate, timeout_s: float = 5.0, interval_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


# ---- for the lookup tests (LookupStream and the lookup port) ------------------------------------
LOOKUP_KEYS = [bytes([i]) * 16 for i in range(8)]
ALICE = "alice-token-0123456789"
ADMIN = "admin-token-0123456789"


def calls(server: MetadataServer, method: str, code: str = "OK") -> float:
    """How many calls of `method` the service counted with status `code`."""
    sample = server.metrics.registry.get_sample_value(
        "kvstore_metadata_rpcs_total", {"method": method, "code": code}
    )
    return sample or 0.0


def publish(client, tenant: str = "t", keys=LOOKUP_KEYS[:5]) -> None:
    """The first five LOOKUP_KEYS, held by node "holder"."""
    lease, _ = client.register_node(NodeRecord("holder", tcp_address="10.0.0.1:1"))
    client.publish("holder", lease, tenant, [BlockEntry(k, "host", 1, 1) for k in keys])
