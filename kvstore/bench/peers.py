"""The other side of each benchmark, as child processes: a metadata service, a node agent, a
block holder serving over a transfer engine, a raw socket sender, a redis-server.

Runs in the benchmark process (context managers) and in the children they spawn.
"""

from __future__ import annotations

import mmap
import multiprocessing
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from kvstore.errors import ConfigError

TENANT = "default"  # the tenant TieredStore.put stores blocks under
UCX_ENV = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo", "UCX_WARN_UNUSED_ENV_VARS": "n"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def cli_process(*args: str, ready: str) -> Iterator[tuple[subprocess.Popen, str]]:
    """`python -m kvstore ARGS`, once it printed a line containing `ready`."""
    process = subprocess.Popen(
        [sys.executable, "-m", "kvstore", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, **UCX_ENV},
    )
    try:
        line = process.stdout.readline()
        if ready not in line:
            raise ConfigError(f"`kvstore {args[0]}` did not start: {line!r}")
        yield process, line
    finally:
        process.terminate()
        process.wait(timeout=30)


@contextmanager
def metadata_service(backend: str = "lmdb") -> Iterator[str]:
    """A metadata service on a free loopback port; yields its address."""
    with (
        tempfile.TemporaryDirectory() as data_dir,
        cli_process(
            "metadata",
            "--backend",
            backend,
            "--listen",
            "127.0.0.1:0",
            "--data-dir",
            data_dir,
            ready="listening on",
        ) as (_, line),
    ):
        yield line.split("listening on ", 1)[1].split(",", 1)[0]


def secret_file(directory: Path) -> Path:
    """A fresh cluster secret (0600) in `directory`, for the agents a bench starts."""
    path = directory / "cluster.secret"
    path.touch(mode=0o600)
    path.write_text(secrets.token_urlsafe(32))
    return path


@contextmanager
def node_agent(directory: Path, page_bytes: int, pages: int, *flags: str) -> Iterator[Path]:
    """A node agent with an arena of `pages` pages and no metadata service; yields its socket."""
    socket_path = directory / "agent.sock"
    with cli_process(
        "node",
        "--socket-path",
        str(socket_path),
        "--transfer",
        "none",
        "--page-size-bytes",
        str(page_bytes),
        "--host-capacity-bytes",
        str(page_bytes * pages),
        "--host-policy",
        "lru",
        *flags,
        ready="serving workers",
    ):
        yield socket_path


def _hold_blocks(engine_name: str, block_bytes: int, count: int, secret, queue) -> None:
    """Child: a store of `count` random blocks served by `engine_name` until killed."""
    from kvstore.bench.transfer import _keys
    from kvstore.block import HEADER_BYTES
    from kvstore.eviction import make_policy
    from kvstore.store import TieredStore, TierSlot
    from kvstore.tiers.host import HostTier
    from kvstore.transfer.base import make_engine

    page_bytes = block_bytes + HEADER_BYTES
    store = TieredStore([TierSlot(HostTier(count * page_bytes, page_bytes), make_policy("lru"))])
    payload = np.random.default_rng(1).integers(0, 256, block_bytes, dtype=np.uint8)
    for key in _keys(0, count):
        store.put(key, None, payload.tobytes())
    engine = make_engine(engine_name, cluster_secret=secret)
    queue.put(engine.serve(store.open_tenant_block))
    time.sleep(3600)


@contextmanager
def block_holder(
    engine_name: str, block_bytes: int, count: int, secret: bytes | None = None
) -> Iterator[str]:
    """A holder process serving `count` blocks (with `secret`, to authenticated peers only);
    yields its address. The secret reaches the child through a pipe, never its command line."""
    os.environ.update(UCX_ENV)
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    args = (engine_name, block_bytes, count, secret, queue)
    child = context.Process(target=_hold_blocks, args=args)
    child.start()
    try:
        yield queue.get(timeout=120)
    finally:
        child.kill()
        child.join()
        from kvstore.tiers.host import remove_stale_arenas

        remove_stale_arenas()


def _send_forever(page_bytes: int, count: int, queue) -> None:
    """Child: for every 1-byte request, send its `count` pages of `page_bytes` with sendall,
    each page from its own memory, as a holder sends its arena's (not one hot buffer again)."""
    pages = shared_pages(count, page_bytes)
    pages.fill(1)
    listener = socket.create_server(("127.0.0.1", 0))
    queue.put(f"127.0.0.1:{listener.getsockname()[1]}")
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while conn.recv(1):
        for page in pages:
            conn.sendall(memoryview(page))


def shared_pages(count: int, page_bytes: int) -> np.ndarray:
    """`count` pages of shared memory, the kind an arena is (4 KiB pages: numpy's own large
    arrays get transparent huge pages, which an arena in /dev/shm does not), zeroed."""
    return np.frombuffer(mmap.mmap(-1, count * page_bytes), dtype=np.uint8).reshape(count, -1)


@contextmanager
def raw_sender(page_bytes: int, count: int) -> Iterator[socket.socket]:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_send_forever, args=(page_bytes, count, queue))
    child.start()
    host, _, port = queue.get(timeout=60).rpartition(":")
    conn = socket.create_connection((host, int(port)))
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        yield conn
    finally:
        conn.close()
        child.kill()
        child.join()


def raw_receive_s(conn: socket.socket, pages: np.ndarray) -> float:
    """Ask for one batch and recv_into each page; returns the seconds it took."""
    started = time.perf_counter()
    conn.sendall(b"x")
    for page in pages:
        view, received = memoryview(page), 0
        while received < len(view):
            received += conn.recv_into(view[received:])
    return time.perf_counter() - started


@contextmanager
def redis_server():
    """A redis-server on a free loopback port; yields a redis-py client (hiredis if present)."""
    import redis

    binary = shutil.which("redis-server")
    if binary is None:
        raise ConfigError(
            "this benchmark needs redis-server on PATH (apt-get install redis-server)"
        )
    with tempfile.TemporaryDirectory() as workdir:
        port = free_port()
        server = subprocess.Popen(
            [
                binary,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--dir",
                workdir,
                "--proto-max-bulk-len",
                "1gb",
                "--client-query-buffer-limit",
                "1gb",
            ],
            stdout=subprocess.DEVNULL,
        )
        try:
            client = redis.Redis(host="127.0.0.1", port=port)
            for _ in range(200):
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    time.sleep(0.05)
            yield client
        finally:
            server.terminate()
            server.wait(timeout=10)
