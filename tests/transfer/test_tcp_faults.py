"""The tcp engine under real faults: a holder process killed mid-batch, bytes flipped in
transit, peers that lie about lengths or die inside a block, and pooled connections that the
peer has closed. A broken transfer never yields a readable partial block."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvstore.block import HEADER_BYTES
from kvstore.tiers.host import ARENA_PREFIX, SHM_DIR
from kvstore.transfer import tcp
from kvstore.transfer.tcp import BATCH, FRAME, MAGIC, VERSION, TcpEngine
from tests.transfer.conftest import (
    KEYS,
    SMALL_PAGE_BYTES,
    TENANT,
    Pair,
    land,
    new_store,
    payload,
    stored_payload,
)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A holder in its own process: 64 blocks of 4 MiB, served slowly enough to be killed mid-batch.
# It prints its address, then the number of each block as it starts serving it.
HOLDER_SCRIPT = """
import time
from contextlib import contextmanager
from kvstore.block import HEADER_BYTES
from kvstore.transfer.tcp import TcpEngine
from tests.transfer.conftest import KEYS, new_store, payload
PAGE = 4 << 20
store = new_store(PAGE, 65)
for n in range(64):
    store.put(KEYS[n], None, payload(n, PAGE - HEADER_BYTES))
numbers = {key: n for n, key in enumerate(KEYS)}

@contextmanager
def slow_open_block(key, tenant):
    print(numbers[key], flush=True)
    time.sleep(0.05)
    with store.open_tenant_block(key, tenant) as view:
        yield view

print(TcpEngine().serve(slow_open_block), flush=True)
time.sleep(120)
"""


@pytest.fixture
def pair(stores):
    made = Pair(*stores, TcpEngine(), TcpEngine())
    yield made
    made.server.close()
    made.client.close()


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_holder_killed_mid_batch_leaves_only_whole_verified_blocks():
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER_SCRIPT], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True
    )
    reader, client = new_store(4 << 20, 65), TcpEngine()
    try:
        address = holder.stdout.readline().strip()
        pages = [reader.reserve_page(key) for key in KEYS[:64]]
        with ThreadPoolExecutor(1) as pool:
            started = time.monotonic()
            fetching = pool.submit(client.fetch, address, TENANT, KEYS[:64], pages, 20.0)
            wait_until_serving(holder, 5)  # blocks 0-4 are on their way
            holder.send_signal(signal.SIGKILL)
            received = fetching.result(timeout=25.0)
        elapsed = time.monotonic() - started

        complete = received.index(0)
        assert 3 <= complete < 64 and received[complete:] == [0] * (64 - complete)
        assert received[:complete] == [4 << 20] * complete
        assert elapsed < 20.0
        assert land(reader, KEYS[:64], received) == [True] * complete + [False] * (64 - complete)
        assert reader.lookup(KEYS[:64]) == complete
        assert reader.checksum_failures == 0
        assert stored_payload(reader, KEYS[2]) == payload(2, (4 << 20) - HEADER_BYTES)
    finally:
        holder.kill()
        holder.wait()
        for arena in SHM_DIR.glob(f"{ARENA_PREFIX}{holder.pid}-*"):  # a killed owner leaves it
            arena.unlink(missing_ok=True)
        client.close()
        reader.close()


def wait_until_serving(holder: subprocess.Popen, number: int) -> None:
    for line in holder.stdout:
        if line.strip() == str(number):
            return
    pytest.fail(f"the holder exited ({holder.wait()}) before serving block {number}")


class FlippingProxy:
    """Forwards one connection to `target`, flipping the last byte of the first `marker`
    it sees in the server-to-client stream (a bit error the TCP checksum missed)."""

    def __init__(self, target: str, marker: bytes) -> None:
        host, port = target.rsplit(":", 1)
        self.target, self.marker, self.flipped = (host, int(port)), marker, False
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        client, _ = self.listener.accept()
        server = socket.create_connection(self.target)
        threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
        self._pump(server, client, True)

    def _pump(self, source: socket.socket, sink: socket.socket, flip: bool) -> None:
        window = b""  # the stream's tail, so a marker split across reads is still found
        while data := source.recv(1 << 16):
            data = bytearray(data)
            at = (window + data).find(self.marker) if flip and not self.flipped else -1
            if at >= 0:
                data[at + len(self.marker) - 1 - len(window)] ^= 0x01
                self.flipped = True
            window = bytes(data[-(len(self.marker) - 1) :])
            sink.sendall(data)
        sink.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.listener.close()


def test_a_byte_flipped_in_transit_fails_the_checksum_and_only_that_block(pair):
    keys = pair.put(range(4))
    marker = payload(2, SMALL_PAGE_BYTES - HEADER_BYTES)[5000:5016]
    proxy = FlippingProxy(pair.address, marker)
    pair.address = proxy.address
    try:
        received = pair.fetch(keys)
    finally:
        proxy.close()

    assert proxy.flipped
    assert received == [SMALL_PAGE_BYTES] * 4
    assert pair.land(keys, received) == [True, True, False, True]
    assert pair.reader.checksum_failures == 1
    assert stored_payload(pair.reader, KEYS[2]) is None


class FakePeer:
    """Answers each connection's first request with `frames`: (claimed length, bytes to send),
    then hangs up. Counts connections."""

    def __init__(self, frames: list[tuple[int, int]]) -> None:
        self.frames, self.accepted = frames, 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.accepted += 1
            with conn:
                _, _, tenant_bytes, count = BATCH.unpack(conn.recv(BATCH.size, socket.MSG_WAITALL))
                conn.recv(tenant_bytes + count * 16, socket.MSG_WAITALL)
                conn.sendall(BATCH.pack(MAGIC, VERSION, 0, count))
                for claimed, sent in self.frames:
                    conn.sendall(FRAME.pack(claimed) + bytes(sent))

    def close(self) -> None:
        self.listener.close()


@pytest.mark.parametrize(
    "frames",
    [
        [(100, 100), (SMALL_PAGE_BYTES + 1, 0)],  # claims more than the page: protocol error
        [(100, 100), (5000, 2000)],  # dies inside the second block
    ],
    ids=["length-over-page", "eof-inside-block"],
)
def test_a_lying_or_dying_peer_gives_zero_from_the_break_on(stores, frames):
    peer, client = FakePeer(frames), TcpEngine()
    pages = [stores[1].reserve_page(key) for key in KEYS[:3]]
    try:
        assert client.fetch(peer.address, TENANT, KEYS[:3], pages, 2.0) == [100, 0, 0]
        assert client.stats.transfers_broken == 1
        client.fetch(peer.address, TENANT, KEYS[:3], pages, 2.0)
        assert peer.accepted == 2  # the broken connection was never reused
    finally:
        peer.close()
        client.close()


@pytest.mark.parametrize("idle_check", [True, False], ids=["seen-idle", "seen-on-use"])
def test_a_pooled_connection_the_peer_closed_is_replaced_not_reported_as_a_miss(
    stores, monkeypatch, idle_check
):
    if not idle_check:  # the hang-up is only noticed when the request gets no answer
        monkeypatch.setattr(tcp, "is_quiet", lambda sock: True)
    holder, reader = stores
    server, client = TcpEngine(idle_timeout_s=0.2), TcpEngine()
    pair = Pair(holder, reader, server, client)
    try:
        keys = pair.put(range(4))
        assert pair.land(keys[:2], pair.fetch(keys[:2])) == [True, True]
        time.sleep(0.5)  # the server drops the idle connection; the client still pools it

        assert pair.land(keys[2:], pair.fetch(keys[2:])) == [True, True]
        assert client.stats.connections_opened == 2
        assert client.stats.transfers_broken == 0
    finally:
        server.close()
        client.close()
