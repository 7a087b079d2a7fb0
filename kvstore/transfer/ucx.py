"""The `ucx` transfer engine: whole blocks over UCX tag messages (ucxx), for RDMA fabrics.

Runs inside the node agent. ucxx is asyncio-based and progresses one context per event loop, so
the process holds one UCX context on one event-loop thread (ucx_runtime.py), shared by every
UcxEngine and reference counted; the engines' synchronous calls are submitted to that loop.
With a cluster secret, each endpoint starts with the handshake of `auth.py` over tag messages
and every block is followed by its MAC tag; the batch protocol itself is ucx_wire.py's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvstore.block import encode_tenant
from kvstore.errors import ConfigError, TransferError
from kvstore.keys import BlockKey
from kvstore.transfer import auth
from kvstore.transfer.base import OpenBlock, TransferEngine, TransferStats, register_engine
from kvstore.transfer.ucx_runtime import (
    START_TIMEOUT_S,
    Runtime,
    acquire_runtime,
    release_runtime,
)
from kvstore.transfer.ucx_wire import (
    _Batch,
    _bytes,
    _exchange,
    _forget,
    _HandshakeError,
    _Link,
    _MacError,
    _page_arrays,
    _recv_batch,
    _split_address,
    _u64,
    _wait_dead,
)

logger = logging.getLogger(__name__)

_GRACE_S = 5.0  # the loop enforces fetch deadlines; this only guards against a wedged loop


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
