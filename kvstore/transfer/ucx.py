"""The `ucx` transfer engine: whole blocks over UCX tag messages (ucxx), for RDMA fabrics.

Runs inside the node agent. ucxx is asyncio-based and progresses one context per event loop, so
the process holds one UCX context on one event-loop thread (ucx_runtime.py), shared by every
UcxEngine and reference counted; the engines' synchronous calls are submitted to that loop.
With a cluster secret, each endpoint starts with the handshake of `auth.py` over tag messages
and every block is followed by its MAC tag.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvstore.block import HEADER_BYTES, MAX_TENANT_BYTES, encode_tenant
from kvstore.errors import ConfigError, TransferError
from kvstore.keys import KEY_BYTES, BlockKey
from kvstore.transfer import auth
from kvstore.transfer.base import OpenBlock, TransferEngine, TransferStats, register_engine
from kvstore.transfer.ucx_runtime import (
    START_TIMEOUT_S,
    Runtime,
    acquire_runtime,
    release_runtime,
)

logger = logging.getLogger(__name__)

MAX_BATCH_KEYS = 1 << 16
_GRACE_S = 5.0  # the loop enforces fetch deadlines; this only guards against a wedged loop


class _ProtocolError(Exception):
    """The peer broke the protocol; its endpoint is discarded."""


class _MacError(_ProtocolError):
    """A block's MAC did not verify."""


class _HandshakeError(_ProtocolError):
    """The peer did not prove that it knows the cluster secret."""


@dataclass(eq=False)
class _Link:
    """An endpoint, its session (None without a cluster secret) and frames passed so far."""

    endpoint: Any
    session: auth.Session | None = None
    frames: int = 0

    def next_mac(self, key: BlockKey, length: int):
        self.frames += 1
        return None if self.session is None else self.session.block_mac(self.frames, key, length)


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


@register_engine("ucx")
class UcxEngine(TransferEngine):
    """Blocks over UCX tag send/recv through ucxx; endpoints pooled per peer. Thread-safe.

    `tls` sets UCX_TLS and `net_devices` UCX_NET_DEVICES of the process's UCX context (None:
    the environment's value, else UCX's default, which picks RDMA where present). ucxx 0.52's
    Python listener takes no address and binds every interface: `host` in serve() only names
    the address peers dial, so serve with a `cluster_secret` wherever other hosts can reach.
    """

    def __init__(
        self, tls: str | None = None, net_devices: str | None = None,
        send_timeout_s: float = 30.0, pool_connections_per_peer: int = 4,
        cluster_secret: bytes | None = None, handshake_timeout_s: float = 5.0,
    ) -> None:  # fmt: skip
        self.cluster_secret = auth.check_secret(cluster_secret)
        self.handshake_timeout_s = handshake_timeout_s
        self.options = {
            name: value
            for name, value in (("TLS", tls), ("NET_DEVICES", net_devices))
            if value is not None
        }
        self.send_timeout_s = send_timeout_s  # a peer that stops reading releases its pins
        self.pool_connections_per_peer = pool_connections_per_peer
        self.stats = TransferStats()  # updated on the loop thread only
        self._lock = threading.Lock()
        self._rt: Runtime | None = None
        self._closed = False
        self._listener: Any = None
        self._open_block: OpenBlock | None = None
        # Touched on the loop thread only, like the stats.
        self._idle: dict[tuple[str, int], list[_Link]] = {}
        self._busy: set[Any] = set()  # endpoints
        self._peers: set[Any] = set()

    # ---- lifecycle -----------------------------------------------------------------------
    def _runtime(self) -> Runtime:
        with self._lock:
            if self._closed:
                raise TransferError("ucx engine is closed")
            if self._rt is None:
                self._rt = acquire_runtime(self, self.options)
            return self._rt

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            runtime, self._closed = self._rt, True  # in-flight coroutines still use _rt
        if runtime is not None and runtime.context is not None:  # not stopped at exit
            runtime.call(self._drop_endpoints(), START_TIMEOUT_S)
            release_runtime(self, runtime)

    async def _drop_endpoints(self) -> None:
        idle = [link.endpoint for links in self._idle.values() for link in links]
        _abort_all([*self._busy, *self._peers, *idle])
        self._idle.clear()
        if self._listener is not None:  # closed once its handlers are gone, or ucxx warns
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._listener._wait_for_active_clients(), _GRACE_S)
            self._listener.close()
            self._listener = None
            # Exception tracebacks hold the peers' endpoints in cycles, and each endpoint its
            # listener: until they are collected the port still accepts (then never answers).
            gc.collect()
            logger.info("ucx engine stopped serving")

    # ---- serving -------------------------------------------------------------------------
    def serve(self, open_block: OpenBlock, host: str = "127.0.0.1", port: int = 0) -> str:
        with self._lock:
            if self._closed or self._open_block is not None:
                raise ConfigError("ucx engine is closed or already serving")
            self._open_block = open_block
        runtime = self._runtime()
        port = runtime.call(self._listen(runtime, port), START_TIMEOUT_S)
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        auth.warn_if_open("ucx", "0.0.0.0", self.cluster_secret)  # it binds every interface
        logger.info("ucx engine serving at %s", address)
        return address

    async def _listen(self, runtime: Runtime, port: int) -> int:
        self._listener = runtime.context.create_listener(self._serve_peer, port=port)
        return self._listener.port

    async def _serve_peer(self, endpoint: Any) -> None:
        """Answer one peer's batches until it leaves or the engine closes."""
        self._peers.add(endpoint)
        self.stats.connections_accepted += 1
        try:
            link = await self._authenticate(endpoint)
            while True:
                await self._serve_batch(link, *await _recv_batch(endpoint))
                self.stats.batches_served += 1
        except _HandshakeError as exc:
            self.stats.handshakes_failed += 1
            logger.warning("dropping ucx peer: %s", _forget(exc))
        except Exception as exc:  # a peer leaving shows up as a UCX error
            logger.debug("ucx peer done: %s", _forget(exc))
        finally:
            self._peers.discard(endpoint)
            endpoint.abort()

    async def _authenticate(self, endpoint: Any) -> _Link:
        """Nonce out, the client's proof in, ours out; nothing else before it succeeds."""
        if self.cluster_secret is None:
            return _Link(endpoint)
        nonce = auth.new_nonce()
        try:
            async with asyncio.timeout(self.handshake_timeout_s):
                await endpoint.send(_bytes(nonce))
                hello = np.empty(auth.HELLO_BYTES, dtype=np.uint8)
                await endpoint.recv(hello)
        except Exception as exc:  # silent, slow, or a message of the wrong size
            raise _HandshakeError(f"no valid handshake: {_forget(exc)}") from None
        accepted = auth.accept_hello(self.cluster_secret, nonce, hello.tobytes())
        if accepted is None:
            raise _HandshakeError("peer did not prove the cluster secret")
        proof, session = accepted
        await asyncio.wait_for(endpoint.send(_bytes(proof)), self.handshake_timeout_s)
        return _Link(endpoint, session)

    async def _serve_batch(self, link: _Link, tenant: str, keys: list[BlockKey]) -> None:
        """Per key a frame (u64 length, 0 = absent), then the block straight from its pinned
        view, then (with a secret) its MAC tag. The next block is opened while this one is
        sent; blocks close on reader threads."""
        endpoint, loop, readers = link.endpoint, asyncio.get_running_loop(), self._rt.readers
        opening = loop.run_in_executor(readers, _enter, self._open_block, tenant, keys[0])
        closing = []
        try:
            for index in range(len(keys)):
                opened, whole = await opening
                opening = None
                if index + 1 < len(keys):
                    opening = loop.run_in_executor(
                        readers, _enter, self._open_block, tenant, keys[index + 1]
                    )
                try:
                    await self._send_frame(link, keys[index], whole)
                except BaseException:
                    endpoint.abort()  # UCX must stop reading the block before it is closed
                    raise
                finally:
                    closing.append(loop.run_in_executor(readers, _exit, opened))
        finally:
            if opening is not None:  # the batch broke: close the block opened ahead too
                closing.append(_exit_when_open(opening, readers))
            await asyncio.gather(*closing)

    async def _send_frame(self, link: _Link, key: BlockKey, whole: torch.Tensor | None) -> None:
        endpoint = link.endpoint
        data = None if whole is None else whole.reshape(-1).view(torch.uint8).cpu().numpy()
        size = 0 if data is None else data.size
        mac = link.next_mac(key, size)
        messages = [endpoint.send(_u64(size))]
        if data is not None:
            messages.append(endpoint.send(data))
        if mac is not None:
            if data is not None:
                mac.update(memoryview(data))
            messages.append(endpoint.send(_bytes(mac.finalize())))
        sends = asyncio.gather(*messages)
        await asyncio.wait_for(sends, self.send_timeout_s)  # a stalled peer releases its pins

    # ---- fetching ------------------------------------------------------------------------
    def fetch(
        self, address: str, tenant: str, keys: Sequence[BlockKey],
        pages: Sequence[torch.Tensor], timeout_s: float,
    ) -> list[int]:  # fmt: skip
        encode_tenant(tenant)  # ConfigError before any I/O
        batch = _Batch(tenant, keys, _page_arrays(keys, pages))
        runtime = self._runtime()
        if not keys:
            return []
        future = runtime.submit(self._fetch(_split_address(address), batch, timeout_s))
        try:
            return future.result(timeout_s + 2 * _GRACE_S)
        except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
            future.cancel()  # the loop is wedged or shutting down
            _wait_dead(batch.receives, address)
            return [0] * len(keys)

    async def _fetch(self, peer: tuple[str, int], batch: _Batch, timeout_s: float) -> list[int]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        link, pooled = self._pooled(peer), True
        if link is None:
            link, pooled = await self._dial(peer, deadline), False
        while True:
            self._busy.add(link.endpoint)
            try:
                await asyncio.wait_for(_exchange(link, batch), deadline - loop.time())
            except Exception as exc:
                link.endpoint.abort()  # half-used: never pooled
                stale = pooled and not batch.answered and not isinstance(exc, TimeoutError)
                if stale and not self._closed:  # the peer had dropped it: redial once
                    link, pooled = await self._dial(peer, deadline), False
                    continue
                self.stats.transfers_broken += 1
                self.stats.macs_failed += isinstance(exc, _MacError)
                logger.warning("ucx fetch from %s:%d broke: %s", *peer, _forget(exc))
                return batch.received
            except BaseException:
                link.endpoint.abort()
                raise
            finally:
                self._busy.discard(link.endpoint)
            self._pool(peer, link)
            return batch.received

    def _pooled(self, peer: tuple[str, int]) -> _Link | None:
        idle = self._idle.get(peer, [])
        while idle:
            link = idle.pop()
            if not link.endpoint.closed:
                return link
            link.endpoint.abort()
        return None

    def _pool(self, peer: tuple[str, int], link: _Link) -> None:
        idle = self._idle.setdefault(peer, [])
        if len(idle) < self.pool_connections_per_peer and not self._closed:
            idle.append(link)
        else:
            link.endpoint.abort()

    async def _dial(self, peer: tuple[str, int], deadline: float) -> _Link:
        """A new endpoint to `peer`, authenticated when the engine has a secret."""
        endpoint = await self._connect(peer, deadline)
        if self.cluster_secret is None:
            return _Link(endpoint)
        loop = asyncio.get_running_loop()
        wait_s = min(max(deadline - loop.time(), 0.0), self.handshake_timeout_s)
        try:
            return _Link(endpoint, await asyncio.wait_for(self._prove(endpoint), wait_s))
        except Exception as exc:
            endpoint.abort()
            self.stats.handshakes_failed += 1
            detail = f"ucx peer {peer[0]}:{peer[1]} failed the handshake: {_forget(exc)}"
            raise TransferError(detail) from None

    async def _prove(self, endpoint: Any) -> auth.Session:
        nonce = np.empty(auth.NONCE_BYTES, dtype=np.uint8)
        await endpoint.recv(nonce)
        hello, client_nonce = auth.client_hello(self.cluster_secret, nonce.tobytes())
        await endpoint.send(_bytes(hello))
        proof = np.empty(auth.PROOF_BYTES, dtype=np.uint8)
        await endpoint.recv(proof)
        session = auth.accept_reply(
            self.cluster_secret, nonce.tobytes(), client_nonce, proof.tobytes()
        )
        if session is None:
            raise _HandshakeError("peer did not prove the cluster secret")
        return session

    async def _connect(self, peer: tuple[str, int], deadline: float) -> Any:
        """ApplicationContext.create_endpoint, but failing as soon as UCX finds the peer
        unreachable rather than when the exchange of endpoint tags times out."""
        from ucxx._lib.libucxx import UCXEndpoint
        from ucxx._lib_async import Endpoint
        from ucxx._lib_async.exchange_peer_info import exchange_peer_info
        from ucxx._lib_async.utils import hash64bits

        context, loop = self._rt.context, asyncio.get_running_loop()
        try:
            raw = UCXEndpoint.create(context.worker, peer[0], peer[1], True)
            tag = hash64bits("msg_tag", os.urandom(16), raw.handle)
            wait_s = max(deadline - loop.time(), 0.0)
            exchange = asyncio.ensure_future(exchange_peer_info(raw, tag, False, wait_s))
            while not exchange.done() and raw.alive and loop.time() < deadline:
                await asyncio.wait({exchange}, timeout=0.01)
            if not exchange.done():
                exchange.cancel()
                raw.close_blocking(period=10**9, max_attempts=1)
                raw.raise_on_error()
                raise TimeoutError("no answer")
            tags = {"msg_send": exchange.result()["msg_tag"], "msg_recv": tag}
        except Exception as exc:
            raise TransferError(f"cannot reach ucx peer {peer[0]}:{peer[1]}: {exc}") from exc
        self.stats.connections_opened += 1
        return Endpoint(raw, context, tags)


# ---- wire helpers (module level: both sides use them, none touches engine state) ---------
def _forget(exc: BaseException) -> str:
    """Drop the frames of `exc` (and its context) and describe it. ucxx's C++ requests keep
    their exceptions alive, and the frames would keep endpoints alive, each endpoint its
    listener (accepting connections after close, then crashing on them) and page views."""
    text = repr(exc)
    while exc is not None:
        exc.__traceback__, exc = None, exc.__context__
    return text


def _abort_all(endpoints: list[Any]) -> None:
    for endpoint in endpoints:
        endpoint.abort()  # pending sends and receives fail at once


def _enter(open_block: OpenBlock, tenant: str, key: BlockKey) -> tuple[Any, torch.Tensor | None]:
    """On a reader thread: open `key`'s block. A store that fails serves it as absent."""
    try:
        opened = open_block(key, tenant)
        return opened, opened.__enter__()
    except Exception:
        logger.exception("serving %r failed; sending it as absent", key)
        return None, None


def _exit(opened: Any) -> None:
    """On a reader thread: close a block opened by `_enter` (unpins it)."""
    try:
        if opened is not None:
            opened.__exit__(None, None, None)
    except Exception:
        logger.exception("closing a served block failed")


async def _exit_when_open(opening: asyncio.Future, readers: concurrent.futures.Executor) -> None:
    opened, _ = await opening
    await asyncio.get_running_loop().run_in_executor(readers, _exit, opened)


def _u64(value: int) -> np.ndarray:
    return np.array([value], dtype=np.uint64)


def _bytes(data: bytes) -> np.ndarray:
    return np.frombuffer(bytearray(data), dtype=np.uint8)


async def _recv_batch(endpoint: Any) -> tuple[str, list[BlockKey]]:
    """A request: a u64 key count and u64 tenant length, then the tenant and keys in one
    message."""
    head = np.empty(2, dtype=np.uint64)
    await endpoint.recv(head)
    count, tenant_bytes = int(head[0]), int(head[1])
    if not 0 < count <= MAX_BATCH_KEYS or not 0 < tenant_bytes <= MAX_TENANT_BYTES:
        raise _ProtocolError(f"batch of {count} keys, tenant of {tenant_bytes} bytes")
    raw = np.empty(tenant_bytes + count * KEY_BYTES, dtype=np.uint8)
    await endpoint.recv(raw)
    data = raw.tobytes()
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
    await endpoint.send(np.array([len(batch.keys), len(tenant)], dtype=np.uint64))
    await endpoint.send(_bytes(tenant + b"".join(batch.keys)))
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
            if waited_s > _GRACE_S:
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
    if len(keys) != len(pages):
        raise ConfigError(f"fetch got {len(keys)} keys but {len(pages)} pages")
    if len(keys) > MAX_BATCH_KEYS or any(len(key) != KEY_BYTES for key in keys):
        raise ConfigError(f"fetch takes at most {MAX_BATCH_KEYS} keys of {KEY_BYTES} bytes")
    if not all(
        p.device.type == "cpu" and p.dtype == torch.uint8 and p.is_contiguous() for p in pages
    ):
        raise ConfigError("ucx engine receives into contiguous uint8 host pages only")
    return [page.reshape(-1).numpy() for page in pages]


def _split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"a ucx address is host:port, got {address!r}")
    return host.strip("[]"), int(port)
