"""Length-prefixed protobuf messages over a stream socket (the node agent's unix socket).

Used by both ends: the node agent's control server and the worker-side client. A frame is a
4-byte little-endian length then the serialized message; oversized frames are refused.
"""

from __future__ import annotations

import socket
import struct
from typing import TypeVar

from google.protobuf.message import DecodeError, Message

from kvstore.errors import ConfigError, TransferError

MAX_FRAME_BYTES = 64 << 20
_LENGTH = struct.Struct("<I")
M = TypeVar("M", bound=Message)


def send_message(sock: socket.socket, message: Message) -> None:
    payload = message.SerializeToString()
    sock.sendall(_LENGTH.pack(len(payload)) + payload)


def recv_message(sock: socket.socket, message_type: type[M]) -> M | None:
    """The next message, or None when the peer closed the connection cleanly between frames."""
    head = _recv_exactly(sock, _LENGTH.size, allow_eof=True)
    if head is None:
        return None
    (length,) = _LENGTH.unpack(head)
    if length > MAX_FRAME_BYTES:
        raise ConfigError(f"frame of {length} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    body = _recv_exactly(sock, length, allow_eof=False)
    try:
        return message_type.FromString(body)
    except DecodeError as exc:
        raise ConfigError(f"malformed {message_type.__name__}: {exc}") from None


def _recv_exactly(sock: socket.socket, size: int, allow_eof: bool) -> bytes | None:
    buffer = bytearray(size)
    view = memoryview(buffer)
    received = 0
    while received < size:
        count = sock.recv_into(view[received:])
        if count == 0:
            if allow_eof and received == 0:
                return None
            raise TransferError(f"connection closed mid-frame ({received} of {size} bytes)")
        received += count
    return bytes(buffer)
