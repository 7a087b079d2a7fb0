"""The `ucx` transfer engine: whole blocks over UCX tag messages (ucxx), for RDMA fabrics.

Runs inside the node agent. ucxx is asyncio-based and progresses one context per event loop, so
the process holds one UCX context on one event-loop thread (`_Runtime`), shared by every
UcxEngine and reference counted; the engines' synchronous calls are submitted to that loop.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import gc
import logging
import os
import sys
import threading
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvstore.block import HEADER_BYTES
from kvstore.errors import ConfigError, TransferError
from kvstore.keys import KEY_BYTES, BlockKey
from kvstore.transfer.base import OpenBlock, TransferEngine, TransferStats, register_engine

logger = logging.getLogger(__name__)

# UCX reads these when its libraries load (the first `import ucxx`, which must come after this
# module's import); values already set win.
if "ucxx" in sys.modules:
    logger.warning("ucxx was imported before %s: UCX may print warnings on stdout", __name__)
for _name, _value in {
    "UCX_WARN_UNUSED_ENV_VARS": "n",  # else UCX lists every unused UCX_* variable
    "UCX_LOG_FILE": "stderr",  # UCX and UCXX log to stdout by default
    "UCXX_LOG_LEVEL": "FATAL",  # UCXX logs every peer that disconnects as an ERROR
}.items():
    os.environ.setdefault(_name, _value)

MAX_BATCH_KEYS = 1 << 16
_START_TIMEOUT_S = 30.0
_GRACE_S = 5.0  # the loop enforces fetch deadlines; this only guards against a wedged loop


class _ProtocolError(Exception):
    """The peer broke the protocol; its endpoint is discarded."""


class _Runtime:
    """The process's UCX context, the event-loop thread that drives it, and the threads that
    open blocks (a store may block; the loop must not)."""

    def __init__(self, options: dict[str, str]) -> None:
        self.options = options
        self.users: set[UcxEngine] = set()  # strong references: a serving engine lives on
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="kvstore-ucx")
        self.thread.daemon = True
        self.readers = concurrent.futures.ThreadPoolExecutor(8, "kvstore-ucx-open")
        self.context: Any = None
        self._progress: Any = None

    def start(self) -> None:
        self.thread.start()
        self.call(self._make_context(), _START_TIMEOUT_S)

    async def _make_context(self) -> None:
        # On the loop thread: ucxx binds its progress and notifier to the running loop. Python
        # futures complete requests without spinning the loop (ucxx polls with sleep(0) else).
        from ucxx._lib_async import ApplicationContext
        from ucxx._lib_async.application_context import ProgressTasks

        self.context = ApplicationContext(
            self.options, progress_mode="thread", enable_python_future=True
        )
        # ucxx keeps progress threads in a module-wide dict that any dying context clears
        # (stopping the threads in it): our own reference keeps ours running.
        self._progress = ProgressTasks[self.loop]

    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, Any], timeout_s: float) -> Any:
        return self.submit(coro).result(timeout_s)

    def stop(self) -> None:
        """Cancel leftover tasks, stop UCX's threads, then the loop. Endpoints must be closed."""
        from ucxx._lib_async.application_context import ProgressTasks

        self.call(_cancel_other_tasks(), _START_TIMEOUT_S)
        context, self.context = self.context, None
        context.worker.stop_request_notifier_thread()  # wakes the notifier now, not in 1 s
        context.stop_notifier_thread()
        context.worker.stop_progress_thread()
        ProgressTasks.pop(self.loop, None)
        self._progress = context = None
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()
        self.readers.shutdown(wait=False, cancel_futures=True)
        gc.collect()  # the context dies now, while no other runtime's progress can be cleared


async def _cancel_other_tasks() -> None:
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


_runtime: _Runtime | None = None
_runtime_lock = threading.Lock()


def _acquire_runtime(engine: UcxEngine, options: dict[str, str]) -> _Runtime:
    """The shared runtime, started on first use. UCX options are per process: all must agree."""
    global _runtime
    with _runtime_lock:
        if _runtime is None:
            runtime = _Runtime(options)
            runtime.start()
            _runtime = runtime
        elif any(_runtime.options.get(name) != value for name, value in options.items()):
            raise ConfigError(
                f"UCX already runs in this process with {_runtime.options}; all ucx engines "
                f"of a process must agree on tls and net_devices, not {options}"
            )
        _runtime.users.add(engine)
        return _runtime


def _release_runtime(engine: UcxEngine, runtime: _Runtime) -> None:
    global _runtime
    with _runtime_lock:
        runtime.users.discard(engine)
        if runtime.users or runtime is not _runtime:
            return
        _runtime = None
        runtime.stop()


def _stop_at_exit() -> None:
    """Stop UCX while the interpreter is whole: UCX's threads call back into Python."""
    global _runtime
    with _runtime_lock:
        runtime, _runtime = _runtime, None
        if runtime is not None:
            runtime.stop()


atexit.register(_stop_at_exit)


@dataclass
class _Batch:
    """One fetch in flight: block i goes into targets[i]; received[i] counts its bytes."""

    keys: Sequence[BlockKey]
    targets: list[np.ndarray]
    received: list[int] = field(init=False)
    answered: bool = False  # the peer sent at least one frame on this endpoint

    def __post_init__(self) -> None:
        self.received = [0] * len(self.keys)


@register_engine("ucx")
class UcxEngine(TransferEngine):
    """Blocks over UCX tag send/recv through ucxx; endpoints pooled per peer. Thread-safe.

    `tls` sets UCX_TLS and `net_devices` UCX_NET_DEVICES of the process's UCX context (None:
    the environment's value, else UCX's default, which picks RDMA where present). ucxx's
    listener binds every interface: `host` in serve() only names the address peers dial.
    """

    def __init__(
        self, tls: str | None = None, net_devices: str | None = None,
        send_timeout_s: float = 30.0, pool_connections_per_peer: int = 4,
    ) -> None:  # fmt: skip
        self.options = {
            name: value
            for name, value in (("TLS", tls), ("NET_DEVICES", net_devices))
            if value is not None
        }
        self.send_timeout_s = send_timeout_s  # a peer that stops reading releases its pins
        self.pool_connections_per_peer = pool_connections_per_peer
        self.stats = TransferStats()  # updated on the loop thread only
        self._lock = threading.Lock()
        self._rt: _Runtime | None = None
        self._closed = False
        self._listener: Any = None
        self._open_block: OpenBlock | None = None
        # Touched on the loop thread only, like the stats.
        self._idle: dict[tuple[str, int], list[Any]] = {}
        self._busy: set[Any] = set()
        self._peers: set[Any] = set()

    # ---- lifecycle -----------------------------------------------------------------------
    def _runtime(self) -> _Runtime:
        with self._lock:
            if self._closed:
                raise TransferError("ucx engine is closed")
            if self._rt is None:
                self._rt = _acquire_runtime(self, self.options)
            return self._rt

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            runtime, self._closed = self._rt, True  # in-flight coroutines still use _rt
        if runtime is not None and runtime.context is not None:  # not stopped at exit
            runtime.call(self._drop_endpoints(), _START_TIMEOUT_S)
            _release_runtime(self, runtime)

    async def _drop_endpoints(self) -> None:
        _abort_all([*self._busy, *self._peers, *(e for i in self._idle.values() for e in i)])
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
        port = runtime.call(self._listen(runtime, port), _START_TIMEOUT_S)
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        logger.info("ucx engine serving at %s", address)
        return address

    async def _listen(self, runtime: _Runtime, port: int) -> int:
        self._listener = runtime.context.create_listener(self._serve_peer, port=port)
        return self._listener.port

    async def _serve_peer(self, endpoint: Any) -> None:
        """Answer one peer's batches until it leaves or the engine closes."""
        self._peers.add(endpoint)
        self.stats.connections_accepted += 1
        try:
            while True:
                await self._serve_batch(endpoint, await _recv_batch(endpoint))
                self.stats.batches_served += 1
        except Exception as exc:  # a peer leaving shows up as a UCX error
            logger.debug("ucx peer done: %s", _forget(exc))
        finally:
            self._peers.discard(endpoint)
            endpoint.abort()

    async def _serve_batch(self, endpoint: Any, keys: list[BlockKey]) -> None:
        """Per key a frame (u64 length, 0 = absent), then the block straight from its pinned
        view. The next block is opened while this one is sent; blocks close on reader threads."""
        loop, readers = asyncio.get_running_loop(), self._rt.readers
        opening = loop.run_in_executor(readers, _enter, self._open_block, keys[0])
        closing = []
        try:
            for index in range(len(keys)):
                opened, whole = await opening
                opening = None
                if index + 1 < len(keys):
                    opening = loop.run_in_executor(
                        readers, _enter, self._open_block, keys[index + 1]
                    )
                try:
                    await self._send_frame(endpoint, whole)
                except BaseException:
                    endpoint.abort()  # UCX must stop reading the block before it is closed
                    raise
                finally:
                    closing.append(loop.run_in_executor(readers, _exit, opened))
        finally:
            if opening is not None:  # the batch broke: close the block opened ahead too
                closing.append(_exit_when_open(opening, readers))
            await asyncio.gather(*closing)

    async def _send_frame(self, endpoint: Any, whole: torch.Tensor | None) -> None:
        if whole is None:
            await asyncio.wait_for(endpoint.send(_u64(0)), self.send_timeout_s)
            return
        data = whole.reshape(-1).view(torch.uint8).cpu().numpy()
        sends = asyncio.gather(endpoint.send(_u64(data.size)), endpoint.send(data))
        await asyncio.wait_for(sends, self.send_timeout_s)  # a stalled peer releases its pins

    # ---- fetching ------------------------------------------------------------------------
    def fetch(
        self, address: str, keys: Sequence[BlockKey], pages: Sequence[torch.Tensor],
        timeout_s: float,
    ) -> list[int]:  # fmt: skip
        batch = _Batch(keys, _page_arrays(keys, pages))
        runtime = self._runtime()
        if not keys:
            return []
        future = runtime.submit(self._fetch(_split_address(address), batch, timeout_s))
        try:
            return future.result(timeout_s + _GRACE_S)
        except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
            future.cancel()  # the loop is wedged or shutting down
            logger.warning("ucx fetch from %s did not finish; pages untrusted", address)
            return [0] * len(keys)

    async def _fetch(self, peer: tuple[str, int], batch: _Batch, timeout_s: float) -> list[int]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        endpoint, pooled = self._pooled(peer), True
        if endpoint is None:
            endpoint, pooled = await self._dial(peer, deadline), False
        while True:
            self._busy.add(endpoint)
            try:
                await asyncio.wait_for(_exchange(endpoint, batch), deadline - loop.time())
            except Exception as exc:
                endpoint.abort()  # cancels receives still aimed at the pages
                stale = pooled and not batch.answered and not isinstance(exc, TimeoutError)
                if stale and not self._closed:  # the peer had dropped it: redial once
                    endpoint, pooled = await self._dial(peer, deadline), False
                    continue
                self.stats.transfers_broken += 1
                logger.warning("ucx fetch from %s:%d broke: %s", *peer, _forget(exc))
                return batch.received
            except BaseException:
                endpoint.abort()
                raise
            finally:
                self._busy.discard(endpoint)
            self._pool(peer, endpoint)
            return batch.received

    def _pooled(self, peer: tuple[str, int]) -> Any:
        idle = self._idle.get(peer, [])
        while idle:
            endpoint = idle.pop()
            if not endpoint.closed:
                return endpoint
            endpoint.abort()
        return None

    def _pool(self, peer: tuple[str, int], endpoint: Any) -> None:
        idle = self._idle.setdefault(peer, [])
        if len(idle) < self.pool_connections_per_peer and not self._closed:
            idle.append(endpoint)
        else:
            endpoint.abort()

    async def _dial(self, peer: tuple[str, int], deadline: float) -> Any:
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


def _enter(open_block: OpenBlock, key: BlockKey) -> tuple[Any, torch.Tensor | None]:
    """On a reader thread: open `key`'s block. A store that fails serves it as absent."""
    try:
        opened = open_block(key)
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


async def _recv_batch(endpoint: Any) -> list[BlockKey]:
    """A request: a u64 key count, then the keys in one message."""
    count = np.empty(1, dtype=np.uint64)
    await endpoint.recv(count)
    if not 0 < int(count[0]) <= MAX_BATCH_KEYS:
        raise _ProtocolError(f"batch of {int(count[0])} keys")
    raw = np.empty(int(count[0]) * KEY_BYTES, dtype=np.uint8)
    await endpoint.recv(raw)
    data = raw.tobytes()
    return [BlockKey(data[i : i + KEY_BYTES]) for i in range(0, len(data), KEY_BYTES)]


async def _exchange(endpoint: Any, batch: _Batch) -> None:
    """Send the batch, then receive per key a length frame and the block into its page. The
    next frame's receive is posted right behind each block's, so no wake-up separates them."""
    await endpoint.send(_u64(len(batch.keys)))
    await endpoint.send(np.frombuffer(bytearray(b"".join(batch.keys)), dtype=np.uint8))
    frames = np.zeros(len(batch.keys), dtype=np.uint64)
    pending = [asyncio.ensure_future(endpoint.recv(frames[0:1]))]
    try:
        for index, target in enumerate(batch.targets):
            await pending.pop(0)
            batch.answered = True
            size_bytes = int(frames[index])
            if size_bytes and not HEADER_BYTES <= size_bytes <= target.size:
                raise _ProtocolError(f"a {size_bytes}-byte block for a {target.size}-byte page")
            if size_bytes:  # tasks start in order, so UCX matches the receives in this order
                pending.append(asyncio.ensure_future(endpoint.recv(target[:size_bytes])))
            if index + 1 < len(frames):
                pending.append(asyncio.ensure_future(endpoint.recv(frames[index + 1 : index + 2])))
            if size_bytes:
                await pending.pop(0)
                batch.received[index] = size_bytes
    finally:
        for task in pending:
            task.cancel()
        for outcome in await asyncio.gather(*pending, return_exceptions=True):
            if isinstance(outcome, BaseException):
                _forget(outcome)


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
