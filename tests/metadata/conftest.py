"""Fixtures for metadata tests: a controllable clock, a real redis-server and Redis Cluster,
index factories."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
import uuid
from contextlib import contextmanager

import pytest

from kvstore.bench.redis_cluster_procs import RedisClusterProcesses
from kvstore.metadata.index.memory import MemoryIndex
from tests.metadata.certs import write_tls_files


class FakeClock:
    """Wall-clock stand-in so lease expiry is tested without sleeping."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def redis_server(workdir):
    """A real redis-server on a free loopback port, no persistence; yields its URL."""
    binary = shutil.which("redis-server")
    assert binary, "redis-server is required (apt-get install redis-server; .ci/run does this)"
    port = free_port()
    options = ["--save", "", "--appendonly", "no", "--dir", str(workdir)]
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", *options], stdout=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        process.terminate()
        process.wait(timeout=10)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    """A real redis-server on a loopback port for the whole session."""
    with redis_server(tmp_path_factory.mktemp("redis")) as url:
        yield url


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory):
    """A real 3-master / 3-replica Redis Cluster on loopback ports for the whole session."""
    for binary in ("redis-server", "redis-cli"):
        assert shutil.which(binary), f"{binary} is required (apt-get install redis-server)"
    cluster = RedisClusterProcesses(tmp_path_factory.mktemp("redis-cluster"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


SHARDS = 4  # of the sharded backends ("redis-sharded", "redis-cluster-sharded")


def url_for(backend: str, request) -> str | None:
    """The server (or cluster seeds) a redis backend talks to; None for the embedded ones."""
    if backend in ("redis", "redis-sharded"):
        return request.getfixturevalue("redis_url")
    if backend in ("redis-cluster", "redis-cluster-sharded"):
        return request.getfixturevalue("redis_cluster").url
    return None


def make_index(kind: str, tmp_path, clock, redis_url=None, **options):
    """`redis_url`: a standalone server's for "redis", the cluster's seeds for "redis-cluster".
    The "-sharded" kinds: the same servers, SHARDS shards (redis_shards.py)."""
    if kind == "memory":
        return MemoryIndex(None, clock=clock, **options)
    if kind == "lmdb":
        return MemoryIndex(tmp_path / "meta", clock=clock, **options)
    from kvstore.metadata.index.redis_index import RedisIndex
    from kvstore.metadata.index.redis_shards import ShardedRedisIndex

    prefix = f"test-{uuid.uuid4().hex[:8]}"
    cluster = kind.startswith("redis-cluster")
    if kind.endswith("-sharded"):
        options = {"shards": SHARDS, **options}
        return ShardedRedisIndex(redis_url, prefix=prefix, clock=clock, cluster=cluster, **options)
    return RedisIndex(redis_url, prefix=prefix, clock=clock, cluster=cluster, **options)


@pytest.fixture
def tls_files(tmp_path):
    """A throwaway CA and a server certificate for 127.0.0.1 / localhost: {"ca", "cert", "key"}."""
    return write_tls_files(tmp_path)
