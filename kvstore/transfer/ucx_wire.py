"""The `ucx` engine's wire. First the hello, on the gate's authenticated tcp connection: each
side's UCX worker address and the tag it receives on, sealed with the session key. Then one
batch at a time on the UCX endpoint: a request is a u64 key count and u64 tenant length, then
the tenant and the keys in one message; the answer is, per key, a u64 length frame, the block
and (with a cluster secret) its MAC tag. Receives keep their UCX requests, so a broken batch can
see each of them dead before its pages are freed. Runs inside the node agent: the hello on
gate and fetching threads, batches on the UCX runtime's event loop.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import socket
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvstore.block import HEADER_BYTES, MAX_TENANT_BYTES, encode_tenant
from kvstore.keys import KEY_BYTES, BlockKey
from kvstore.transfer import auth
from kvstore.transfer.base import check_fetch_pages
from kvstore.transfer.tcp_wire import Conn, ProtocolError, recv_bytes, send_parts

logger = logging.getLogger(__name__)
_RETIRE_WARN_S = 5.0  # how often a batch whose receives will not die says so

MAX_BATCH_KEYS = 1 << 16
MAX_ADDRESS_BYTES = 64 << 10  # a UCX worker address (a few hundred bytes per device)
MIN_ADDRESS_BYTES = 2  # its header: version and flags, then the packed worker
_VERSION_BITS = 0x0F  # the header byte's low nibble: UCP_ADDRESS_HEADER_VERSION_MASK
_HELLO = struct.Struct("<QI")  # the tag this side receives on, its worker address's length


class _ProtocolError(Exception):
    """The peer broke the protocol; its endpoint is discarded."""


class _MacError(_ProtocolError):
    """A block's MAC did not verify."""


class _HandshakeError(_ProtocolError):
    """The peer did not prove that it knows the cluster secret."""


@dataclass(eq=False)
class _Link(auth.Sequenced):
    """An endpoint, its session (None without a cluster secret) and frames passed so far."""

    endpoint: Any
    session: auth.Session | None = None
    control: socket.socket | None = None  # the gate's connection: its end is the peer's end
    frames: int = 0
    requests: int = 0  # requests sent (fetching side) or received (serving side) so far


@dataclass
class _Batch:
    """One fetch in flight: block i goes into targets[i]; received[i] counts its bytes."""

    tenant: str
    keys: Sequence[BlockKey]
    targets: list[np.ndarray]
    received: list[int] = field(init=False)
    answered: bool = False  # the peer sent at least one frame on this endpoint
    receives: list[Any] = field(default_factory=list)  # UCX requests aimed at the pages

    def __post_init__(self) -> None:
        self.received = [0] * len(self.keys)


def send_hello(conn: Conn, role: bytes, address: bytes, tag: int, deadline: float) -> None:
    """This side's UCX worker address and receive tag (sealed when the link is authenticated)."""
    body = _HELLO.pack(tag, len(address)) + address
    seal = b"" if conn.session is None else conn.session.seal(b"ucx-hello-" + role, body)
    send_parts(conn.sock, [body, seal], deadline)


def recv_hello(conn: Conn, role: bytes, own_address: bytes, deadline: float) -> tuple[bytes, int]:
    """The peer's UCX worker address and the tag to send it on; ProtocolError if malformed,
    (with a session) not sealed by the peer of this very handshake, or of a newer UCX address
    version than `own_address` packs (UCX asserts, aborting the process, on a version it does
    not know; a peer on a newer UCX release is refused here instead)."""
    head = recv_bytes(conn.sock, _HELLO.size, deadline)
    tag, length = _HELLO.unpack(head)
    if not MIN_ADDRESS_BYTES <= length <= MAX_ADDRESS_BYTES:
        raise ProtocolError(f"a {length}-byte UCX address")
    address = recv_bytes(conn.sock, length, deadline)
    if conn.session is not None:
        seal = recv_bytes(conn.sock, auth.PROOF_BYTES, deadline)
        if not hmac.compare_digest(seal, conn.session.seal(b"ucx-hello-" + role, head + address)):
            raise ProtocolError("the peer's UCX address is not sealed with the session key")
    version, own = address[0] & _VERSION_BITS, own_address[0] & _VERSION_BITS
    if version > own:  # UCX unpacks its own version and older ones
        raise ProtocolError(f"a UCX address of version {version}; this UCX packs version {own}")
    return address, tag


def _forget(exc: BaseException) -> str:
    """Drop the frames of `exc` (and its context) and describe it. ucxx's C++ requests keep
    their exceptions alive, and the frames would keep endpoints alive, each endpoint its
    listener (accepting connections after close, then crashing on them) and page views."""
    text = repr(exc)
    while exc is not None:
        exc.__traceback__, exc = None, exc.__context__
    return text


def _u64(value: int) -> np.ndarray:
    return np.array([value], dtype=np.uint64)


def _bytes(data: bytes) -> np.ndarray:
    return np.frombuffer(bytearray(data), dtype=np.uint8)


async def _recv_head(endpoint: Any) -> np.ndarray:
    """A request's head: a u64 key count and u64 tenant length (what an idle peer sends next)."""
    head = np.empty(2, dtype=np.uint64)
    await endpoint.recv(head)
    return head


async def _recv_keys(link: _Link, head: np.ndarray) -> tuple[str, list[BlockKey]]:
    """The rest of the request `head` began: the tenant and keys in one message, then (with
    a session) its seal in another."""
    endpoint = link.endpoint
    count, tenant_bytes = int(head[0]), int(head[1])
    if not 0 < count <= MAX_BATCH_KEYS or not 0 < tenant_bytes <= MAX_TENANT_BYTES:
        raise _ProtocolError(f"batch of {count} keys, tenant of {tenant_bytes} bytes")
    raw = np.empty(tenant_bytes + count * KEY_BYTES, dtype=np.uint8)
    await endpoint.recv(raw)
    data = raw.tobytes()
    expected = link.request_seal(head.tobytes() + data)
    if expected:
        seal = np.empty(len(expected), dtype=np.uint8)
        await endpoint.recv(seal)
        if not hmac.compare_digest(seal.tobytes(), expected):
            raise _ProtocolError("a request not sealed with the session key")
    tenant = auth.decode_tenant(data[:tenant_bytes])
    if tenant is None:
        raise _ProtocolError("request names no valid tenant")
    keys = range(tenant_bytes, len(data), KEY_BYTES)
    return tenant, [BlockKey(data[i : i + KEY_BYTES]) for i in keys]


async def _exchange(link: _Link, batch: _Batch) -> None:
    """Send the batch, then receive per key a length frame, the block into its page and (with
    a secret) its tag. The next frame's receive is posted right behind each block's, so no
    wake-up separates them. However this ends, no receive aimed at a page outlives it."""
    endpoint, tenant = link.endpoint, encode_tenant(batch.tenant)
    head = np.array([len(batch.keys), len(tenant)], dtype=np.uint64)
    body = tenant + b"".join(batch.keys)
    await endpoint.send(head)
    await endpoint.send(_bytes(body))
    if seal := link.request_seal(head.tobytes() + body):
        await endpoint.send(_bytes(seal))
    frames = np.zeros(len(batch.keys), dtype=np.uint64)
    tag = np.zeros(auth.TAG_BYTES, dtype=np.uint8)
    pending = [_post_recv(link, frames[0:1], batch)]
    try:
        for index, (key, target) in enumerate(zip(batch.keys, batch.targets, strict=True)):
            await pending.pop(0)
            batch.answered = True
            size_bytes = int(frames[index])
            if size_bytes and not HEADER_BYTES <= size_bytes <= target.size:
                raise _ProtocolError(f"a {size_bytes}-byte block for a {target.size}-byte page")
            mac = link.next_mac(key, size_bytes)
            body = [target[:size_bytes]] if size_bytes else []
            for buffer in [*body, *([tag] if mac else []), frames[index + 1 : index + 2]]:
                if buffer.size:  # posted in order, so UCX matches them in this order
                    pending.append(_post_recv(link, buffer, batch))
            for _ in range(len(body) + (mac is not None)):
                await pending.pop(0)
            if mac is not None:
                mac.update(memoryview(target[:size_bytes]))
                if not auth.tag_matches(mac, tag.tobytes()):
                    raise _MacError(f"block {key!r} failed its MAC")
            batch.received[index] = size_bytes
    finally:
        await _retire(link, batch, pending)


def _post_recv(link: _Link, buffer: np.ndarray, batch: _Batch) -> asyncio.Future:
    """Endpoint.recv, but keeping the UCX request: cancelling the asyncio side does not
    cancel it, so a broken batch must see every request dead before its pages are freed."""
    from ucxx._lib.arr import Array
    from ucxx.types import Tag, TagMaskFull

    endpoint = link.endpoint
    endpoint._ep.raise_on_error()
    request = endpoint._ep.tag_recv(Array(buffer), Tag(endpoint._tags["msg_recv"]), TagMaskFull)
    batch.receives.append(request)
    return asyncio.ensure_future(request.wait())


async def _retire(link: _Link, batch: _Batch, pending: list[asyncio.Future]) -> None:
    """Abort the endpoint if receives are still posted (UCX cancels them), wait until each
    is completed, then collect their outcomes."""
    if any(not request.completed for request in batch.receives):
        link.endpoint.abort()
        waited_s = 0.0
        while any(not request.completed for request in batch.receives):
            await asyncio.sleep(0.001)
            waited_s += 0.001
            if waited_s > _RETIRE_WARN_S:
                logger.warning("ucx receives still not cancelled after %.0f s", waited_s)
                waited_s = 0.0
    for outcome in await asyncio.gather(*pending, return_exceptions=True):
        if isinstance(outcome, BaseException):
            _forget(outcome)


def _wait_dead(receives: list[Any], address: str) -> None:
    """From the fetching thread, when the loop did not answer in time: block until no receive
    can land in the pages any more (the loop's own `_retire` cancels them)."""
    logger.warning("ucx fetch from %s did not finish in time; waiting for its receives", address)
    while any(not request.completed for request in receives):
        time.sleep(0.001)


def _page_arrays(keys: Sequence[BlockKey], pages: Sequence[torch.Tensor]) -> list[np.ndarray]:
    """Writable byte arrays over the pages; ConfigError for misuse (caught before any I/O)."""
    check_fetch_pages("ucx", keys, pages, MAX_BATCH_KEYS)
    return [page.reshape(-1).numpy() for page in pages]
