"""The `tcp` transfer engine: blocks stream over plain sockets, straight from and into pages.

Runs inside the node agent: a listener thread and one thread per peer connection serve local
blocks; fetches reuse pooled connections per peer and `recv_into` arena pages (no extra copy).
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from kvstore.errors import ConfigError, TransferError
from kvstore.keys import KEY_BYTES, BlockKey
from kvstore.transfer.base import OpenBlock, TransferEngine, TransferStats, register_engine

logger = logging.getLogger(__name__)

MAGIC = b"KVST"
VERSION = 1
# A request is BATCH (magic, version, reserved, key count) then the keys. The response is BATCH
# echoing the count, then per key in order a FRAME (block length, 0 = absent) and the block.
BATCH = struct.Struct("<4sHHI")
FRAME = struct.Struct("<Q")
_CLOSE_WAIT_S = 2.0  # close() waits this long for serving threads (one may be inside open_block)


class ProtocolError(TransferError):
    """The peer sent bytes that break the protocol; its connection is dropped."""


@dataclass(frozen=True)
class TcpOptions:
    """Settings of a TcpEngine; every field can be passed to make_engine("tcp", ...)."""

    connect_timeout_s: float = 5.0
    send_timeout_s: float = 30.0  # server: a peer that stops reading releases its pins by then
    idle_timeout_s: float = 300.0  # server: an idle peer connection is closed after this
    pool_connections_per_peer: int = 4  # idle connections kept per peer; extras are closed
    socket_buffer_bytes: int = 0  # SO_SNDBUF/SO_RCVBUF; 0 keeps the kernel's autotuning
    max_batch_keys: int = 1 << 16

    def __post_init__(self) -> None:
        for name in ("connect_timeout_s", "send_timeout_s", "idle_timeout_s", "max_batch_keys"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"tcp engine: {name} must be positive, got {getattr(self, name)}")
        if self.pool_connections_per_peer < 0 or self.socket_buffer_bytes < 0:
            raise ConfigError("tcp engine: pool_connections_per_peer and socket_buffer_bytes >= 0")


@register_engine("tcp")
class TcpEngine(TransferEngine):
    """Serves and fetches whole blocks over TCP. Thread-safe; connections are never shared."""

    def __init__(self, **options: float) -> None:
        self.options = _make_options(options)
        self.stats = TransferStats()  # updated under the engine's lock
        self._lock = threading.Lock()
        self._pool: dict[str, list[socket.socket]] = {}
        self._peers: dict[socket.socket, threading.Thread] = {}  # connections being served
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None
        self._closed = False

    # ---- serving -------------------------------------------------------------------------
    def serve(self, open_block: OpenBlock, host: str = "127.0.0.1", port: int = 0) -> str:
        with self._lock:
            if self._closed or self._listener is not None:
                raise ConfigError("tcp engine is closed or already serving")
            self._listener = listener = self._listen(host, port)
            self._acceptor = threading.Thread(
                target=self._accept_loop, args=(listener, open_block), daemon=True,
                name="kvstore-tcp-accept",
            )  # fmt: skip
            self._acceptor.start()
        port = listener.getsockname()[1]
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        logger.info("tcp engine serving at %s", address)
        return address

    def _listen(self, host: str, port: int) -> socket.socket:
        listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._tune(listener)  # accepted sockets inherit the buffer sizes
            listener.bind((host, port))
            listener.listen(128)
        except OSError as exc:
            listener.close()
            raise TransferError(f"tcp engine cannot listen on {host}:{port}: {exc}") from exc
        return listener

    def _accept_loop(self, listener: socket.socket, open_block: OpenBlock) -> None:
        while not self._closed:  # close() shuts the listener down, which ends accept()
            try:
                conn, peer = listener.accept()
            except OSError as exc:
                if not self._closed:  # e.g. out of file descriptors: retry shortly
                    logger.warning("tcp engine cannot accept: %s", exc)
                    time.sleep(0.1)
                continue
            try:
                self._tune(conn)
            except OSError:  # the peer already hung up
                conn.close()
                continue
            thread = threading.Thread(
                target=self._serve_peer, args=(conn, open_block), daemon=True,
                name=f"kvstore-tcp-peer-{peer[1]}",
            )  # fmt: skip
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._peers[conn] = thread
                self.stats.connections_accepted += 1
                thread.start()  # under the lock: close() only ever joins started threads

    def _serve_peer(self, conn: socket.socket, open_block: OpenBlock) -> None:
        """Answer the peer's batches until it hangs up, errs, idles out or close() runs."""
        try:
            while True:
                conn.settimeout(self.options.idle_timeout_s)
                count = _recv_batch_head(conn, self.options.max_batch_keys)
                raw = bytearray(count * KEY_BYTES)
                conn.settimeout(self.options.send_timeout_s)
                _recv_exact(conn, memoryview(raw))
                conn.sendall(BATCH.pack(MAGIC, VERSION, 0, count))
                for start in range(0, len(raw), KEY_BYTES):
                    _send_block(conn, open_block, BlockKey(bytes(raw[start : start + KEY_BYTES])))
                with self._lock:
                    self.stats.batches_served += 1
        except ProtocolError as exc:
            logger.warning("dropping tcp peer: %s", exc)
        except OSError as exc:
            logger.debug("tcp peer connection ended: %s", exc)
        finally:
            with self._lock:
                self._peers.pop(conn, None)
            conn.close()

    # ---- fetching ------------------------------------------------------------------------
    def fetch(
        self, address: str, keys: Sequence[BlockKey], pages: Sequence[torch.Tensor],
        timeout_s: float,
    ) -> list[int]:  # fmt: skip
        buffers = _page_buffers(keys, pages, self.options.max_batch_keys)
        if self._closed:
            raise TransferError("tcp engine is closed")
        received = [0] * len(keys)
        if not keys:
            return received
        deadline = time.monotonic() + timeout_s
        conn = self._pooled(address)
        if conn is None or not self._exchange(conn, address, keys, buffers, received, deadline):
            conn = self._dial(address, deadline)  # none pooled, or the peer had closed it
            self._exchange(conn, address, keys, buffers, received, deadline, reused=False)
        return received

    def _exchange(
        self, conn: socket.socket, address: str, keys: Sequence[BlockKey],
        buffers: list[memoryview], received: list[int], deadline: float, reused: bool = True,
    ) -> bool:  # fmt: skip
        """One batch on `conn`, filling `received` in order; any error drops `conn`. False
        only when a `reused` connection turns out closed by the peer before it answered."""
        answered = False
        try:
            conn.settimeout(_remaining(deadline))
            conn.sendall(BATCH.pack(MAGIC, VERSION, 0, len(keys)) + b"".join(keys))
            if _recv_batch_head(conn, len(keys), deadline) != len(keys):
                raise ProtocolError(f"peer answered a batch of {len(keys)} keys with fewer")
            answered = True
            for index, buffer in enumerate(buffers):
                received[index] = _recv_block(conn, buffer, deadline)
        except (OSError, TransferError) as exc:
            conn.close()
            if reused and not answered and isinstance(exc, ConnectionError):
                return False
            logger.warning("tcp fetch of %d blocks from %s broke: %s", len(keys), address, exc)
            with self._lock:
                self.stats.transfers_broken += 1
            return True
        self._release(address, conn)
        return True

    def _pooled(self, address: str) -> socket.socket | None:
        """An idle pooled connection to `address` that the peer has not closed, or None."""
        while True:
            with self._lock:
                idle = self._pool.get(address)
                if not idle:
                    return None
                conn = idle.pop()
            if _is_quiet(conn):
                return conn
            conn.close()  # readable while idle: the peer hung up (or sent garbage)

    def _release(self, address: str, conn: socket.socket) -> None:
        with self._lock:
            idle = self._pool.setdefault(address, [])
            if not self._closed and len(idle) < self.options.pool_connections_per_peer:
                idle.append(conn)
                return
        conn.close()

    def _dial(self, address: str, deadline: float) -> socket.socket:
        host, port = _split_address(address)
        conn = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        try:
            self._tune(conn)  # before connect, so the window scale can use the buffers
            conn.settimeout(min(self.options.connect_timeout_s, _remaining(deadline)))
            conn.connect((host, port))
        except OSError as exc:
            conn.close()
            raise TransferError(f"cannot reach tcp peer {address}: {exc}") from exc
        with self._lock:
            self.stats.connections_opened += 1
        return conn

    def _tune(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.options.socket_buffer_bytes:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.options.socket_buffer_bytes)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.options.socket_buffer_bytes)

    # ---- lifecycle -----------------------------------------------------------------------
    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            listener, self._listener = self._listener, None
            peers = dict(self._peers)
            idle = [conn for conns in self._pool.values() for conn in conns]
            self._pool.clear()
        for conn in [listener, *peers] if listener else list(peers):
            _shutdown(conn)  # wakes the threads blocked on them; they close their own
        for conn in idle:
            conn.close()
        if listener is not None and self._acceptor is not None:
            deadline = time.monotonic() + _CLOSE_WAIT_S
            for thread in [self._acceptor, *peers.values()]:  # stop using the store's views
                thread.join(timeout=max(0.0, deadline - time.monotonic()))
            listener.close()
            logger.info("tcp engine stopped serving")


# ---- wire helpers (module level: both sides use them, none touches engine state) -----------
def _make_options(options: dict[str, float]) -> TcpOptions:
    known = {field.name for field in fields(TcpOptions)}
    if unknown := sorted(set(options) - known):
        raise ConfigError(f"unknown tcp engine options {unknown}; known: {sorted(known)}")
    return TcpOptions(**options)


def _page_buffers(
    keys: Sequence[BlockKey], pages: Sequence[torch.Tensor], max_batch_keys: int
) -> list[memoryview]:
    """Writable byte views of the pages; ConfigError for misuse (caught before any I/O)."""
    if len(keys) != len(pages):
        raise ConfigError(f"fetch got {len(keys)} keys but {len(pages)} pages")
    if len(keys) > max_batch_keys or any(len(key) != KEY_BYTES for key in keys):
        raise ConfigError(f"fetch takes at most {max_batch_keys} keys of {KEY_BYTES} bytes")
    if not all(
        p.device.type == "cpu" and p.dtype == torch.uint8 and p.is_contiguous() for p in pages
    ):
        raise ConfigError("tcp engine receives into contiguous uint8 host pages only")
    return [memoryview(page.numpy()).cast("B") for page in pages]


def _recv_batch_head(conn: socket.socket, max_keys: int, deadline: float | None = None) -> int:
    """Read a request or response head; returns its key count."""
    head = bytearray(BATCH.size)
    _recv_exact(conn, memoryview(head), deadline)
    magic, version, _, count = BATCH.unpack(head)
    if magic != MAGIC or version != VERSION:
        raise ProtocolError(f"not a kvstore tcp v{VERSION} peer (magic {magic!r}, v{version})")
    if count > max_keys:
        raise ProtocolError(f"batch of {count} keys exceeds the limit of {max_keys}")
    return count


def _recv_block(conn: socket.socket, buffer: memoryview, deadline: float) -> int:
    """Receive one frame into `buffer`; returns its length (0: the peer lacks the block)."""
    head = bytearray(FRAME.size)
    _recv_exact(conn, memoryview(head), deadline)
    (length,) = FRAME.unpack(head)
    if length > len(buffer):
        raise ProtocolError(f"peer sent a {length}-byte block for a {len(buffer)}-byte page")
    _recv_exact(conn, buffer[:length], deadline)
    return length


def _send_block(conn: socket.socket, open_block: OpenBlock, key: BlockKey) -> None:
    """Send one frame straight from the block's pinned view. A store that fails before any
    byte is sent serves 'absent'; a failure once sending began drops the connection."""
    sending = False
    try:
        with open_block(key) as view:
            if view is not None:
                body = memoryview(view.cpu().numpy()).cast("B")
                sending = True
                _send_frame(conn, body)
    except Exception:
        if sending:
            raise
        logger.exception("serving %r failed; sending it as absent", key)
    if not sending:
        conn.sendall(FRAME.pack(0))


def _send_frame(conn: socket.socket, body: memoryview) -> None:
    """Frame header and body in one sendmsg where possible (one packet for small blocks)."""
    head = FRAME.pack(len(body))
    sent = conn.sendmsg([head, body])
    if sent < len(head):
        conn.sendall(head[sent:])
        sent = len(head)
    conn.sendall(body[sent - len(head) :])


def _recv_exact(conn: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill `view`; ConnectionError at EOF. With a deadline, every wait is bounded by the time
    left (TimeoutError once it has passed); without, by the socket's own timeout."""
    got = 0
    while got < len(view):
        if deadline is not None:
            conn.settimeout(_remaining(deadline))
        count = conn.recv_into(view[got:])
        if count == 0:
            raise ConnectionError(f"peer closed the connection ({got} of {len(view)} bytes read)")
        got += count


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("fetch timed out")
    return left


def _is_quiet(conn: socket.socket) -> bool:
    """Whether an idle connection has nothing to read (a hung-up peer reads as EOF)."""
    poller = select.poll()
    poller.register(conn, select.POLLIN)
    return not poller.poll(0)


def _split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"a tcp address is host:port, got {address!r}")
    return host.strip("[]"), int(port)


def _shutdown(conn: socket.socket) -> None:
    with contextlib.suppress(OSError):  # already disconnected
        conn.shutdown(socket.SHUT_RDWR)
