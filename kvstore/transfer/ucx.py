"""The `ucx` transfer engine: whole blocks over UCX tag messages (ucxx), for RDMA fabrics.

Runs inside the node agent. Peers meet through the gate (gate.py: a tcp listener on the
configured host only, connection caps, the cluster-secret handshake), swap UCX worker addresses
and tags over it (no UCX listener, which would bind every interface), then move blocks over UCX
endpoints made from those addresses; the gate connection stays open, and its end is the peer's.
The process's UCX context lives in ucx_runtime.py, the batch protocol in ucx_wire.py.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvstore.block import encode_tenant
from kvstore.errors import ConfigError, TransferError
from kvstore.keys import BlockKey
from kvstore.transfer.base import (
    OpenBlock,
    TransferEngine,
    TransferStats,
    check_checksums,
    register_engine,
)
from kvstore.transfer.gate import Gate, LinkOptions, dial, is_quiet, shutdown, wait_readable
from kvstore.transfer.pool import IdlePool
from kvstore.transfer.tcp_wire import Conn, HandshakeError, ProtocolError
from kvstore.transfer.ucx_runtime import (
    START_TIMEOUT_S,
    Runtime,
    acquire_runtime,
    net_devices_for,
    release_runtime,
)
from kvstore.transfer.ucx_wire import (
    _Batch,
    _bytes,
    _exchange,
    _forget,
    _Link,
    _MacError,
    _page_arrays,
    _recv_head,
    _recv_keys,
    _u64,
    _wait_dead,
    recv_hello,
    send_hello,
)

logger = logging.getLogger(__name__)

_GRACE_S = 5.0  # the loop enforces fetch deadlines; this only guards against a wedged loop


@dataclass(frozen=True)
class UcxOptions(LinkOptions):
    """Settings of a UcxEngine; every field can be passed to make_engine("ucx", ...).

    `tls` sets UCX_TLS and `net_devices` UCX_NET_DEVICES of the process's UCX context (None:
    the environment's value; else, once serving, the interface that owns the serving host plus
    every RDMA port, so UCX's tcp transport listens on that interface only)."""

    tls: str | None = None
    net_devices: str | None = None


@register_engine("ucx")
class UcxEngine(TransferEngine):
    """Blocks over UCX tag send/recv through ucxx; endpoints pooled per peer. Thread-safe."""

    def __init__(self, **options: object) -> None:
        self.options = UcxOptions.make("ucx", options)
        self._ucx = {
            name: value
            for name, value in (
                ("TLS", self.options.tls),
                ("NET_DEVICES", self.options.net_devices),
            )
            if value is not None
        }
        self.stats = TransferStats()  # updated under the engine's lock
        self._lock = threading.Lock()
        self._gate = Gate("ucx", self.options, self.stats, self._lock)
        self._rt: Runtime | None = None
        self._closed = False
        self._open_block: OpenBlock | None = None
        self._idle: IdlePool[_Link] = IdlePool(
            self.options.pool_connections_per_peer,
            usable=lambda link: is_quiet(link.control) and not link.endpoint.closed,
            drop=self._drop,
        )
        self._busy: set[Any] = set()  # endpoints; touched on the loop thread only
        self._peers: set[Any] = set()  # the same

    def _count(self, stat: str, by: int = 1) -> None:
        with self._lock:
            setattr(self.stats, stat, getattr(self.stats, stat) + by)

    # ---- lifecycle -----------------------------------------------------------------------
    def _runtime(self) -> Runtime:
        with self._lock:
            if self._closed:
                raise TransferError("ucx engine is closed")
            if self._rt is None:
                self._rt = acquire_runtime(self, self._ucx)
            return self._rt

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            runtime, self._closed = self._rt, True  # in-flight coroutines still use _rt
            idle = self._idle.drain()
        self._gate.close()  # its threads abort their peers' endpoints
        if runtime is not None and runtime.context is not None:  # not stopped at exit
            runtime.call(self._drop_endpoints(idle), START_TIMEOUT_S)
            release_runtime(self, runtime)
        for link in idle:
            link.control.close()
        if self._open_block is not None:
            logger.info("ucx engine stopped serving")

    async def _drop_endpoints(self, idle: list[_Link]) -> None:
        for endpoint in [*self._busy, *self._peers, *(link.endpoint for link in idle)]:
            endpoint.abort()  # pending sends and receives fail at once

    # ---- serving -------------------------------------------------------------------------
    def serve(self, open_block: OpenBlock, host: str = "127.0.0.1", port: int = 0) -> str:
        with self._lock:
            if self._closed or self._open_block is not None:
                raise ConfigError("ucx engine is closed or already serving")
            self._open_block = open_block
            if "NET_DEVICES" not in self._ucx and "UCX_NET_DEVICES" not in os.environ:
                devices = net_devices_for(host)
                if devices:
                    self._ucx["NET_DEVICES"] = devices
        self._runtime()
        address = self._gate.open(host, port, self._serve_peer)
        logger.info("ucx engine serving at %s", address)
        return address

    def _serve_peer(self, conn: Conn, host: str) -> None:
        """On the gate's thread: swap UCX addresses, then serve the peer's batches on the
        loop until it hangs up (its gate connection ends) or serving ends (we end it)."""
        runtime = self._rt
        deadline = time.monotonic() + self.options.handshake_timeout_s
        address, send_tag = recv_hello(conn, b"client", runtime.address, deadline)
        recv_tag = _new_tag()
        try:
            link = self._link_within(conn, address, send_tag, recv_tag, START_TIMEOUT_S)
        except Exception as exc:  # UCX refuses a malformed or unreachable worker address
            raise ProtocolError(f"no UCX endpoint to the peer's address: {_forget(exc)}") from None
        serving = None
        try:
            send_hello(conn, b"server", runtime.address, recv_tag, deadline)
            serving = runtime.submit(self._serve_link(link))
            serving.add_done_callback(lambda _: shutdown(conn.sock))
            wait_readable(conn.sock, None)  # EOF (the client sends nothing more) or shut down
        finally:
            with contextlib.suppress(RuntimeError):  # the loop already stopped at exit
                runtime.loop.call_soon_threadsafe(link.endpoint.abort)  # ends serving, if on
            if serving is not None:  # returns once every block it opened is closed
                concurrent.futures.wait([serving], START_TIMEOUT_S)

    def _link_within(
        self, conn: Conn, address: bytes, send_tag: int, recv_tag: int, timeout_s: float
    ) -> _Link:
        """_link_to on the loop, waited for `timeout_s`; an endpoint made after that is
        aborted as it arrives (concurrent.futures.TimeoutError to the caller)."""
        made = self._rt.submit(self._link_to(conn, address, send_tag, recv_tag))
        try:
            return made.result(max(0.0, timeout_s))
        except concurrent.futures.TimeoutError:
            loop = self._rt.loop
            made.add_done_callback(lambda late: loop.call_soon_threadsafe(_abort_late_link, late))
            raise

    async def _link_to(self, conn: Conn, address: bytes, send_tag: int, recv_tag: int) -> _Link:
        """On the loop: an endpoint to the peer's worker `address`, sending on `send_tag`."""
        from ucxx._lib.libucxx import UCXAddress, UCXEndpoint
        from ucxx._lib_async import Endpoint

        context = self._rt.context
        raw = UCXEndpoint.create_from_worker_address(
            context.worker, UCXAddress.create_from_buffer(address), True
        )
        tags = {"msg_send": send_tag, "msg_recv": recv_tag}
        return _Link(Endpoint(raw, context, tags), conn.session, conn.sock)

    async def _serve_link(self, link: _Link) -> None:
        """Answer one peer's batches until it leaves, idles out, misses a batch deadline or
        the engine closes."""
        endpoint = link.endpoint
        self._peers.add(endpoint)
        try:
            while True:
                head = await asyncio.wait_for(_recv_head(endpoint), self.options.idle_timeout_s)
                try:
                    async with asyncio.timeout(self.options.batch_deadline_s):
                        await self._serve_batch(link, *await _recv_keys(link, head))
                except TimeoutError:
                    self._count("batches_cut")
                    raise
                self._count("batches_served")
        except Exception as exc:  # a peer leaving shows up as a UCX error
            logger.debug("ucx peer done: %s", _forget(exc))
        finally:
            self._peers.discard(endpoint)
            endpoint.abort()

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
        await asyncio.gather(*messages)  # the batch deadline bounds a peer that stops reading

    # ---- fetching ------------------------------------------------------------------------
    def fetch(
        self,
        address: str,
        tenant: str,
        keys: Sequence[BlockKey],
        pages: Sequence[torch.Tensor],
        timeout_s: float,
        checksums: list | None = None,
    ) -> list[int]:
        encode_tenant(tenant)  # ConfigError before any I/O
        check_checksums("ucx", keys, checksums)  # computes none: commit_received hashes
        batch = _Batch(tenant, keys, _page_arrays(keys, pages))
        runtime = self._runtime()
        if not keys:
            return []
        deadline = time.monotonic() + timeout_s
        link = self._idle.take(address)
        if link is None or self._exchange(runtime, address, link, batch, deadline) == "stale":
            link = self._dial(runtime, address, deadline)  # none pooled, or the peer dropped it
            self._exchange(runtime, address, link, batch, deadline)
        return batch.received

    def _exchange(
        self, runtime: Runtime, address: str, link: _Link, batch: _Batch, deadline: float
    ) -> str:
        """One batch on `link` ("done"; pooled again if whole), or "stale" when a pooled link
        turned out dropped by the peer before it answered; "broken" otherwise."""
        timeout_s = max(deadline - time.monotonic(), 0.0)
        future = runtime.submit(self._fetch(link, batch, timeout_s))
        try:
            outcome = future.result(timeout_s + 2 * _GRACE_S)
        except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
            future.cancel()  # the loop is wedged or shutting down
            _wait_dead(batch.receives, address)
            outcome = "broken"
        if outcome == "done":
            self._idle.put(address, link)
        else:
            link.control.close()
        return outcome

    async def _fetch(self, link: _Link, batch: _Batch, timeout_s: float) -> str:
        self._busy.add(link.endpoint)
        try:
            await asyncio.wait_for(_exchange(link, batch), timeout_s)
        except Exception as exc:
            link.endpoint.abort()  # half-used: never pooled
            if not batch.answered and not isinstance(exc, TimeoutError) and not self._closed:
                return "stale"
            self._count("transfers_broken")
            self._count("macs_failed", isinstance(exc, _MacError))
            logger.warning("ucx fetch of %d blocks broke: %s", len(batch.keys), _forget(exc))
            return "broken"
        except BaseException:
            link.endpoint.abort()
            raise
        finally:
            self._busy.discard(link.endpoint)
        return "done"

    def _drop(self, link: _Link) -> None:
        link.control.close()
        with contextlib.suppress(RuntimeError):  # the loop already stopped at exit
            self._rt.loop.call_soon_threadsafe(link.endpoint.abort)

    def _dial(self, runtime: Runtime, address: str, deadline: float) -> _Link:
        """A new link to `address`: the gate's connection (authenticated when the engine has a
        secret), the hello both ways, then this side's UCX endpoint to the peer's worker."""
        try:
            conn = dial("ucx", address, self.options, deadline)
        except HandshakeError:
            self._count("handshakes_failed")
            raise
        hello_deadline = min(deadline, time.monotonic() + self.options.handshake_timeout_s)
        try:
            recv_tag = _new_tag()
            send_hello(conn, b"client", runtime.address, recv_tag, hello_deadline)
            peer_address, send_tag = recv_hello(conn, b"server", runtime.address, hello_deadline)
            link = self._link_within(
                conn,
                peer_address,
                send_tag,
                recv_tag,  # the fetch's deadline
                min(START_TIMEOUT_S, deadline - time.monotonic()),
            )
        except (OSError, TransferError, concurrent.futures.TimeoutError) as exc:
            conn.sock.close()
            raise TransferError(f"cannot reach ucx peer {address}: {exc!r}") from None
        self._count("connections_opened")
        return link


# ---- wire helpers (module level: both sides use them, none touches engine state) ---------
def _abort_late_link(made: concurrent.futures.Future) -> None:
    """On the loop (however the future finished): the endpoint of a link whose caller
    stopped waiting is aborted."""
    if not made.cancelled() and made.exception() is None:
        made.result().endpoint.abort()


def _new_tag() -> int:
    """A UCX tag no one else guesses: tags are matched per worker, not per endpoint."""
    return int.from_bytes(os.urandom(8), "little")


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
