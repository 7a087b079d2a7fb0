"""Fuzzing the tcp data plane against a live serving engine with a cluster secret: random or
garbled handshakes, batch heads, lengths, tenants and truncated frames, before and after a
valid handshake. Afterwards the server still serves a proper client and holds no pins."""

from __future__ import annotations

import socket
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.block import HEADER_BYTES
from kvstore.transfer import auth
from kvstore.transfer.tcp import BATCH, MAGIC, VERSION, TcpEngine
from kvstore.transfer.tcp_wire import pack_request
from tests.transfer.conftest import KEYS, SECRET, SMALL_PAGE_BYTES, TENANT, Pair, new_store

BOUNDS = {"handshake_timeout_s": 0.3, "batch_deadline_s": 0.3, "idle_timeout_s": 0.3}


@pytest.fixture(scope="module")
def live():
    pair = Pair(
        new_store(SMALL_PAGE_BYTES, 8),
        new_store(SMALL_PAGE_BYTES, 8),
        TcpEngine(cluster_secret=SECRET, **BOUNDS),
        TcpEngine(cluster_secret=SECRET),
    )
    pair.put(range(4))
    yield pair
    pair.server.close()
    pair.client.close()
    pair.holder.close()
    pair.reader.close()


def heads() -> st.SearchStrategy[bytes]:
    """Batch heads: mostly the right magic and version, with any tenant length and count."""
    return st.builds(
        BATCH.pack,
        st.sampled_from([MAGIC, b"KVSU", b"\0\0\0\0"]),
        st.sampled_from([VERSION, 1, 0xFFFF]),
        st.integers(0, 0xFFFF),
        st.integers(0, 0xFFFFFFFF),
    )


def requests() -> st.SearchStrategy[bytes]:
    """A valid request for present, absent or random keys, possibly cut short."""
    keys = st.lists(st.sampled_from(KEYS[:8]) | st.binary(min_size=16, max_size=16), max_size=6)
    whole = st.builds(pack_request, st.sampled_from([TENANT, "other", "x" * 64]), keys)
    return st.tuples(whole, st.integers(0, 200)).map(lambda cut: cut[0][: len(cut[0]) - cut[1]])


chunks = st.lists(
    st.binary(max_size=96)
    | heads()
    | requests()
    | st.builds(lambda h, t: h + t, heads(), st.binary(max_size=64)),
    min_size=1,
    max_size=4,
)


def exchange(address: str, handshake: str, payload: list[bytes]) -> None:
    """One connection: a valid, garbled or absent handshake, the chunks, then EOF; reads
    whatever comes back until the server hangs up."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=2.0) as sock:
        if handshake != "none":
            nonce = sock.recv(auth.NONCE_BYTES, socket.MSG_WAITALL)
            hello, _ = auth.client_hello(SECRET, nonce)
            if handshake == "garbled":
                hello = bytes(b ^ 0x5A for b in hello[:32]) + hello[32:]
            sock.sendall(hello)
        try:
            for chunk in payload:
                sock.sendall(chunk)
            sock.shutdown(socket.SHUT_WR)
            while sock.recv(1 << 16):
                pass
        except OSError:  # the server hung up first (reset, broken pipe, not connected)
            pass


@settings(
    max_examples=60,
    deadline=3000,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(handshake=st.sampled_from(["none", "garbled", "valid"]), payload=chunks)
def test_garbage_never_breaks_the_server(live, handshake, payload):
    exchange(live.address, handshake, payload)


def test_after_the_fuzzing_a_proper_client_is_served_and_no_pin_is_left(live):
    deadline = time.monotonic() + 3.0
    while live.holder.pins_held() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert live.holder.pins_held() == 0

    keys = KEYS[:4]
    received = live.fetch(keys)

    assert received == [SMALL_PAGE_BYTES] * 4
    assert live.land(keys, received) == [True] * 4
    assert live.reader.checksum_failures == 0
    assert HEADER_BYTES < SMALL_PAGE_BYTES
