"""The lookup port: Lookups as length-prefixed frames on a plain TCP (or TLS) connection.

Runs in the metadata service process, on the gRPC loop: a listener, and a LookupConnection
(lookup_connection.py) per connection. A lookup on a LookupStream pays gRPC's machinery for each
message in both processes (HTTP/2 frames, completion queues, a thread handoff each way); here it
pays a read, the answer (`MetadataServicer.answer_lookup`, the same code and metrics as gRPC's;
where the index's reads block, `answer_lookup_later`: Redis answers it on the loop) and a
write: `kvstore bench lookup` prints both beside the machine's raw TCP round trip. The
trust is the gRPC port's: TLS with the same certificates and client CA, the same bearer tokens
(sent in the connection's first frame, a LookupHello), and the same slots as LookupStream calls.
Clients learn the port and the instance id from Describe; a hello must carry the id, so a client
cannot be sent to another service's port (a forwarded or reused port). The id is the index's
(`MetadataIndex.index_id`), not the process's: replicas over one Redis index share it, so a client
that asked one replica behind a Service may be answered on another's port, and the check still
refuses any other index's service; an embedded index's id is its process's own.

Fair: the answers of one turn of the loop stop after TURN_BUDGET_S (its first always runs), and
connections with frames left answer on at the next turn in the order they stopped, before new
ones, so gRPC's callbacks (heartbeats) never wait behind more than that and a connection with
many frames never starves the others.

Bounded: connections by their scope's slots, or, until their hello, by MAX_AWAITING_HELLO and
HELLO_TIMEOUT_S; each by its frame limit, its buffers and its one awaited answer
(lookup_connection.py); an idle one is closed after `idle_s`. Offered on every backend: the
answers run on the loop where the index's reads never block (in memory and LMDB), else are
awaited there (the Redis indexes' pipelined lookups; an index without them: its reads in the
unary pool).
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import ssl
import time
from collections.abc import Callable

import grpc

from kvstore.errors import ConfigError
from kvstore.metadata import wire
from kvstore.metadata.server.lookup_access import LookupAccess
from kvstore.metadata.server.lookup_connection import LookupConnection
from kvstore.metadata.server.slots import StreamSlots

TURN_BUDGET_S = 0.002  # lookups answered in one turn of the loop, every connection's together
REQUEST_OVERHEAD_BYTES = 1024  # a LookupRequest's fields besides its keys (names are short)
WILDCARD_HOSTS = ("", "0.0.0.0", "::")  # every address, of both families where the port is fixed


def listen_address(lookup_listen: str, grpc_listen: str) -> tuple[str, int] | None:
    """Where the lookup port listens: `lookup_listen` as HOST:PORT; "auto", the gRPC port + 1
    on the gRPC host (any free port where gRPC's is chosen by the system); "off": None."""
    if lookup_listen == "off":
        return None
    host, _, port = (grpc_listen if lookup_listen == "auto" else lookup_listen).rpartition(":")
    if not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"lookup_listen {lookup_listen!r}: use HOST:PORT, 'auto' or 'off'")
    if lookup_listen == "auto":
        if int(port) >= 65535:
            raise ConfigError("lookup_listen 'auto' is the gRPC port + 1, past 65535: set one")
        return host.strip("[]"), int(port) + 1 if int(port) else 0
    return host.strip("[]"), int(port)


def max_request_bytes(max_keys: int) -> int:
    """The largest LookupRequest frame of `max_keys` keys (each a tag, a length, the key)."""
    return max_keys * (wire.KEY_BYTES + 2) + REQUEST_OVERHEAD_BYTES


class LookupPort:
    def __init__(
        self,
        access: LookupAccess,
        count_connection: Callable[[grpc.StatusCode], None],
        max_request_bytes: int,
    ) -> None:
        """`count_connection`: counts a connection by the status its hello got."""
        self.access = access
        self.count_connection = count_connection
        self.max_request_bytes = max_request_bytes
        self.instance = b""  # DescribeResponse.instance (adopt)
        self.accepted: tuple[bytes, ...] = ()  # hellos' instances taken: it and its predecessor
        self.connections: set[LookupConnection] = set()
        self.awaiting_hello = 0
        self.tls: ssl.SSLContext | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._sweep_handle: asyncio.TimerHandle | None = None
        self._turn_started: float | None = None  # the first answer of this turn of the loop
        self._waiting: collections.deque[LookupConnection] = collections.deque()

    def turn_left(self) -> bool:
        """Whether this turn of the loop may answer another lookup: its first always, then
        until TURN_BUDGET_S of answers, so the loop's other callbacks (gRPC's: heartbeats)
        wait for at most that, however many connections have frames."""
        now = time.perf_counter()
        if self._turn_started is None:
            self._turn_started = now
            self.loop.call_soon(self._next_turn)  # the next turn's first callback
            return True
        return now - self._turn_started < TURN_BUDGET_S

    def wait_turn(self, connection: LookupConnection) -> None:
        """`connection` has frames left: it answers on at the next turn, after those that
        waited before it."""
        self._waiting.append(connection)
        if self._turn_started is None:
            self._turn_started = time.perf_counter()
            self.loop.call_soon(self._next_turn)

    def _next_turn(self) -> None:
        self._turn_started = None
        waiting, self._waiting = self._waiting, collections.deque()
        for connection in waiting:
            connection.take_turn()

    def adopt(self, instance: bytes) -> None:
        """Describe `instance` from now on (the index's id, read at start and re-read while
        the service runs); a hello carrying the one it replaces is still taken, so clients
        that asked before a change are not refused while the replicas converge."""
        if instance != self.instance:
            self.accepted = (instance, self.instance) if self.instance else (instance,)
            self.instance = instance

    def accepts(self, instance: bytes) -> bool:
        """Whether a hello carrying `instance` was meant for this index's services."""
        return any(hmac.compare_digest(instance, ours) for ours in self.accepted)

    @property
    def slots(self) -> StreamSlots:
        return self.access.slots

    async def start(self, host: str, port: int, tls: ssl.SSLContext | None) -> int:
        """Listen (on the running loop); returns the bound port. TLS is started by each
        connection itself, so the handshake counts against its hello's bounds."""
        self.loop = asyncio.get_running_loop()
        self.tls = tls
        every_address = host in WILDCARD_HOSTS and port != 0  # IPv4 and IPv6, as gRPC does
        self._server = await self.loop.create_server(
            lambda: LookupConnection(self),
            None if every_address else host,
            port,
            reuse_address=True,
        )
        self._sweep_handle = self.loop.call_later(self.access.idle_s / 4, self._sweep)
        return self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._sweep_handle is not None:
            self._sweep_handle.cancel()
        if self._server is not None:
            self._server.close()
        for connection in list(self.connections):
            connection.ended = True
            connection.transport.abort()

    def _sweep(self) -> None:
        """Closes connections idle for over `idle_s` (every quarter of it)."""
        now, idle_s = self.loop.time(), self.access.idle_s
        for connection in list(self.connections):
            idle = connection.scope is not None and now - connection.last_request > idle_s
            if idle and not connection.ended and not connection.answering:
                connection.close_idle()
        self._sweep_handle = self.loop.call_later(idle_s / 4, self._sweep)
