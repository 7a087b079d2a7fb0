"""One connection to the lookup port (lookup_port.py): its TLS, its hello, its answers in order.

Runs in the metadata service process, on the gRPC loop (an asyncio Protocol). A frame is a
4-byte little-endian length, then a message. The first frame is a LookupHello (framing version,
the instance id from Describe, bearer token), answered by a status; each later frame
is a LookupRequest, answered by a LookupStreamResponse. A connection is counted from its accept,
TLS handshake included, until its hello is accepted or it ends, and must say hello within
HELLO_TIMEOUT_S. Its answers run on the loop, at most FRAMES_PER_TURN and the port's turn
budget (lookup_port.py) before the loop's other callbacks get their turn, or, where the index's
reads block (Redis), are awaited one at a time (`LookupAccess.answer_later`) unless ready
without I/O (`answer_now`); reading stops while frames wait for their turn or an answer and
while the client leaves answers unread (the transport's flow control), so what it can make the
service hold is a read, a frame, an answer and a write buffer. A connection ended by the
service gets CLOSE_GRACE_S to take its last frames, then is cut.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import grpc

from kvstore.errors import ConfigError, KVStoreError, LeaseError
from kvstore.metadata import wire
from kvstore.metadata.server.auth import TenantScope
from kvstore.metadata.status import status_for
from kvstore.v1 import metadata_pb2 as pb

if TYPE_CHECKING:
    from kvstore.metadata.server.lookup_port import LookupPort

HELLO_TIMEOUT_S = 5.0  # from the accept (and the TLS handshake) to the hello's arrival
HELLO_MAX_BYTES = 4096
MAX_AWAITING_HELLO = 256  # connections not yet authenticated; more are cut unanswered
FRAMES_PER_TURN = 64  # answered before the loop's other callbacks run
CLOSE_GRACE_S = 5.0  # for a connection the service ended to take its last frames


_HELLO_ACCEPTED = wire.status_frame(grpc.StatusCode.OK.value[0])


class LookupConnection(asyncio.Protocol):
    def __init__(self, port: LookupPort) -> None:
        self.port = port
        self.transport: asyncio.Transport | None = None
        self.scope: TenantScope | None = None  # set by an accepted hello
        self.buffer = bytearray()
        self.last_request = 0.0
        self.ended = False
        self._awaiting_hello = False
        self._hello_timer: asyncio.TimerHandle | None = None
        self._handshaking = False
        self._reading = True
        self._write_blocked = False
        self._scheduled = False
        self._lost = False
        self._later: asyncio.Task | None = None  # an answer being awaited (answer_later)

    def connection_made(self, transport: asyncio.Transport) -> None:
        if self.transport is not None:  # start_tls's SSL transport: the connection goes on
            return
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
        if port.tls is not None:
            transport.pause_reading()  # the handshake's bytes are start_tls's
            self._handshaking = True
            port.loop.create_task(self._start_tls(transport))

    async def _start_tls(self, transport: asyncio.Transport) -> None:
        try:
            secure = await self.port.loop.start_tls(
                transport,
                self,
                self.port.tls,
                server_side=True,
                ssl_handshake_timeout=HELLO_TIMEOUT_S,
            )
        except BaseException as exc:  # a failed handshake, a timeout, the service stopping
            transport.abort()
            self.connection_lost(None)  # start_tls reports no loss of a connection never made
            if not isinstance(exc, Exception):
                raise
            return
        self._handshaking = False
        if secure is None or self.ended:  # None: the connection was lost as it completed
            transport.abort()
            self.connection_lost(None)
            return
        self.transport = secure
        if self.buffer:  # the hello, decrypted before this task resumed
            self._process()

    def data_received(self, data: bytes) -> None:
        if self.ended:
            return
        self.buffer += data
        if not self._scheduled and not self._handshaking:  # until then, self.transport is raw
            self._process()
        # frames wait for their turn or an answer: hold no more than a frame's worth
        elif not self._handshaking and len(self.buffer) > self.port.max_request_bytes:
            self._read(False)

    def _process(self) -> None:
        """Answer the complete frames, FRAMES_PER_TURN at a time and while the loop's turn
        has time for lookups (LookupPort.turn_left; the rest at a later turn); read on only
        when every frame is answered and the client takes its answers."""
        self._scheduled = False
        if self.ended or self._write_blocked:
            return  # resume_writing comes back here
        answers: list[bytes] = []
        while len(answers) < FRAMES_PER_TURN and self._has_frame() and self.port.turn_left():
            if (payload := self._next_payload(answers)) is None:
                break  # over its limit: the connection is ending
            if self.scope is None:
                if not self._hello(payload[0], answers):
                    return
            elif self.port.access.answer_later is not None:
                ready = self.port.access.answer_ready(payload[0], self.scope)
                if ready is None:
                    self._answer_later(payload[0], answers)
                    return
                answers.append(wire.frame(ready))
            else:
                answers.append(wire.frame(self.port.access.answer(payload[0], self.scope)))
        if self.ended:
            return
        if self.scope is not None:
            self.last_request = self.port.loop.time()
        if answers:
            self.transport.write(b"".join(answers))  # may block writes (pause_writing)
        if not self._has_frame():
            self._read(not self._write_blocked)
            return
        self._read(False)  # frames left for a later turn (FRAMES_PER_TURN, or its time spent)
        if not self._write_blocked:
            self._scheduled = True
            self.port.wait_turn(self)

    def take_turn(self) -> None:
        """Answer on from where the last turn left off (LookupPort.wait_turn)."""
        self._process()

    def _has_frame(self) -> bool:
        """Whether the buffer holds a whole frame (or one's length over the limit)."""
        if len(self.buffer) < wire.LENGTH.size:
            return False
        (length,) = wire.LENGTH.unpack_from(self.buffer)
        limit = HELLO_MAX_BYTES if self.scope is None else self.port.max_request_bytes
        return len(self.buffer) >= wire.LENGTH.size + length or length > limit

    def _answer_later(self, payload: bytes, answers: list[bytes]) -> None:
        """Send the answers so far, await this one; nothing more is answered until it is
        sent (`_answered_later` goes on from there), nor read past a frame's worth."""
        self.last_request = self.port.loop.time()
        if answers:
            self.transport.write(b"".join(answers))
        self._scheduled = True
        if len(self.buffer) > self.port.max_request_bytes:
            self._read(False)
        self._later = self.port.loop.create_task(self._answered_later(payload))

    async def _answered_later(self, payload: bytes) -> None:
        try:
            answer = await self.port.access.answer_later(payload, self.scope)
        finally:
            self._later = None
            self._scheduled = False
        if self.ended:  # the client left, or the service is stopping
            return
        self.last_request = self.port.loop.time()
        self.transport.write(wire.frame(answer))
        self._process()

    @property
    def answering(self) -> bool:
        """Whether an answer is being awaited (the connection is not idle meanwhile)."""
        return self._later is not None

    def _next_payload(self, answers: list[bytes]) -> tuple[bytes] | None:
        """The next complete frame's message, as a 1-tuple (an empty message is a frame
        too); None: none yet, or the frame is over its limit and the connection is ending."""
        if len(self.buffer) < wire.LENGTH.size:
            return None
        (length,) = wire.LENGTH.unpack_from(self.buffer)
        limit = HELLO_MAX_BYTES if self.scope is None else self.port.max_request_bytes
        if length > limit:
            what = "LookupHello" if self.scope is None else "LookupRequest"
            message = f"a {what} frame of {length} bytes is over the {limit}-byte limit"
            self.end(answers, grpc.StatusCode.INVALID_ARGUMENT, message)
            return None
        end = wire.LENGTH.size + length
        if len(self.buffer) < end:
            return None
        payload = bytes(self.buffer[wire.LENGTH.size : end])
        del self.buffer[:end]
        return (payload,)

    def _hello(self, payload: bytes, answers: list[bytes]) -> bool:
        """Authenticate, take a slot; False: refused (the connection is ending), or its token
        is under review (`_hello_reviewed` goes on from there)."""
        try:
            hello = wire.parse(pb.LookupHello, payload)
            if hello.version != (ours := wire.LOOKUP_FRAMING_VERSION):
                message = f"LookupHello version {hello.version} is not the service's ({ours})"
                raise ConfigError(f"{message}; the first frame must be a LookupHello")
            if not self.port.accepts(hello.instance):
                raise LeaseError(
                    "this lookup port is another service instance's than the one "
                    "described; ask Describe again"
                )
            token = hello.token.encode()
            scope = self.port.access.auth.scope_now(token)
            if scope is None:  # an agent token to review: nothing more is read until it ends
                self._scheduled = True
                self._read(False)
                self.port.loop.create_task(self._hello_reviewed(token))
                return False
            self._accept(scope, answers)
        except KVStoreError as exc:
            self.end(answers, status_for(exc), str(exc))
            return False
        return True

    async def _hello_reviewed(self, token: bytes) -> None:
        """The rest of a hello whose token needed a review (auth.py): accepted, then the
        frames that came after it answered; or refused."""
        answers: list[bytes] = []
        try:
            scope = await self.port.access.auth.authorize_token(token)
            if self.ended:  # the hello's time ran out, or the client left, meanwhile
                return
            self._accept(scope, answers)
        except KVStoreError as exc:
            self.end(answers, status_for(exc), str(exc))
            return
        finally:
            self._scheduled = False
        self.transport.write(b"".join(answers))
        self._process()

    def _accept(self, scope: TenantScope, answers: list[bytes]) -> None:
        """Take a slot of the hello's scope (CapacityError at the cap) and say so."""
        self.port.access.slots.acquire(scope.tenant)
        self.scope = scope
        self._stop_awaiting_hello()
        self.port.count_connection(grpc.StatusCode.OK)
        answers.append(_HELLO_ACCEPTED)

    def _hello_late(self) -> None:
        if self._handshaking:  # no TLS yet to send a status over
            self.port.count_connection(grpc.StatusCode.DEADLINE_EXCEEDED)
            self.ended = True
            self.transport.abort()
            return
        message = f"no LookupHello within {HELLO_TIMEOUT_S:g} s of connecting"
        self.end([], grpc.StatusCode.DEADLINE_EXCEEDED, message)

    def end(self, answers: list[bytes], code: grpc.StatusCode, message: str) -> None:
        """Send the answers so far and the status the connection ends with, then close; cut
        it after CLOSE_GRACE_S where the client leaves them unread."""
        if self.ended:
            return
        if self.scope is None:
            self.port.count_connection(code)
        self.ended = True
        self.transport.write(b"".join(answers) + wire.status_frame(code.value[0], message))
        self.transport.close()
        self.port.loop.call_later(CLOSE_GRACE_S, self.transport.abort)

    def close_idle(self) -> None:
        """Close without a frame (the client waits for none: one would be read as its next
        lookup's answer); it opens another connection at its next lookup."""
        self.ended = True
        if self.transport.get_write_buffer_size():
            self.transport.abort()  # answers it never read: it is not idle, it is stuck
        else:
            self.transport.close()

    def _read(self, on: bool) -> None:
        if on != self._reading and not self.transport.is_closing():
            self._reading = on
            (self.transport.resume_reading if on else self.transport.pause_reading)()

    def pause_writing(self) -> None:  # the client leaves its answers unread
        self._write_blocked = True
        self._read(False)

    def resume_writing(self) -> None:
        self._write_blocked = False
        if not self._scheduled:
            self._process()

    def _stop_awaiting_hello(self) -> None:
        if self._awaiting_hello:
            self._awaiting_hello = False
            self.port.awaiting_hello -= 1
        if self._hello_timer is not None:
            self._hello_timer.cancel()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._lost:
            return
        self._lost = True
        self.ended = True
        if self._later is not None:
            self._later.cancel()
        self._stop_awaiting_hello()
        self.port.connections.discard(self)
        if self.scope is not None:
            self.port.access.slots.release(self.scope.tenant)
