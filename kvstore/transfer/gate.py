"""The front door both transfer engines share: a tcp listener bound to the configured host,
connection caps in total and per peer host (extras closed at once and counted), the
cluster-secret handshake under its deadline, and dialling a peer with the same proofs.

Connections still in the handshake have slots of their own (in total and per peer host), so
peers that cannot prove the secret never take an authenticated peer's. With every handshake
slot taken, the oldest handshake is dropped for the newcomer (a genuine peer's takes
milliseconds; a silent one holds its slot until dropped). At the connection cap the
longest-idle authenticated connection (a peer's pooled one, waiting for its next batch) is
closed to make room, so idle pools cannot lock new peers out.

Runs inside the node agent: one accept thread per serving engine, one thread per admitted peer.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields

from kvstore.errors import ConfigError, TransferError
from kvstore.transfer import auth
from kvstore.transfer.base import TransferStats
from kvstore.transfer.tcp_wire import (
    Conn,
    HandshakeError,
    ProtocolError,
    client_handshake,
    remaining,
    server_handshake,
)

logger = logging.getLogger(__name__)

_CLOSE_WAIT_S = 2.0  # close() waits this long for serving threads (one may be inside open_block)

# Serves one admitted, authenticated connection from peer `host` until it ends (on its thread).
ServeConn = Callable[[Conn, str], None]


@dataclass(frozen=True)
class LinkOptions:
    """The bounds and secret of an engine's connections; every field is an engine option."""

    cluster_secret: bytes | None = field(default=None, repr=False)  # None: no authentication
    connect_timeout_s: float = 5.0
    handshake_timeout_s: float = 5.0  # a peer that has not proved the secret by then is dropped
    batch_deadline_s: float = 60.0  # server: a whole batch (request in, blocks out), pins too
    idle_timeout_s: float = 300.0  # server: an idle peer connection is closed after this
    max_connections: int = 256  # server: accepted connections at once; extras closed at once
    max_connections_per_peer: int = 32  # server: the same, per peer host
    max_handshakes: int = 128  # server: connections not authenticated yet, at once
    max_handshakes_per_peer: int = 32  # server: the same, per peer host (a TP engine's burst)
    pool_connections_per_peer: int = 4  # idle connections kept per peer; extras are closed
    socket_buffer_bytes: int = 0  # SO_SNDBUF/SO_RCVBUF; 0 keeps the kernel's autotuning

    def __post_init__(self) -> None:
        auth.check_secret(self.cluster_secret)
        for name in _POSITIVE:
            if getattr(self, name) <= 0:
                raise ConfigError(f"transfer: {name} must be positive, got {getattr(self, name)}")
        if self.pool_connections_per_peer < 0 or self.socket_buffer_bytes < 0:
            raise ConfigError("transfer: pool_connections_per_peer and socket_buffer_bytes >= 0")

    @classmethod
    def make(cls, engine: str, options: dict[str, object]):
        """The options of `engine` from keyword options; ConfigError naming unknown ones."""
        known = {option.name for option in fields(cls)}
        if unknown := sorted(set(options) - known):
            raise ConfigError(f"unknown {engine} engine options {unknown}; known: {sorted(known)}")
        return cls(**options)


_POSITIVE = (
    "connect_timeout_s",
    "handshake_timeout_s",
    "batch_deadline_s",
    "idle_timeout_s",
    "max_connections",
    "max_connections_per_peer",
    "max_handshakes",
    "max_handshakes_per_peer",
)


class Gate:
    """Accepts peers on one address and serves each admitted one on its own thread. Updates
    `stats` (accepted, refused, failed handshakes) under `lock`, the engine's stats lock."""

    def __init__(
        self, engine: str, options: LinkOptions, stats: TransferStats, lock: threading.Lock
    ) -> None:
        self.engine, self.options, self.stats, self._lock = engine, options, stats, lock
        self._peers: dict[socket.socket, threading.Thread] = {}  # every connection's thread
        self._hosts: collections.Counter[str] = collections.Counter()  # served, per peer host
        self._served: dict[socket.socket, str] = {}  # authenticated connections: their host
        self._shaking: collections.Counter[str] = collections.Counter()  # in the handshake
        self._shaking_since: dict[socket.socket, float] = {}  # ... since when
        self._idle: dict[socket.socket, float] = {}  # served ones waiting for a batch: since
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None
        self._closed = False

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._peers)

    def open(self, host: str, port: int, serve: ServeConn) -> str:
        """Listen on host:port (that address only) and serve peers; returns host:port."""
        listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            tune(listener, self.options)  # accepted sockets inherit the buffer sizes
            listener.bind((host, port))
            listener.listen(128)
        except OSError as exc:
            listener.close()
            raise TransferError(
                f"{self.engine} engine cannot listen on {host}:{port}: {exc}"
            ) from exc
        self._listener = listener
        self._acceptor = threading.Thread(
            target=self._accept_loop,
            args=(listener, serve),
            daemon=True,
            name=f"kvstore-{self.engine}-accept",
        )
        self._acceptor.start()
        auth.warn_if_open(self.engine, host, self.options.cluster_secret)
        port = listener.getsockname()[1]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def _accept_loop(self, listener: socket.socket, serve: ServeConn) -> None:
        while not self._closed:  # close() shuts the listener down, which ends accept()
            try:
                sock, peer = listener.accept()
            except OSError as exc:
                if not self._closed:  # e.g. out of file descriptors: retry shortly
                    logger.warning("%s engine cannot accept: %s", self.engine, exc)
                    time.sleep(0.1)
                continue
            try:
                tune(sock, self.options)
            except OSError:  # the peer already hung up
                sock.close()
                continue
            try:
                admitted = self._admit(sock, peer[0], serve)
            except Exception:  # one connection's trouble never ends accepting
                logger.exception("%s engine could not admit %s", self.engine, peer[0])
                admitted = False
            if not admitted:
                sock.close()

    def _admit(self, sock: socket.socket, host: str, serve: ServeConn) -> bool:
        """Start the handshake of `sock` on its own thread, unless the gate is closed or the
        handshake slots (in total, or of its host) are all taken."""
        thread = threading.Thread(
            target=self._run,
            args=(sock, host, serve),
            daemon=True,
            name=f"kvstore-{self.engine}-peer-{host}",
        )
        options = self.options
        with self._lock:
            if self._closed:
                return False
            if self._shaking[host] >= options.max_handshakes_per_peer:
                self._refuse(host, "its handshake slots")
                return False
            if self._shaking.total() >= options.max_handshakes:
                if not self._shaking_since:  # only dropped ones, not ended yet
                    self._refuse(host, "handshake slots")
                    return False
                oldest = min(self._shaking_since, key=self._shaking_since.__getitem__)
                del self._shaking_since[oldest]  # its thread frees the slot as it ends
                shutdown(oldest)
                self.stats.handshakes_dropped += 1
            self._peers[sock] = thread
            self._shaking[host] += 1
            self._shaking_since[sock] = time.monotonic()
            thread.start()  # under the lock: close() only ever joins started threads
        return True

    def _refuse(self, host: str, what: str) -> None:
        self.stats.connections_refused += 1
        logger.warning("refusing a %s connection from %s: %s full", self.engine, host, what)

    def _enter(self, sock: socket.socket, host: str) -> bool:
        """Under the lock, once `sock` is authenticated: a served connection, if the caps
        allow or an idle one (of its host, at the per-peer cap) can be closed for it."""
        options = self.options
        if self._hosts[host] >= options.max_connections_per_peer:
            room = self._close_idle(lambda other: self._served.get(other) == host)
        elif len(self._served) >= options.max_connections:
            room = self._close_idle(lambda other: True)
        else:
            room = True
        if not room:
            self._refuse(host, "connection slots")
            return False
        self._served[sock] = host
        self._hosts[host] += 1
        self.stats.connections_accepted += 1
        return True

    def _close_idle(self, eligible) -> bool:
        """Close the longest-idle eligible served connection (its thread ends it)."""
        candidates = [(since, other) for other, since in self._idle.items() if eligible(other)]
        if not candidates:
            return False
        _, victim = min(candidates, key=lambda c: c[0])
        del self._idle[victim]
        host = self._served.pop(victim)
        self._hosts[host] -= 1
        if self._hosts[host] <= 0:
            self._hosts.pop(host, None)
        shutdown(victim)
        self.stats.idle_closed += 1
        return True

    def wait_request(self, sock: socket.socket, timeout_s: float) -> bool:
        """wait_readable for a served connection's next batch; meanwhile it counts as idle
        (closed first when a new peer needs its slot)."""
        with self._lock:
            self._idle[sock] = time.monotonic()
        try:
            return wait_readable(sock, timeout_s)
        finally:
            with self._lock:
                self._idle.pop(sock, None)

    def _run(self, sock: socket.socket, host: str, serve: ServeConn) -> None:
        served = False
        try:
            conn = self._handshake(sock, host)
            with self._lock:
                served = self._enter(sock, host)
            if served:
                serve(conn, host)
        except HandshakeError as exc:
            with self._lock:
                self.stats.handshakes_failed += 1
            logger.warning("dropping %s peer %s: %s", self.engine, host, exc)
        except ProtocolError as exc:
            logger.warning("dropping %s peer %s: %s", self.engine, host, exc)
        except OSError as exc:
            logger.debug("%s peer connection ended: %s", self.engine, exc)
        finally:
            with self._lock:
                self._peers.pop(sock, None)
                if served and self._served.pop(sock, None) is not None:  # not closed as idle
                    self._hosts[host] -= 1
                if self._hosts[host] <= 0:
                    self._hosts.pop(host, None)
            sock.close()

    def _handshake(self, sock: socket.socket, host: str) -> Conn:
        """The cluster-secret handshake, holding one of the handshake slots until it ends."""
        try:
            return self._authenticate(sock)
        finally:
            with self._lock:
                self._shaking_since.pop(sock, None)
                self._shaking[host] -= 1
                if not self._shaking[host]:
                    del self._shaking[host]

    def _authenticate(self, sock: socket.socket) -> Conn:
        secret = self.options.cluster_secret
        if secret is None:
            return Conn(sock)
        deadline = time.monotonic() + self.options.handshake_timeout_s
        try:
            return Conn(sock, server_handshake(sock, secret, deadline))
        except OSError as exc:  # silent, slow or gone before proving anything
            raise HandshakeError(f"no valid handshake: {exc!r}") from None

    def close(self) -> None:
        """Stop accepting, wake every serving thread and wait (briefly) for them. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            listener, self._listener = self._listener, None
            peers = dict(self._peers)
        for sock in [listener, *peers] if listener else list(peers):
            shutdown(sock)  # wakes the threads blocked on them; they close their own
        if listener is not None and self._acceptor is not None:
            deadline = time.monotonic() + _CLOSE_WAIT_S
            for thread in [self._acceptor, *peers.values()]:  # stop using the store's views
                thread.join(timeout=max(0.0, deadline - time.monotonic()))
            listener.close()


def dial(engine: str, address: str, options: LinkOptions, deadline: float) -> Conn:
    """A connection to `address`, authenticated when `options` carry a secret. TransferError
    if it cannot be reached by `deadline`; HandshakeError if it cannot prove the secret."""
    host, port = split_address(engine, address)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        tune(sock, options)  # before connect, so the window scale can use the buffers
        sock.settimeout(min(options.connect_timeout_s, remaining(deadline)))
        sock.connect((host, port))
        if options.cluster_secret is None:
            return Conn(sock)
        deadline = min(deadline, time.monotonic() + options.handshake_timeout_s)
        return Conn(sock, client_handshake(sock, options.cluster_secret, deadline))
    except (OSError, TransferError) as exc:
        sock.close()
        kind = HandshakeError if isinstance(exc, HandshakeError) else TransferError
        raise kind(f"cannot reach {engine} peer {address}: {exc!r}") from None


def tune(sock: socket.socket, options: LinkOptions) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if options.socket_buffer_bytes:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, options.socket_buffer_bytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, options.socket_buffer_bytes)


def wait_readable(sock: socket.socket, timeout_s: float | None) -> bool:
    """Whether `sock` has bytes (or EOF) to read within `timeout_s`; False: it idled out."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(None if timeout_s is None else timeout_s * 1000))


def is_quiet(sock: socket.socket) -> bool:
    """Whether an idle connection has nothing to read (a hung-up peer reads as EOF)."""
    return not wait_readable(sock, 0)


def split_address(engine: str, address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not host or not sep or not port.isdigit():
        raise ConfigError(f"a {engine} address is host:port, got {address!r}")
    return host.strip("[]"), int(port)


def shutdown(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):  # already disconnected
        sock.shutdown(socket.SHUT_RDWR)
