"""Length-prefixed protobuf messages over a stream socket (the node agent's unix socket, the
metadata service's lookup port).

Used by both ends of the agent's socket, the node agent's control server and the worker-side
client (which polls for its answer before sleeping: `spin_until_readable`), and by the lookup
port's client (`recv_answer`). A frame is a 4-byte little-endian length then the serialized
message. The reader is bounded: a frame larger than `max_bytes` is refused from its length
alone, its body is read as it arrives (a stalled frame costs only the bytes that came), and
with `frame_timeout_s` the whole frame must arrive within that time of its first byte.
"""

from __future__ import annotations

import select
import socket
import struct
import time
from typing import TypeVar

from google.protobuf.message import DecodeError, Message

from kvstore.errors import ConfigError, TransferError

MAX_FRAME_BYTES = 64 << 20
_READ_SLICE_BYTES = 1 << 20
_ANSWER_READ_BYTES = 1 << 16  # recv_answer's first read: a whole answer, in the common case
_LENGTH = struct.Struct("<I")
LENGTH_BYTES = _LENGTH.size  # the frame header
M = TypeVar("M", bound=Message)


class FrameTimeoutError(TransferError):
    """A frame began but did not complete within its deadline."""


def send_message(sock: socket.socket, message: Message) -> None:
    payload = message.SerializeToString()
    sock.sendall(_LENGTH.pack(len(payload)) + payload)


def recv_message(
    sock: socket.socket,
    message_type: type[M],
    max_bytes: int = MAX_FRAME_BYTES,
    frame_timeout_s: float | None = None,
) -> M | None:
    """The next message, or None when the peer closed the connection cleanly between frames.
    Waiting for a frame to begin is bounded by the socket's own timeout only."""
    head = sock.recv(_LENGTH.size)  # the whole length, in the common case, in one call
    if not head:
        return None
    deadline = None if frame_timeout_s is None else time.monotonic() + frame_timeout_s
    if len(head) < _LENGTH.size:
        head += _recv_exactly(sock, _LENGTH.size - len(head), deadline)
    (length,) = _LENGTH.unpack(head)
    if length > max_bytes:
        raise ConfigError(f"frame of {length} bytes exceeds the {max_bytes}-byte limit")
    return _parse(message_type, _recv_exactly(sock, length, deadline))


def recv_answer(
    sock: socket.socket, message_type: type[M], max_bytes: int, deadline: float
) -> M | None:
    """The answer to the one request outstanding on `sock` (the lookup port's client): one
    recv where it arrives whole, the common case, the rest by `deadline` (monotonic). None:
    the peer closed before answering. Bytes past the answer are the peer breaking the
    protocol, as nothing else was asked: TransferError."""
    data = sock.recv(_ANSWER_READ_BYTES)
    if not data:
        return None
    if len(data) < _LENGTH.size:
        data += _recv_exactly(sock, _LENGTH.size - len(data), deadline)
    (length,) = _LENGTH.unpack_from(data)
    if length > max_bytes:
        raise ConfigError(f"frame of {length} bytes exceeds the {max_bytes}-byte limit")
    end = _LENGTH.size + length
    if len(data) < end:
        data += _recv_exactly(sock, end - len(data), deadline)
    elif len(data) > end:
        raise TransferError(f"{len(data) - end} bytes past the answer: more than was asked")
    return _parse(message_type, memoryview(data)[_LENGTH.size :])


def spin_until_readable(poller: select.poll, spin_s: float) -> bool:
    """Poll, never sleeping, for up to `spin_s`: True once the polled socket is readable.

    A thread that sleeps through a wait of tens of microseconds pays a wakeup when the bytes
    arrive: another core must be interrupted and, on a VM whose idle vCPUs halt, the
    hypervisor must run it again, tens of microseconds each way. A caller that expects its
    answer that soon polls first, then reads as usual (sleeping, bounded by its timeout)."""
    end = time.perf_counter() + spin_s
    while not poller.poll(0):
        if time.perf_counter() >= end:
            return False
    return True


def _parse(message_type: type[M], body) -> M:
    try:
        return message_type.FromString(body)
    except DecodeError as exc:
        raise ConfigError(f"malformed {message_type.__name__}: {exc}") from None


def _recv_exactly(sock: socket.socket, size: int, deadline: float | None) -> bytes:
    """`size` bytes, gathered slice by slice so memory follows what actually arrived."""
    buffer = bytearray()
    while len(buffer) < size:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _incomplete(len(buffer), size)
            sock.settimeout(left)
        try:
            piece = sock.recv(min(size - len(buffer), _READ_SLICE_BYTES))
        except TimeoutError:
            raise _incomplete(len(buffer), size) from None
        if not piece:
            raise TransferError(f"connection closed mid-frame ({len(buffer)} of {size} bytes)")
        buffer += piece
    return bytes(buffer)


def _incomplete(received: int, size: int) -> FrameTimeoutError:
    return FrameTimeoutError(f"frame incomplete by its deadline ({received} of {size} bytes)")
