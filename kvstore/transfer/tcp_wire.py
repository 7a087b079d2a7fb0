"""The tcp engine's wire format: the handshake, requests (tenant + keys) and block frames, each
read and written against a deadline; each block's MAC (and, receiving, its payload's xxh3) is
computed slice by slice as its bytes pass, while they are in cache.

Runs inside the node agent, on the tcp engine's serving threads and its fetching callers.
"""

from __future__ import annotations

import hmac
import socket
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from kvstore.block import HEADER_BYTES, MAX_TENANT_BYTES, encode_tenant
from kvstore.errors import TransferError
from kvstore.keys import KEY_BYTES, BlockKey
from kvstore.transfer import auth

MAGIC = b"KVST"
VERSION = 3  # 3: requests are sealed on authenticated connections
# A request is BATCH (magic, version, tenant length, key count), the tenant, then the keys. The
# response is BATCH echoing the count (tenant length 0), then per key in order a FRAME (block
# length, 0 = absent) and the block; with a cluster secret each frame ends with its MAC tag.
BATCH = struct.Struct("<4sHHI")
FRAME = struct.Struct("<Q")
# Either end MACs (and a receiver hashes) this much at a time, right after it is read in or
# just before it is sent, while it is still in L2; a receiver receives no more at once.
SLICE_BYTES = 512 << 10


class ProtocolError(TransferError):
    """The peer sent bytes that break the protocol; its connection is dropped."""


class MacError(ProtocolError):
    """A block's MAC did not verify: forged or altered in transit."""


class HandshakeError(TransferError):
    """The peer did not prove that it knows the cluster secret."""


@dataclass
class Conn(auth.Sequenced):
    """A connection and its authenticated session (None without a cluster secret)."""

    sock: socket.socket
    session: auth.Session | None = None
    frames: int = 0  # frames sent (serving side) or received (fetching side) so far
    requests: int = 0  # requests sent (fetching side) or received (serving side) so far


# ---- handshake ------------------------------------------------------------------------------
def server_handshake(sock: socket.socket, secret: bytes, deadline: float) -> auth.Session:
    """Send a nonce, check the client's proof, prove ours. HandshakeError if the client fails:
    it has then received the nonce and nothing else."""
    nonce = auth.new_nonce()
    send_parts(sock, [nonce], deadline)
    accepted = auth.accept_hello(secret, nonce, recv_bytes(sock, auth.HELLO_BYTES, deadline))
    if accepted is None:
        raise HandshakeError("peer did not prove the cluster secret")
    proof, session = accepted
    send_parts(sock, [proof], deadline)
    return session


def client_handshake(sock: socket.socket, secret: bytes, deadline: float) -> auth.Session:
    server_nonce = recv_bytes(sock, auth.NONCE_BYTES, deadline)
    hello, client_nonce = auth.client_hello(secret, server_nonce)
    send_parts(sock, [hello], deadline)
    proof = recv_bytes(sock, auth.PROOF_BYTES, deadline)
    session = auth.accept_reply(secret, server_nonce, client_nonce, proof)
    if session is None:
        raise HandshakeError("peer did not prove the cluster secret")
    return session


# ---- requests -------------------------------------------------------------------------------
def pack_request(tenant: str, keys: Sequence[BlockKey]) -> bytes:
    raw = encode_tenant(tenant)
    return BATCH.pack(MAGIC, VERSION, len(raw), len(keys)) + raw + b"".join(keys)


def recv_request(conn: Conn, max_keys: int, deadline: float) -> tuple[str, list]:
    """Read a whole request by `deadline` (and its seal, on an authenticated connection);
    returns its tenant and keys."""
    sock = conn.sock
    head = recv_bytes(sock, BATCH.size, deadline)
    tenant_bytes, count = parse_head(head, max_keys)
    body = recv_bytes(sock, tenant_bytes + count * KEY_BYTES, deadline)
    expected = conn.request_seal(head + body)
    if expected and not hmac.compare_digest(recv_bytes(sock, len(expected), deadline), expected):
        raise ProtocolError("a request not sealed with the session key (rewritten on the way?)")
    tenant = auth.decode_tenant(body[:tenant_bytes])
    if tenant is None:
        raise ProtocolError("request names no valid tenant")
    keys = [BlockKey(body[i : i + KEY_BYTES]) for i in range(tenant_bytes, len(body), KEY_BYTES)]
    return tenant, keys


def recv_response_head(sock: socket.socket, max_keys: int, deadline: float) -> int:
    return parse_head(recv_bytes(sock, BATCH.size, deadline), max_keys)[1]


def parse_head(head: bytes, max_keys: int) -> tuple[int, int]:
    """A BATCH head's tenant length and key count, or ProtocolError."""
    magic, version, tenant_bytes, count = BATCH.unpack(head)
    if magic != MAGIC or version != VERSION:
        raise ProtocolError(f"not a kvstore tcp v{VERSION} peer (magic {magic!r}, v{version})")
    if count > max_keys or tenant_bytes > MAX_TENANT_BYTES:
        raise ProtocolError(f"batch of {count} keys, tenant of {tenant_bytes} bytes: too large")
    return tenant_bytes, count


# ---- frames ---------------------------------------------------------------------------------
def send_frame(conn: Conn, key: BlockKey, body: memoryview, deadline: float) -> None:
    """Frame header, body and tag, the body MACed slice by slice just before it is sent. Small
    blocks go out in one sendmsg (one packet)."""
    head = FRAME.pack(len(body))
    mac = conn.next_mac(key, len(body))
    if mac is None:
        send_parts(conn.sock, [head, body], deadline)
        return
    parts: list = [head]
    for start in range(0, len(body), SLICE_BYTES):
        part = body[start : start + SLICE_BYTES]
        mac.update(part)
        parts.append(part)
        if start + SLICE_BYTES < len(body):
            send_parts(conn.sock, parts, deadline)
            parts = []
    send_parts(conn.sock, [*parts, mac.finalize()], deadline)


def recv_frame(
    conn: Conn, key: BlockKey, buffer: memoryview, deadline: float
) -> tuple[int, int | None]:
    """Receive one frame into `buffer`, verifying its MAC as the bytes arrive. Returns its
    length (0: the peer lacks the block) and the xxh3-64 of the block's payload (the bytes
    past its header, hashed as they landed; None for a frame too short to hold a header).
    MacError if the tag does not match."""
    (length,) = FRAME.unpack(recv_bytes(conn.sock, FRAME.size, deadline))
    if length > len(buffer):
        raise ProtocolError(f"peer sent a {length}-byte block for a {len(buffer)}-byte page")
    landing = Landing(conn.next_mac(key, length))
    recv_exact(conn.sock, buffer[:length], deadline, landing)
    mac = landing.mac
    tag = b"" if mac is None else recv_bytes(conn.sock, auth.TAG_BYTES, deadline)
    if mac is not None and not auth.tag_matches(mac, tag):
        raise MacError(f"block {key!r} failed its MAC")
    return length, landing.payload_checksum(length)


class Landing:
    """What a receiver computes over a frame's bytes, slice by slice as they land (one pass
    while in cache): the frame's MAC (None on an unauthenticated connection) and the xxh3-64
    of the block's payload, the bytes past its header."""

    def __init__(self, mac: auth.BlockMac | None) -> None:
        self.mac = mac
        self._payload = xxhash.xxh3_64()

    def update(self, frame: memoryview, start: int, end: int) -> None:
        """Feed bytes [start, end) of the frame, in order."""
        if self.mac is not None:
            self.mac.update(frame[start:end])
        if end > HEADER_BYTES:
            self._payload.update(frame[max(start, HEADER_BYTES) : end])

    def payload_checksum(self, length: int) -> int | None:
        return self._payload.intdigest() if length >= HEADER_BYTES else None


# ---- bytes against a deadline ---------------------------------------------------------------
def send_parts(sock: socket.socket, parts: list, deadline: float) -> None:
    """sendmsg every part in order, each wait bounded by the time left to `deadline`."""
    views = [memoryview(part).cast("B") for part in parts if len(part)]
    while views:
        sock.settimeout(remaining(deadline))
        sent = sock.sendmsg(views)
        while sent:
            taken = min(sent, len(views[0]))
            views[0], sent = views[0][taken:], sent - taken
            if not views[0]:
                views.pop(0)


def recv_bytes(sock: socket.socket, count: int, deadline: float) -> bytes:
    data = bytearray(count)
    recv_exact(sock, memoryview(data), deadline)
    return bytes(data)


def recv_exact(
    sock: socket.socket, view: memoryview, deadline: float, landing: Landing | None = None
) -> None:
    """Fill `view`; with `landing`, at most a slice at a time, each fed to `landing` as soon as
    it has landed (while still in cache; per-call overhead makes tiny updates slow).
    ConnectionError at EOF, TimeoutError once `deadline` has passed."""
    got = fed = 0
    while got < len(view):
        sock.settimeout(remaining(deadline))
        end = len(view) if landing is None else min(fed + SLICE_BYTES, len(view))
        count = sock.recv_into(view[got:end])
        if count == 0:
            raise ConnectionError(f"peer closed the connection ({got} of {len(view)} bytes read)")
        got += count
        if landing is not None and got == end:
            landing.update(view, fed, got)
            fed = got


def remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    return left
