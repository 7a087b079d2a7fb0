"""How the client reads the lookup port's answers (lookup_sockets._Connection): an answer that
arrives in pieces is read whole; one still incomplete at the deadline is a deadline error; bytes
past the answer (more than was asked) drop the connection and the lookup is asked over gRPC.
The port here is a scripted socket; the gRPC side is a real metadata service."""

import socket
import struct
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager, suppress

import pytest

from kvstore.errors import UnavailableError
from kvstore.metadata.client import lookup_sockets
from kvstore.v1 import metadata_pb2 as pb
from tests.metadata.servers import LOOKUP_KEYS, calls, client_for, running_server

LENGTH = struct.Struct("<I")
HELD = pb.LookupResponse(
    prefix_length=1,
    nodes=[pb.NodeAddress(node_id="n1", tcp_address="127.0.0.1:1")],
    holder_counts=[1],
    holder_nodes=[0],
    holder_tiers=[pb.TIER_HOST],
)


def framed(message) -> bytes:
    payload = message.SerializeToString()
    return LENGTH.pack(len(payload)) + payload


@contextmanager
def scripted_port(monkeypatch, after_hello: Callable[[socket.socket], None]):
    """A listener the client is described to: it answers the hello, reads one request, then
    runs `after_hello` on the connection (which the client may close meanwhile)."""
    listener = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def serve() -> None:
        sock, _ = listener.accept()
        with sock, suppress(OSError):
            sock.recv(4096)  # the hello
            sock.sendall(framed(pb.LookupStreamResponse()))
            sock.recv(65536)  # the request
            after_hello(sock)
            done.wait(5)  # the connection stays open while the client reads

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    described = pb.DescribeResponse(lookup_port=listener.getsockname()[1], instance=b"x")
    monkeypatch.setattr(lookup_sockets.LookupSockets, "_describe", lambda self, d: described)
    try:
        yield
    finally:
        done.set()
        thread.join(5)
        listener.close()


def test_an_answer_in_pieces_is_read_whole(tmp_path, monkeypatch):
    answer = framed(pb.LookupStreamResponse(response=HELD))

    def trickle(sock: socket.socket) -> None:
        for piece in (answer[:2], answer[2:6], answer[6:9], answer[9:]):
            sock.sendall(piece)
            time.sleep(0.05)

    with scripted_port(monkeypatch, trickle), running_server(tmp_path) as server:
        with client_for(server) as client:
            result = client.lookup("t", LOOKUP_KEYS[:1], timeout_s=2.0)
            assert result.prefix_length == 1
            assert result.holders[0][0].node_id == "n1"
            assert calls(server, "Lookup") == 0  # answered on the port


def test_an_answer_incomplete_at_the_deadline_is_a_deadline_error(tmp_path, monkeypatch):
    answer = framed(pb.LookupStreamResponse(response=HELD))

    def byte_by_byte(sock: socket.socket) -> None:  # each byte in time, the whole too late
        for index in range(len(answer) - 1):
            sock.sendall(answer[index : index + 1])
            time.sleep(0.1)

    with scripted_port(monkeypatch, byte_by_byte), running_server(tmp_path) as server:
        with client_for(server) as client:
            started = time.monotonic()
            with pytest.raises(UnavailableError, match="DEADLINE_EXCEEDED"):
                client.lookup("t", LOOKUP_KEYS[:1], timeout_s=0.5)
            assert time.monotonic() - started < 1.0


def test_bytes_past_the_answer_drop_the_connection_and_grpc_answers(tmp_path, monkeypatch):
    answer = framed(pb.LookupStreamResponse(response=HELD))

    def answer_twice(sock: socket.socket) -> None:
        sock.sendall(answer + answer)

    with scripted_port(monkeypatch, answer_twice), running_server(tmp_path) as server:
        with client_for(server) as client:
            result = client.lookup("t", LOOKUP_KEYS[:1], timeout_s=2.0)
            assert result.prefix_length == 0  # the real service's answer: nothing published
            assert calls(server, "Lookup") == 1
