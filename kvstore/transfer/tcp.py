"""The `tcp` transfer engine: blocks stream over plain sockets, straight from and into pages.

Runs inside the node agent: the gate (gate.py: listener, connection caps, handshake) serves each
peer connection on its own thread; fetches reuse pooled connections per peer and `recv_into`
arena pages (no extra copy). The wire format lives in `tcp_wire.py`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvstore.errors import ConfigError, TransferError
from kvstore.keys import BlockKey
from kvstore.transfer.base import (
    OpenBlock,
    TransferEngine,
    TransferStats,
    check_checksums,
    check_fetch_pages,
    register_engine,
)
from kvstore.transfer.gate import Gate, LinkOptions, dial, is_quiet
from kvstore.transfer.pool import IdlePool
from kvstore.transfer.tcp_wire import (
    BATCH,
    FRAME,
    MAGIC,
    VERSION,
    Conn,
    HandshakeError,
    MacError,
    ProtocolError,
    pack_request,
    recv_frame,
    recv_request,
    recv_response_head,
    send_frame,
    send_parts,
)

__all__ = ["BATCH", "FRAME", "MAGIC", "VERSION", "ProtocolError", "TcpEngine", "TcpOptions"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TcpOptions(LinkOptions):
    """Settings of a TcpEngine; every field can be passed to make_engine("tcp", ...)."""

    max_batch_keys: int = 1 << 16

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_batch_keys <= 0:
            raise ConfigError(
                f"tcp engine: max_batch_keys must be positive, not {self.max_batch_keys}"
            )


@register_engine("tcp")
class TcpEngine(TransferEngine):
    """Serves and fetches whole blocks over TCP. Thread-safe; connections are never shared."""

    def __init__(self, **options: object) -> None:
        self.options = TcpOptions.make("tcp", options)
        self.stats = TransferStats()  # updated under the engine's lock
        self._lock = threading.Lock()
        self._pool: IdlePool[Conn] = IdlePool(
            self.options.pool_connections_per_peer,
            usable=lambda conn: is_quiet(conn.sock),  # readable while idle: the peer hung up
            drop=lambda conn: conn.sock.close(),
        )
        self._gate = Gate("tcp", self.options, self.stats, self._lock)
        self._serving = False
        self._closed = False

    # ---- serving -------------------------------------------------------------------------
    def serve(self, open_block: OpenBlock, host: str = "127.0.0.1", port: int = 0) -> str:
        with self._lock:
            if self._closed or self._serving:
                raise ConfigError("tcp engine is closed or already serving")
            self._serving = True
        address = self._gate.open(host, port, lambda conn, _: self._serve_peer(conn, open_block))
        logger.info("tcp engine serving at %s", address)
        return address

    def _serve_peer(self, conn: Conn, open_block: OpenBlock) -> None:
        """Answer the authenticated peer's batches until it hangs up, errs, idles out, misses
        a batch deadline or close() runs (the gate catches what ends it)."""
        sock = conn.sock
        while self._gate.wait_request(sock, self.options.idle_timeout_s):
            deadline = time.monotonic() + self.options.batch_deadline_s
            try:
                tenant, keys = recv_request(conn, self.options.max_batch_keys, deadline)
                send_parts(sock, [BATCH.pack(MAGIC, VERSION, 0, len(keys))], deadline)
                for key in keys:
                    _send_block(conn, open_block, tenant, key, deadline)
            except TimeoutError:
                with self._lock:
                    self.stats.batches_cut += 1
                raise
            with self._lock:
                self.stats.batches_served += 1

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
        buffers = _page_buffers(keys, pages, self.options.max_batch_keys)
        check_checksums("tcp", keys, checksums)
        request = pack_request(tenant, keys)  # ConfigError for a bad tenant, before any I/O
        if self._closed:
            raise TransferError("tcp engine is closed")
        landed = _Landed(keys, buffers, checksums)
        if not keys:
            return landed.received
        deadline = time.monotonic() + timeout_s
        conn = self._pool.take(address)
        if conn is None or not self._exchange(conn, address, request, landed, deadline):
            conn = self._dial(address, deadline)  # none pooled, or the peer had closed it
            self._exchange(conn, address, request, landed, deadline, False)
        return landed.received

    def _exchange(
        self,
        conn: Conn,
        address: str,
        request: bytes,
        landed: _Landed,
        deadline: float,
        reused: bool = True,
    ) -> bool:
        """One batch on `conn`, filling `landed` in order; any error drops `conn`. False
        only when a `reused` connection turns out closed by the peer before it answered."""
        keys = landed.keys
        answered = False
        try:
            send_parts(conn.sock, [request, conn.request_seal(request)], deadline)
            if recv_response_head(conn.sock, len(keys), deadline) != len(keys):
                raise ProtocolError(f"peer answered a batch of {len(keys)} keys with fewer")
            answered = True
            for index, (key, buffer) in enumerate(zip(keys, landed.buffers, strict=True)):
                landed.fill(index, *recv_frame(conn, key, buffer, deadline))
        except (OSError, TransferError) as exc:
            conn.sock.close()
            if reused and not answered and isinstance(exc, ConnectionError):
                return False
            logger.warning("tcp fetch of %d blocks from %s broke: %s", len(keys), address, exc)
            with self._lock:
                self.stats.transfers_broken += 1
                self.stats.macs_failed += isinstance(exc, MacError)
            return True
        self._pool.put(address, conn)
        return True

    def _dial(self, address: str, deadline: float) -> Conn:
        """A new connection to `address`, authenticated when the engine has a secret."""
        try:
            conn = dial("tcp", address, self.options, deadline)
        except HandshakeError:
            with self._lock:
                self.stats.handshakes_failed += 1
            raise
        with self._lock:
            self.stats.connections_opened += 1
        return conn

    # ---- lifecycle -----------------------------------------------------------------------
    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            idle = self._pool.drain()
        for conn in idle:
            conn.sock.close()
        self._gate.close()
        if self._serving:
            logger.info("tcp engine stopped serving")


# ---- wire helpers (module level: both sides use them, none touches engine state) -----------
class _Landed:
    """One fetch's pages and what arrived in them: bytes received and payload checksums."""

    def __init__(
        self, keys: Sequence[BlockKey], buffers: list[memoryview], checksums: list | None
    ) -> None:
        self.keys, self.buffers, self.checksums = keys, buffers, checksums
        self.received = [0] * len(keys)

    def fill(self, index: int, length: int, checksum: int | None) -> None:
        self.received[index] = length
        if self.checksums is not None:
            self.checksums[index] = checksum


def _page_buffers(
    keys: Sequence[BlockKey], pages: Sequence[torch.Tensor], max_batch_keys: int
) -> list[memoryview]:
    """Writable byte views of the pages; ConfigError for misuse (caught before any I/O)."""
    check_fetch_pages("tcp", keys, pages, max_batch_keys)
    return [memoryview(page.numpy()).cast("B") for page in pages]


def _send_block(
    conn: Conn, open_block: OpenBlock, tenant: str, key: BlockKey, deadline: float
) -> None:
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
