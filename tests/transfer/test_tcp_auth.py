"""The tcp engine with a cluster secret, narrated: a peer without the secret (or with a wrong
one) gets the server's nonce and nothing else, a fake holder cannot prove the secret, and a
relay that rewrites a block and fixes up its xxh3 is caught by the block's MAC."""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import threading
import time

import pytest
import torch

from kvstore.block import HEADER_BYTES, pack_header, payload_checksum, unpack_header
from kvstore.errors import TransferError
from kvstore.owned import owned_key
from kvstore.transfer import auth
from kvstore.transfer.tcp import BATCH, FRAME, TcpEngine
from kvstore.transfer.tcp_wire import VERSION, pack_request
from tests.transfer.conftest import KEYS, SECRET, SMALL_PAGE_BYTES, TENANT, Pair

WRONG_SECRET = b"not-the-cluster-secret-at-all-00"


@pytest.fixture
def secured(stores):
    server = TcpEngine(cluster_secret=SECRET, handshake_timeout_s=1.0)
    made = Pair(*stores, server, TcpEngine(cluster_secret=SECRET))
    made.put([0])  # KEYS[0] present, KEYS[1] absent
    yield made
    made.server.close()
    made.client.close()


def everything_received(address: str, prologue) -> bytes:
    """Connect, let `prologue` ask for one key its way, read until the server hangs up."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=3.0) as sock:
        got = prologue(sock)
        try:
            while data := sock.recv(1 << 16):
                got += data
        except ConnectionResetError:  # closed with our request unread: a reset, not a FIN
            pass
    return got


def no_handshake(key):
    def prologue(sock):
        sock.sendall(pack_request(TENANT, [key]))
        return b""

    return prologue


def wrong_secret(key):
    def prologue(sock):
        nonce = sock.recv(auth.NONCE_BYTES, socket.MSG_WAITALL)
        hello, _ = auth.client_hello(WRONG_SECRET, nonce)
        sock.sendall(hello + pack_request(TENANT, [key]))
        return nonce

    return prologue


@pytest.mark.parametrize("prologue", [no_handshake, wrong_secret], ids=["no-secret", "wrong"])
def test_an_unauthenticated_peer_gets_only_the_nonce_for_present_and_absent_keys(secured, prologue):
    present = everything_received(secured.address, prologue(KEYS[0]))
    absent = everything_received(secured.address, prologue(KEYS[1]))

    assert len(present) == len(absent) == auth.NONCE_BYTES  # the nonce, then EOF: nothing else
    assert secured.server.stats.handshakes_failed == 2
    assert secured.server.stats.batches_served == 0
    assert secured.holder.pins_held() == 0


@pytest.mark.parametrize("secret", [None, WRONG_SECRET], ids=["no-secret", "wrong"])
def test_an_engine_with_no_or_the_wrong_secret_fetches_nothing(secured, stores, secret):
    client = TcpEngine(cluster_secret=secret, handshake_timeout_s=1.0)
    try:
        outcomes = []
        for key in KEYS[:2]:  # present, absent: the same outcome
            page = stores[1].reserve_page(key)
            try:
                outcomes.append(client.fetch(secured.address, TENANT, [key], [page], 2.0))
            except TransferError:
                outcomes.append("refused")
            stores[1].abort(key)
    finally:
        client.close()

    assert outcomes[0] == outcomes[1]
    assert outcomes[0] in ("refused", [0])


def test_a_silent_peer_is_dropped_after_the_handshake_timeout(stores):
    server = TcpEngine(cluster_secret=SECRET, handshake_timeout_s=0.3)
    address = server.serve(stores[0].open_tenant_block)
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=3.0) as sock:
            started = time.monotonic()
            nonce = sock.recv(auth.NONCE_BYTES, socket.MSG_WAITALL)
            assert sock.recv(1) == b""  # dropped without a word from us
            assert time.monotonic() - started < 1.5
        assert len(nonce) == auth.NONCE_BYTES
        assert server.stats.handshakes_failed == 1
    finally:
        server.close()


class FakeHolder:
    """Does not know the secret: sends a nonce, takes the hello, answers with a made-up proof,
    then a well-formed block (valid header and xxh3) for whatever is asked."""

    def __init__(self, block: bytes) -> None:
        self.block, self.served = block, threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            conn.sendall(auth.new_nonce())
            conn.recv(auth.HELLO_BYTES, socket.MSG_WAITALL)
            conn.sendall(auth.new_nonce())  # not a proof
            try:
                conn.recv(BATCH.size, socket.MSG_WAITALL)
                conn.sendall(BATCH.pack(b"KVST", VERSION, 0, 1) + FRAME.pack(len(self.block)))
                conn.sendall(self.block + bytes(auth.TAG_BYTES))
                self.served.set()
            except OSError:
                pass

    def close(self) -> None:
        self.listener.close()


def test_a_fake_holder_without_the_secret_is_refused_before_any_block_lands(secured, stores):
    with secured.holder.open_tenant_block(KEYS[0], TENANT) as whole:
        genuine = bytes(whole.numpy())
    fake, reader = FakeHolder(genuine), stores[1]
    page = reader.reserve_page(KEYS[0])
    page.zero_()
    try:
        with pytest.raises(TransferError, match="did not prove"):
            secured.client.fetch(fake.address, TENANT, [KEYS[0]], [page], 2.0)
    finally:
        fake.close()

    assert int(page.count_nonzero()) == 0
    assert secured.client.stats.handshakes_failed == 1


class ForgingRelay:
    """Forwards one connection to `target`; in the server-to-client stream it rewrites the
    payload of block `victim` (0-based within the batch) and fixes the xxh3 in its header, as
    an attacker who knows the format but not the secret would."""

    def __init__(self, target: str, victim: int, authenticated: bool) -> None:
        host, port = target.rsplit(":", 1)
        self.target, self.victim, self.authenticated = (host, int(port)), victim, authenticated
        self.forged = False
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        client, _ = self.listener.accept()
        server = socket.create_connection(self.target)
        threading.Thread(target=self._pump, args=(client, server), daemon=True).start()
        with client, server, contextlib.suppress(OSError):
            self._forward_answer(server, client)

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(1 << 16):
                sink.sendall(data)
        except OSError:
            pass

    def _forward_answer(self, server: socket.socket, client: socket.socket) -> None:
        def take(count: int) -> bytes:
            return server.recv(count, socket.MSG_WAITALL) if count else b""

        if self.authenticated:  # nonce, then the server's proof
            client.sendall(take(auth.NONCE_BYTES))
            client.sendall(take(auth.PROOF_BYTES))
        head = take(BATCH.size)
        client.sendall(head)
        tag_bytes = auth.TAG_BYTES if self.authenticated else 0
        for index in range(BATCH.unpack(head)[3]):
            frame = take(FRAME.size)
            block = bytearray(take(FRAME.unpack(frame)[0]))
            if index == self.victim and block:
                block[HEADER_BYTES + 100] ^= 0xFF
                header = unpack_header(block)
                fixed = dataclasses.replace(header, checksum=payload_checksum(block[HEADER_BYTES:]))
                block[:HEADER_BYTES] = pack_header(fixed)
                self.forged = True
            client.sendall(frame + block + take(tag_bytes))

    def close(self) -> None:
        self.listener.close()


def test_without_a_secret_a_relay_that_fixes_the_xxh3_gets_its_forgery_accepted(stores):
    """The threat the MAC answers: the checksum alone cannot tell a forged block."""
    pair = Pair(*stores, TcpEngine(), TcpEngine())
    try:
        keys = pair.put(range(3))
        relay = ForgingRelay(pair.address, victim=1, authenticated=False)
        pair.address = relay.address
        received = pair.fetch(keys)
        relay.close()
    finally:
        pair.server.close()
        pair.client.close()

    assert relay.forged
    assert pair.land(keys, received) == [True, True, True]  # forged block 1 is "valid"


def test_a_relay_that_rewrites_a_block_and_fixes_its_xxh3_is_refused_by_the_mac(secured):
    keys = secured.put(range(3))
    relay = ForgingRelay(secured.address, victim=1, authenticated=True)
    secured.address = relay.address
    try:
        received = secured.fetch(keys)
    finally:
        relay.close()

    assert relay.forged
    assert received == [SMALL_PAGE_BYTES, 0, 0]  # broken from the forged block on
    assert secured.land(keys, received) == [True, False, False]
    assert secured.client.stats.macs_failed == 1
    assert secured.client.stats.transfers_broken == 1


def test_a_proof_reflected_back_does_not_authenticate_the_server():
    """Roles are in the proofs: a relay cannot echo the client's proof as the server's."""
    server_nonce = auth.new_nonce()
    hello, client_nonce = auth.client_hello(SECRET, server_nonce)
    reflected = hello[auth.NONCE_BYTES :]

    assert auth.accept_reply(SECRET, server_nonce, client_nonce, reflected) is None
    proof, server_session = auth.accept_hello(SECRET, server_nonce, hello)
    assert auth.accept_reply(SECRET, server_nonce, client_nonce, proof) == server_session
    assert auth.accept_hello(WRONG_SECRET, server_nonce, hello) is None


@pytest.mark.parametrize(
    ("host", "secret", "warned"),
    [
        ("10.1.2.3", None, True),
        ("0.0.0.0", None, True),
        ("127.0.0.1", None, False),
        ("::1", None, False),
        ("10.1.2.3", SECRET, False),
    ],
)
def test_serving_beyond_loopback_without_a_secret_logs_a_warning(caplog, host, secret, warned):
    with caplog.at_level("WARNING", logger="kvstore.transfer.auth"):
        auth.warn_if_open("tcp", host, secret)
    assert bool(caplog.records) == warned


def test_a_relay_that_rewrites_the_requests_tenant_gets_nothing_served(stores):
    """An on-path relay forwards a genuine handshake, then rewrites the tenant of the request
    (tenA to tenB): the request was not authenticated, so the holder served tenant B's block
    through it in clear (the reader refused it, but the relay had read it). Requests are
    sealed with the session key now: the holder serves nothing and drops the connection."""
    holder, _ = stores
    secret_kv = torch.frombuffer(bytearray(b"tenant-B-secret-KV" * 10), dtype=torch.uint8)
    held = owned_key("tenB", KEYS[0])
    holder.reserve(held, None, secret_kv.numel()).copy_(secret_kv)
    holder.commit(held)
    server, client = TcpEngine(cluster_secret=SECRET), TcpEngine(cluster_secret=SECRET)
    host, port = server.serve(holder.open_tenant_block).rsplit(":", 1)
    listener = socket.create_server(("127.0.0.1", 0))
    seen = bytearray()

    def pump(source, sink, rewrite):
        with contextlib.suppress(OSError):
            while data := source.recv(1 << 16):
                if not rewrite:
                    seen.extend(data)
                sink.sendall(data.replace(b"tenA", b"tenB") if rewrite else data)
            sink.shutdown(socket.SHUT_WR)

    def relay():
        accepted, _ = listener.accept()
        upstream = socket.create_connection((host, int(port)))
        threading.Thread(target=pump, args=(upstream, accepted, False), daemon=True).start()
        pump(accepted, upstream, True)

    threading.Thread(target=relay, daemon=True).start()
    page = torch.zeros(SMALL_PAGE_BYTES, dtype=torch.uint8)
    try:
        with contextlib.suppress(TransferError):
            assert client.fetch(
                f"127.0.0.1:{listener.getsockname()[1]}", "tenA", [KEYS[0]], [page], 3.0
            ) == [0]
    finally:
        listener.close()
        client.close()
        server.close()
    assert b"tenant-B-secret-KV" not in seen and server.stats.batches_served == 0
