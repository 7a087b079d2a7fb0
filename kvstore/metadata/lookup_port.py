"""The lookup port: Lookups as length-prefixed frames on a plain TCP (or TLS) connection.

Runs in the metadata service process, on the gRPC loop (an asyncio Protocol per connection). A
lookup on a LookupStream pays gRPC's machinery for each message in both processes (HTTP/2
frames, completion queues, a thread handoff each way); here it pays a read, the answer
(`MetadataServicer.answer_lookup`, the same code and metrics as gRPC's) and a write:
`kvstore bench lookup` prints both beside the machine's raw TCP round trip. The trust is the
gRPC port's: TLS with the same certificates and client CA, the same bearer tokens (sent in the
connection's first frame, a LookupHello), and the same slots as LookupStream calls.

Bounded: a frame by its size (a hello by HELLO_MAX_BYTES, a request by `max_request_bytes`);
connections still to say hello by MAX_AWAITING_HELLO and HELLO_TIMEOUT_S; the others by their
scope's slots and `idle_s` without a request; and a connection whose answers go unread is no
longer read (transport flow control). Offered only where the index's reads never block (in
memory and LMDB): the answers run on the loop.
"""

from __future__ import annotations

import asyncio
import ssl
import struct
from collections.abc import Callable

import grpc
from google.protobuf.message import Message

from kvstore.errors import ConfigError, KVStoreError
from kvstore.metadata import wire
from kvstore.metadata.auth import TenantScope, TokenAuth
from kvstore.metadata.slots import StreamSlots
from kvstore.metadata.status import status_for
from kvstore.v1 import metadata_pb2 as pb

HELLO_TIMEOUT_S = 5.0  # from connecting to the hello's arrival
HELLO_MAX_BYTES = 4096
VERSION = 1  # LookupHello.version: of the framing and the messages framed
MAX_AWAITING_HELLO = 256  # connections not yet authenticated; more are dropped unanswered
LENGTH = struct.Struct("<I")  # the frame header: the message's length, little-endian
REQUEST_OVERHEAD_BYTES = 1024  # a LookupRequest's fields besides its keys (names are short)
Answer = Callable[[bytes, TenantScope], pb.LookupStreamResponse]


def listen_address(lookup_listen: str, grpc_listen: str, grpc_port: int) -> tuple[str, int] | None:
    """Where the lookup port listens: `lookup_listen` as HOST:PORT; "auto", the gRPC port + 1
    on the gRPC host (any free port where gRPC's was chosen by the system); "off": None."""
    if lookup_listen == "off":
        return None
    if lookup_listen == "auto":
        host, _, port = grpc_listen.rpartition(":")
        chosen = int(port) if port.isdigit() else 0
        return host.strip("[]"), grpc_port + 1 if chosen else 0
    host, _, port = lookup_listen.rpartition(":")
    if not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"lookup_listen {lookup_listen!r}: use HOST:PORT, 'auto' or 'off'")
    return host.strip("[]"), int(port)


def max_request_bytes(max_keys: int) -> int:
    """The largest LookupRequest frame of `max_keys` keys (each a tag, a length, the key)."""
    return max_keys * (wire.KEY_BYTES + 2) + REQUEST_OVERHEAD_BYTES


def frame(message: Message) -> bytes:
    payload = message.SerializeToString()
    return LENGTH.pack(len(payload)) + payload


def _status_frame(code: grpc.StatusCode, message: str = "") -> bytes:
    return frame(pb.LookupStreamResponse(status_code=code.value[0], status_message=message))


_HELLO_ACCEPTED = _status_frame(grpc.StatusCode.OK)


class LookupPort:
    def __init__(
        self, auth: TokenAuth, slots: StreamSlots, answer: Answer,
        count_connection: Callable[[grpc.StatusCode], None], idle_s: float,
        max_request_bytes: int,
    ) -> None:  # fmt: skip
        """`answer`: one serialized LookupRequest's answer, a failure inside it (never raises);
        `count_connection`: counts a connection by the status its hello got."""
        self.auth = auth
        self.slots = slots
        self.answer = answer
        self.count_connection = count_connection
        self.idle_s = idle_s
        self.max_request_bytes = max_request_bytes
        self.connections: set[_Connection] = set()
        self.awaiting_hello = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._sweep_handle: asyncio.TimerHandle | None = None

    async def start(self, host: str, port: int, tls: ssl.SSLContext | None) -> int:
        """Listen (on the running loop); returns the bound port."""
        self.loop = asyncio.get_running_loop()
        self._server = await self.loop.create_server(
            lambda: _Connection(self), host, port, ssl=tls, reuse_address=True
        )
        self._sweep_handle = self.loop.call_later(self.idle_s / 4, self._sweep)
        return self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._sweep_handle is not None:
            self._sweep_handle.cancel()
        if self._server is not None:
            self._server.close()
        for connection in list(self.connections):
            connection.transport.abort()

    def _sweep(self) -> None:
        """Closes connections idle for over `idle_s` (every quarter of it), without a frame
        (their clients wait for none: one would be read as the next lookup's answer); the
        clients open another at their next lookup."""
        now = self.loop.time()
        for connection in list(self.connections):
            if connection.scope is not None and now - connection.last_request > self.idle_s:
                connection.ended = True
                connection.transport.close()
        self._sweep_handle = self.loop.call_later(self.idle_s / 4, self._sweep)


class _Connection(asyncio.Protocol):
    """One client connection: its hello, then its requests answered in order."""

    def __init__(self, port: LookupPort) -> None:
        self.port = port
        self.transport: asyncio.Transport | None = None
        self.scope: TenantScope | None = None  # set by an accepted hello
        self.buffer = bytearray()
        self.last_request = 0.0
        self.ended = False
        self._awaiting_hello = False
        self._hello_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        port = self.port
        if port.awaiting_hello >= MAX_AWAITING_HELLO:
            port.count_connection(grpc.StatusCode.RESOURCE_EXHAUSTED)
            self.ended = True
            transport.abort()  # a flood of silent connections gets no bytes back
            return
        port.awaiting_hello += 1
        self._awaiting_hello = True
        port.connections.add(self)
        self._hello_timer = port.loop.call_later(HELLO_TIMEOUT_S, self._hello_late)

    def data_received(self, data: bytes) -> None:
        if self.ended:
            return
        self.buffer += data
        answers: list[bytes] = []
        while len(self.buffer) >= LENGTH.size:
            (length,) = LENGTH.unpack_from(self.buffer)
            limit = HELLO_MAX_BYTES if self.scope is None else self.port.max_request_bytes
            if length > limit:
                message = f"a frame of {length} bytes is over the {limit}-byte limit"
                self.end(answers, grpc.StatusCode.RESOURCE_EXHAUSTED, message)
                return
            end = LENGTH.size + length
            if len(self.buffer) < end:
                break
            payload = bytes(self.buffer[LENGTH.size : end])
            del self.buffer[:end]
            if self.scope is not None:
                answers.append(frame(self.port.answer(payload, self.scope)))
            elif not self._hello(payload, answers):
                return
        if self.scope is not None:
            self.last_request = self.port.loop.time()
        if answers:
            self.transport.write(b"".join(answers))

    def _hello(self, payload: bytes, answers: list[bytes]) -> bool:
        """Authenticate, take a slot; False: refused (the connection is ending)."""
        try:
            hello = wire.parse(pb.LookupHello, payload)
            if hello.version != VERSION:
                message = f"LookupHello version {hello.version} is not the service's ({VERSION})"
                raise ConfigError(f"{message}; the first frame must be a LookupHello")
            scope = self.port.auth.authorize_token(hello.token.encode())
            self.port.slots.acquire(scope.tenant)
        except KVStoreError as exc:
            self.end(answers, status_for(exc), str(exc))
            return False
        self.scope = scope
        self._stop_awaiting_hello()
        self.port.count_connection(grpc.StatusCode.OK)
        answers.append(_HELLO_ACCEPTED)
        return True

    def _hello_late(self) -> None:
        message = f"no LookupHello within {HELLO_TIMEOUT_S:g} s of connecting"
        self.end([], grpc.StatusCode.DEADLINE_EXCEEDED, message)

    def end(self, answers: list[bytes], code: grpc.StatusCode, message: str) -> None:
        """Send the answers so far and the status the connection ends with, then close."""
        if self.ended:
            return
        if self.scope is None:
            self.port.count_connection(code)
        self.ended = True
        self.transport.write(b"".join(answers) + _status_frame(code, message))
        self.transport.close()  # after the buffered bytes are sent

    def _stop_awaiting_hello(self) -> None:
        if self._awaiting_hello:
            self._awaiting_hello = False
            self.port.awaiting_hello -= 1
        if self._hello_timer is not None:
            self._hello_timer.cancel()

    def pause_writing(self) -> None:  # the client is not reading its answers: stop reading
        self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_awaiting_hello()
        self.port.connections.discard(self)
        if self.scope is not None:
            self.port.slots.release(self.scope.tenant)
            self.scope = None
        self.ended = True
