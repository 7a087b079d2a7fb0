"""The `tcp` transfer engine: blocks stream over plain sockets, straight from and into pages.

Runs inside the node agent: a listener thread and one thread per peer connection (capped in
total and per peer host) serve local blocks; fetches reuse pooled connections per peer and
`recv_into` arena pages (no extra copy). The wire format lives in `tcp_wire.py`.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import select
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import torch

from kvstore.errors import ConfigError, TransferError
from kvstore.keys import BlockKey
from kvstore.transfer import auth
from kvstore.transfer.base import (
    OpenBlock,
    TransferEngine,
    TransferStats,
    check_fetch_pages,
    register_engine,
)
from kvstore.transfer.tcp_wire import (
    BATCH,
    FRAME,
    MAGIC,
    VERSION,
    Conn,
    HandshakeError,
    MacError,
    ProtocolError,
    client_handshake,
    pack_request,
    recv_frame,
    recv_request,
    recv_response_head,
    remaining,
    send_frame,
    send_parts,
    server_handshake,
)

__all__ = ["BATCH", "FRAME", "MAGIC", "VERSION", "ProtocolError", "TcpEngine", "TcpOptions"]

logger = logging.getLogger(__name__)

_CLOSE_WAIT_S = 2.0  # close() waits this long for serving threads (one may be inside open_block)


@dataclass(frozen=True)
class TcpOptions:
    """Settings of a TcpEngine; every field can be passed to make_engine("tcp", ...)."""

    cluster_secret: bytes | None = field(default=None, repr=False)  # None: no authentication
    connect_timeout_s: float = 5.0
    handshake_timeout_s: float = 5.0  # a peer that has not proved the secret by then is dropped
    batch_deadline_s: float = 60.0  # server: a whole batch (request in, blocks out), pins too
    idle_timeout_s: float = 300.0  # server: an idle peer connection is closed after this
    max_connections: int = 256  # server: accepted connections at once; extras closed at once
    max_connections_per_peer: int = 32  # server: the same, per peer host
    pool_connections_per_peer: int = 4  # idle connections kept per peer; extras are closed
    socket_buffer_bytes: int = 0  # SO_SNDBUF/SO_RCVBUF; 0 keeps the kernel's autotuning
    max_batch_keys: int = 1 << 16

    def __post_init__(self) -> None:
        auth.check_secret(self.cluster_secret)
        for name in _POSITIVE:
            if getattr(self, name) <= 0:
                raise ConfigError(f"tcp engine: {name} must be positive, got {getattr(self, name)}")
        if self.pool_connections_per_peer < 0 or self.socket_buffer_bytes < 0:
            raise ConfigError("tcp engine: pool_connections_per_peer and socket_buffer_bytes >= 0")


_POSITIVE = (
    "connect_timeout_s", "handshake_timeout_s", "batch_deadline_s", "idle_timeout_s",
    "max_connections", "max_connections_per_peer", "max_batch_keys",
)  # fmt: skip


@register_engine("tcp")
class TcpEngine(TransferEngine):
    """Serves and fetches whole blocks over TCP. Thread-safe; connections are never shared."""

    def __init__(self, **options: object) -> None:
        self.options = _make_options(options)
        self.stats = TransferStats()  # updated under the engine's lock
        self._lock = threading.Lock()
        self._pool: dict[str, list[Conn]] = {}
        self._peers: dict[socket.socket, threading.Thread] = {}  # connections being served
        self._hosts: collections.Counter[str] = collections.Counter()  # ... per peer host
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
        auth.warn_if_open("tcp", host, self.options.cluster_secret)
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
            if not self._admit(conn, peer[0], open_block):
                conn.close()

    def _admit(self, conn: socket.socket, host: str, open_block: OpenBlock) -> bool:
        """Start serving `conn` unless the engine is closed or a connection cap is reached."""
        thread = threading.Thread(
            target=self._serve_peer, args=(conn, host, open_block), daemon=True,
            name=f"kvstore-tcp-peer-{host}",
        )  # fmt: skip
        with self._lock:
            if self._closed:
                return False
            if (
                len(self._peers) >= self.options.max_connections
                or self._hosts[host] >= self.options.max_connections_per_peer
            ):
                self.stats.connections_refused += 1
                logger.warning("refusing a tcp connection from %s: connection cap reached", host)
                return False
            self._peers[conn] = thread
            self._hosts[host] += 1
            self.stats.connections_accepted += 1
            thread.start()  # under the lock: close() only ever joins started threads
        return True

    def _serve_peer(self, sock: socket.socket, host: str, open_block: OpenBlock) -> None:
        """Authenticate the peer, then answer its batches until it hangs up, errs, idles out,
        misses a batch deadline or close() runs."""
        try:
            conn = self._authenticate(sock)
            while _wait_readable(sock, self.options.idle_timeout_s):
                deadline = time.monotonic() + self.options.batch_deadline_s
                tenant, keys = recv_request(sock, self.options.max_batch_keys, deadline)
                send_parts(sock, [BATCH.pack(MAGIC, VERSION, 0, len(keys))], deadline)
                for key in keys:
                    _send_block(conn, open_block, tenant, key, deadline)
                with self._lock:
                    self.stats.batches_served += 1
        except HandshakeError as exc:
            with self._lock:
                self.stats.handshakes_failed += 1
            logger.warning("dropping tcp peer %s: %s", host, exc)
        except ProtocolError as exc:
            logger.warning("dropping tcp peer %s: %s", host, exc)
        except OSError as exc:
            logger.debug("tcp peer connection ended: %s", exc)
        finally:
            with self._lock:
                self._peers.pop(sock, None)
                self._hosts[host] -= 1
                if not self._hosts[host]:
                    del self._hosts[host]
            sock.close()

    def _authenticate(self, sock: socket.socket) -> Conn:
        secret = self.options.cluster_secret
        if secret is None:
            return Conn(sock)
        deadline = time.monotonic() + self.options.handshake_timeout_s
        try:
            return Conn(sock, server_handshake(sock, secret, deadline))
        except OSError as exc:  # silent, slow or gone before proving anything
            raise HandshakeError(f"no valid handshake: {exc!r}") from None

    # ---- fetching ------------------------------------------------------------------------
    def fetch(
        self, address: str, tenant: str, keys: Sequence[BlockKey],
        pages: Sequence[torch.Tensor], timeout_s: float,
    ) -> list[int]:  # fmt: skip
        buffers = _page_buffers(keys, pages, self.options.max_batch_keys)
        request = pack_request(tenant, keys)  # ConfigError for a bad tenant, before any I/O
        if self._closed:
            raise TransferError("tcp engine is closed")
        received = [0] * len(keys)
        if not keys:
            return received
        deadline = time.monotonic() + timeout_s
        conn = self._pooled(address)
        if conn is None or not self._exchange(conn, address, request, keys, buffers, received,
                                              deadline):  # fmt: skip
            conn = self._dial(address, deadline)  # none pooled, or the peer had closed it
            self._exchange(conn, address, request, keys, buffers, received, deadline, False)
        return received

    def _exchange(
        self, conn: Conn, address: str, request: bytes, keys: Sequence[BlockKey],
        buffers: list[memoryview], received: list[int], deadline: float, reused: bool = True,
    ) -> bool:  # fmt: skip
        """One batch on `conn`, filling `received` in order; any error drops `conn`. False
        only when a `reused` connection turns out closed by the peer before it answered."""
        answered = False
        try:
            send_parts(conn.sock, [request], deadline)
            if recv_response_head(conn.sock, len(keys), deadline) != len(keys):
                raise ProtocolError(f"peer answered a batch of {len(keys)} keys with fewer")
            answered = True
            for index, (key, buffer) in enumerate(zip(keys, buffers, strict=True)):
                received[index] = recv_frame(conn, key, buffer, deadline)
        except (OSError, TransferError) as exc:
            conn.sock.close()
            if reused and not answered and isinstance(exc, ConnectionError):
                return False
            logger.warning("tcp fetch of %d blocks from %s broke: %s", len(keys), address, exc)
            with self._lock:
                self.stats.transfers_broken += 1
                self.stats.macs_failed += isinstance(exc, MacError)
            return True
        self._release(address, conn)
        return True

    def _pooled(self, address: str) -> Conn | None:
        """An idle pooled connection to `address` that the peer has not closed, or None."""
        while True:
            with self._lock:
                idle = self._pool.get(address)
                if not idle:
                    return None
                conn = idle.pop()
            if _is_quiet(conn.sock):
                return conn
            conn.sock.close()  # readable while idle: the peer hung up (or sent garbage)

    def _release(self, address: str, conn: Conn) -> None:
        with self._lock:
            idle = self._pool.setdefault(address, [])
            if not self._closed and len(idle) < self.options.pool_connections_per_peer:
                idle.append(conn)
                return
        conn.sock.close()

    def _dial(self, address: str, deadline: float) -> Conn:
        """A new connection to `address`, authenticated when the engine has a secret."""
        host, port = _split_address(address)
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        try:
            self._tune(sock)  # before connect, so the window scale can use the buffers
            sock.settimeout(min(self.options.connect_timeout_s, remaining(deadline)))
            sock.connect((host, port))
            conn = self._prove(sock, deadline)
        except (OSError, TransferError) as exc:
            sock.close()
            if isinstance(exc, HandshakeError):
                with self._lock:
                    self.stats.handshakes_failed += 1
            raise TransferError(f"cannot reach tcp peer {address}: {exc!r}") from exc
        with self._lock:
            self.stats.connections_opened += 1
        return conn

    def _prove(self, sock: socket.socket, deadline: float) -> Conn:
        secret = self.options.cluster_secret
        if secret is None:
            return Conn(sock)
        deadline = min(deadline, time.monotonic() + self.options.handshake_timeout_s)
        return Conn(sock, client_handshake(sock, secret, deadline))

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
            conn.sock.close()
        if listener is not None and self._acceptor is not None:
            deadline = time.monotonic() + _CLOSE_WAIT_S
            for thread in [self._acceptor, *peers.values()]:  # stop using the store's views
                thread.join(timeout=max(0.0, deadline - time.monotonic()))
            listener.close()
            logger.info("tcp engine stopped serving")


# ---- wire helpers (module level: both sides use them, none touches engine state) -----------
def _make_options(options: dict[str, object]) -> TcpOptions:
    known = {field.name for field in fields(TcpOptions)}
    if unknown := sorted(set(options) - known):
        raise ConfigError(f"unknown tcp engine options {unknown}; known: {sorted(known)}")
    return TcpOptions(**options)


def _page_buffers(
    keys: Sequence[BlockKey], pages: Sequence[torch.Tensor], max_batch_keys: int
) -> list[memoryview]:
    """Writable byte views of the pages; ConfigError for misuse (caught before any I/O)."""
    check_fetch_pages("tcp", keys, pages, max_batch_keys)
    return [memoryview(page.numpy()).cast("B") for page in pages]


def _send_block(
    conn: Conn, open_block: OpenBlock, tenant: str, key: BlockKey, deadline: float
) -> None:  # fmt: skip
    """Send one frame straight from the block's pinned view (unpinned however sending ends).
    A store that fails before any byte is sent serves 'absent'; a failure once sending
    began drops the connection."""
    sending = False
    try:
        with open_block(key, tenant) as view:
            if view is not None:
                body = memoryview(view.cpu().numpy()).cast("B")
                sending = True
                send_frame(conn, key, body, deadline)
    except Exception:
        if sending:
            raise
        logger.exception("serving %r failed; sending it as absent", key)
    if not sending:
        send_frame(conn, key, memoryview(b""), deadline)


def _wait_readable(sock: socket.socket, timeout_s: float) -> bool:
    """Whether `sock` has bytes (or EOF) to read within `timeout_s`; False: it idled out."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(timeout_s * 1000))


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
