"""The lookup port on a real metadata service: the client's lookups ride it and answer as gRPC's
do; bad frames, bad tokens, silent and idle connections get their status and cost nothing else;
connections are bounded; a late answer is a deadline error; TLS; where the service has no port,
the client asks over gRPC."""

import socket
import struct
import threading
import time

import pytest

from kvstore.errors import AuthError, ConfigError, PermissionDeniedError, UnavailableError
from kvstore.metadata.client import MetadataClient, lookup_sockets
from kvstore.metadata.client.lookup_sockets import grpc_host
from kvstore.metadata.index.memory import MemoryIndex
from kvstore.metadata.server import lookup_connection
from kvstore.metadata.server.lookup_port import listen_address
from kvstore.metadata.server.server import MetadataConfig, MetadataServer
from kvstore.metadata.server.service import ServiceLimits
from kvstore.v1 import metadata_pb2 as pb
from tests.metadata.servers import (
    ADMIN,
    ALICE,
    FAST_LIMITS,
    LOOKUP_KEYS,
    calls,
    client_for,
    publish,
    running_server,
)
from tests.sockets import listening_sockets

KEYS = LOOKUP_KEYS

LENGTH = struct.Struct("<I")
OK, INVALID_ARGUMENT, DEADLINE_EXCEEDED, PERMISSION_DENIED = 0, 3, 4, 7
FAILED_PRECONDITION = 9
RESOURCE_EXHAUSTED, UNAUTHENTICATED = 8, 16


def connect(server: MetadataServer) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.servicer.lookup_port), timeout=5)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def send(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(LENGTH.pack(len(payload)) + payload)


def answer(sock: socket.socket) -> pb.LookupStreamResponse:
    head = recv_exactly(sock, LENGTH.size)
    return pb.LookupStreamResponse.FromString(recv_exactly(sock, LENGTH.unpack(head)[0]))


def recv_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        piece = sock.recv(size - len(data))
        assert piece, f"the connection ended after {len(data)} of {size} bytes"
        data += piece
    return data


def ended(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def hello(sock: socket.socket, server: MetadataServer, token: str = "") -> pb.LookupStreamResponse:
    instance = server.lookup_port.instance
    send(sock, pb.LookupHello(token=token, version=1, instance=instance).SerializeToString())
    return answer(sock)


def test_lookups_ride_the_lookup_port_and_answer_as_grpc_does(tmp_path):
    with running_server(tmp_path) as server, client_for(server) as client:
        assert server.servicer.lookup_port > 0
        publish(client)
        with client_for(server, lookup_port=False, lookup_streams=False) as unary:
            expected = unary.lookup("t", KEYS, caller_node_id="me")
        for _ in range(20):
            assert client.lookup("t", KEYS, caller_node_id="me") == expected
        assert expected.prefix_length == 5
        assert expected.addresses == {"holder": ("10.0.0.1:1", "")}
        assert calls(server, "LookupPort") == 1  # one connection carried the 20 lookups
        assert calls(server, "LookupStream") == 0
        assert calls(server, "Lookup") == 21  # each lookup counted as one, either way


def test_a_bad_request_fails_its_lookup_only_and_the_connection_stays_open(tmp_path):
    token_file = tmp_path / "tokens"
    token_file.write_text(f"{ADMIN} *\n{ALICE} alice\n")
    with running_server(tmp_path, token_file=token_file) as server:
        with client_for(server, token=ADMIN) as admin:
            publish(admin, "alice")
        with client_for(server, token=ALICE) as alice:
            assert alice.lookup("alice", KEYS).prefix_length == 5
            with pytest.raises(ConfigError, match=r"INVALID_ARGUMENT: .*16 bytes"):
                alice.lookup("alice", [b"short"])
            with pytest.raises(PermissionDeniedError, match="only act for tenant 'alice'"):
                alice.lookup("bob", KEYS)
            assert alice.lookup("alice", KEYS).prefix_length == 5
        assert calls(server, "LookupPort") == 1
        assert calls(server, "LookupStream") == 0
        assert calls(server, "Lookup", "INVALID_ARGUMENT") == 1
        assert calls(server, "Lookup", "PERMISSION_DENIED") == 1


def test_a_malformed_frame_is_answered_with_invalid_argument_on_the_same_connection(tmp_path):
    with running_server(tmp_path) as server, client_for(server) as client:
        publish(client)
        with connect(server) as sock:
            assert hello(sock, server).status_code == OK
            send(sock, b"\xff\xff\xff")
            bad = answer(sock)
            assert bad.status_code == INVALID_ARGUMENT
            assert "malformed LookupRequest" in bad.status_message
            send(sock, pb.LookupRequest(tenant="t", keys=KEYS).SerializeToString())
            assert answer(sock).response.prefix_length == 5


def test_pipelined_requests_are_answered_in_order(tmp_path):
    with running_server(tmp_path) as server, client_for(server) as client:
        publish(client)
        with connect(server) as sock:
            assert hello(sock, server).status_code == OK
            frames = b"".join(
                LENGTH.pack(len(p)) + p
                for n in range(1, 9)
                for p in [pb.LookupRequest(tenant="t", keys=KEYS[:n]).SerializeToString()]
            )
            sock.sendall(frames)  # eight requests in one write
            assert [answer(sock).response.prefix_length for _ in range(8)] == [
                1,
                2,
                3,
                4,
                5,
                5,
                5,
                5,
            ]


def test_an_oversized_frame_ends_its_connection_with_its_status_and_nothing_else(tmp_path):
    with running_server(tmp_path) as server, client_for(server) as client:
        publish(client)
        limit = server.lookup_port.max_request_bytes
        with connect(server) as sock:
            assert hello(sock, server).status_code == OK
            sock.sendall(LENGTH.pack(limit + 1))
            refused = answer(sock)
            assert refused.status_code == INVALID_ARGUMENT
            assert f"LookupRequest frame of {limit + 1} bytes is over the {limit}-byte limit" in (
                refused.status_message
            )
            assert ended(sock)
        with connect(server) as sock:  # an HTTP/2 client dialling the wrong port
            sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            assert answer(sock).status_code == INVALID_ARGUMENT
            assert ended(sock)
        assert client.lookup("t", KEYS).prefix_length == 5  # the service keeps answering


def test_a_hello_without_a_valid_token_is_refused_and_ends_the_connection(tmp_path):
    token_file = tmp_path / "tokens"
    token_file.write_text(f"{ADMIN} *\n{ALICE} alice\n")
    with running_server(tmp_path, token_file=token_file) as server:
        for token in ("", "not-a-token-0123456789"):
            with connect(server) as sock:
                refused = hello(sock, server, token)
                assert refused.status_code == UNAUTHENTICATED
                assert ended(sock)
        with connect(server) as sock:  # no request is answered before the hello
            send(sock, pb.LookupRequest(tenant="alice", keys=KEYS).SerializeToString())
            refused = answer(sock)  # parsed as a LookupHello of no version
            assert refused.status_code == INVALID_ARGUMENT
            assert "the first frame must be a LookupHello" in refused.status_message
            assert ended(sock)
        with MetadataClient(f"127.0.0.1:{server.port}", token="wrong-token-0123456789") as bad:
            with pytest.raises(AuthError):
                bad.lookup("alice", KEYS)
        with connect(server) as sock:
            assert hello(sock, server, ALICE).status_code == OK
            send(sock, pb.LookupRequest(tenant="bob", keys=KEYS).SerializeToString())
            assert answer(sock).status_code == PERMISSION_DENIED
        assert calls(server, "LookupPort", "UNAUTHENTICATED") == 2


def test_a_silent_connection_is_ended_and_silent_ones_are_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(lookup_connection, "HELLO_TIMEOUT_S", 0.3)
    monkeypatch.setattr(lookup_connection, "MAX_AWAITING_HELLO", 2)
    with running_server(tmp_path) as server:
        silent = [connect(server), connect(server)]
        with connect(server) as third:
            assert ended(third)  # dropped unanswered: two are already waiting
        for sock in silent:
            late = answer(sock)
            assert late.status_code == DEADLINE_EXCEEDED
            assert "no LookupHello within 0.3 s" in late.status_message
            assert ended(sock)
            sock.close()
        with connect(server) as sock:  # their places are free again
            assert hello(sock, server).status_code == OK
        assert calls(server, "LookupPort", "RESOURCE_EXHAUSTED") == 1


def test_connections_hold_the_lookup_stream_slots_of_their_tenant(tmp_path):
    token_file = tmp_path / "tokens"
    token_file.write_text(f"{ADMIN} *\n{ALICE} alice\n")
    with running_server(tmp_path, token_file=token_file, max_lookup_streams_per_tenant=2) as server:
        held = [connect(server), connect(server)]
        for sock in held:
            assert hello(sock, server, ALICE).status_code == OK
        with connect(server) as sock:
            refused = hello(sock, server, ALICE)
            assert refused.status_code == RESOURCE_EXHAUSTED
            assert "max_lookup_streams_per_tenant" in refused.status_message
            assert ended(sock)
        with client_for(server, token=ALICE) as alice:  # no slot anywhere: a unary Lookup
            assert alice.lookup("alice", KEYS).prefix_length == 0
        assert calls(server, "LookupPort", "RESOURCE_EXHAUSTED") == 2  # the raw one, the client
        assert calls(server, "LookupStream", "RESOURCE_EXHAUSTED") == 1
        assert calls(server, "Lookup") == 1  # answered once, unary
        held.pop().close()
        deadline = time.monotonic() + 5
        while server.lookup_port.slots.open_count("alice") > 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        with connect(server) as sock:
            assert hello(sock, server, ALICE).status_code == OK
        held[0].close()


def test_an_idle_connection_is_ended_and_the_next_lookup_opens_another(tmp_path):
    limits = ServiceLimits(min_lease_ttl_ms=200, watch_poll_s=0.1, lookup_stream_idle_s=0.4)
    with running_server(tmp_path, limits=limits) as server, client_for(server) as client:
        publish(client)
        assert client.lookup("t", KEYS).prefix_length == 5
        with connect(server) as sock:
            assert hello(sock, server).status_code == OK
            started = time.monotonic()
            assert ended(sock)  # closed without a frame: none would answer a lookup
            assert 0.3 < time.monotonic() - started < 10
        time.sleep(0.3)  # the client's connection has been ended too
        assert client.lookup("t", KEYS).prefix_length == 5  # retried on a new connection
        assert calls(server, "LookupPort") == 3
        assert calls(server, "LookupStream") == 0


def test_a_lookup_port_that_never_answers_is_a_deadline_error(tmp_path, monkeypatch):
    listener = socket.create_server(("127.0.0.1", 0))
    accepted = []

    def accept_hello_then_stall() -> None:
        sock, _ = listener.accept()
        accepted.append(sock)
        sock.recv(4096)  # the hello
        ok = pb.LookupStreamResponse().SerializeToString()
        sock.sendall(LENGTH.pack(len(ok)) + ok)

    threading.Thread(target=accept_hello_then_stall, daemon=True).start()
    stalled_port = listener.getsockname()[1]
    described = pb.DescribeResponse(lookup_port=stalled_port, instance=b"x")
    monkeypatch.setattr(lookup_sockets.LookupSockets, "_describe", lambda self, d: described)
    with running_server(tmp_path) as server, client_for(server) as client:
        started = time.monotonic()
        with pytest.raises(UnavailableError, match="DEADLINE_EXCEEDED: no lookup answer"):
            client.lookup("t", KEYS, timeout_s=1.0)
        assert time.monotonic() - started < 3
        assert calls(server, "Lookup") == 0  # the deadline was the port's, not gRPC's
    listener.close()
    for sock in accepted:
        sock.close()


def test_lookups_ride_the_lookup_port_over_tls(tmp_path, tls_files):
    with running_server(tmp_path, tls_cert=tls_files["cert"], tls_key=tls_files["key"]) as server:
        address = f"localhost:{server.port}"
        with MetadataClient(address, tls_ca=tls_files["ca"]) as client:
            publish(client)
            assert client.lookup("t", KEYS).prefix_length == 5
        with connect(server) as plaintext:  # a plaintext hello is no TLS handshake
            send(plaintext, pb.LookupHello(version=1).SerializeToString())
            assert ended(plaintext)
        assert calls(server, "LookupPort") == 1
        assert calls(server, "LookupStream") == 0


def test_without_a_lookup_port_the_client_asks_on_lookup_stream_calls(tmp_path):
    with running_server(tmp_path, lookup_listen="off") as server, client_for(server) as client:
        publish(client)
        assert server.servicer.lookup_port == 0
        for _ in range(3):
            assert client.lookup("t", KEYS).prefix_length == 5
        assert calls(server, "Describe") == 1  # asked once, not at every lookup
        assert calls(server, "LookupStream") == 1


def test_an_index_whose_reads_block_is_answered_on_the_port_from_the_pool(tmp_path):
    """Without lookups on the loop (LoopLookups), its reads run in the unary pool, never on
    the loop (a version offered such an index no port: its clients paid LookupStream's gRPC)."""
    threads = []

    class BlockingReads(MemoryIndex):
        nonblocking_reads = False

        def lookup(self, tenant, keys, anchor=None):
            threads.append(threading.current_thread().name)
            return super().lookup(tenant, keys, anchor)

    config = MetadataConfig(listen="127.0.0.1:0", limits=FAST_LIMITS, backend="memory")
    server = MetadataServer(config, index=BlockingReads())
    server.start()
    try:
        assert server.servicer.lookup_port > 0
        with client_for(server) as client:
            publish(client)
            assert client.lookup("t", KEYS).prefix_length == 5
        assert calls(server, "LookupPort") == 1
        assert calls(server, "LookupStream") == 0
        assert threads and all(name.startswith("rpc") for name in threads)
    finally:
        server.stop(grace_s=0.5)


def test_the_lookup_address_follows_the_grpc_one():
    assert listen_address("auto", "0.0.0.0:50051") == ("0.0.0.0", 50052)
    assert listen_address("auto", "[::]:7000") == ("::", 7001)
    assert listen_address("auto", "127.0.0.1:0") == ("127.0.0.1", 0)  # a free one, as gRPC's
    assert listen_address("10.0.0.5:9000", "0.0.0.0:50051") == ("10.0.0.5", 9000)
    assert listen_address("off", "0.0.0.0:50051") is None
    with pytest.raises(ConfigError, match="past 65535"):
        listen_address("auto", "0.0.0.0:65535")
    for bad in ("nowhere", "host:99999", "host:"):
        with pytest.raises(ConfigError, match="HOST:PORT, 'auto' or 'off'"):
            listen_address(bad, "0.0.0.0:50051")
    assert grpc_host("meta.kvstore.svc:50051") == "meta.kvstore.svc"
    assert grpc_host("dns:///meta:50051") == "meta"
    assert grpc_host("[::1]:50051") == "::1"
    assert grpc_host("unix:/run/kvstore.sock") is None


def test_a_fixed_lookup_port_in_use_stops_the_start_with_a_clear_error(tmp_path):
    taken = socket.create_server(("127.0.0.1", 0))
    port = taken.getsockname()[1]
    config = MetadataConfig(
        listen="127.0.0.1:0", backend="memory", lookup_listen=f"127.0.0.1:{port}"
    )
    before = listening_sockets()
    with pytest.raises(ConfigError, match=f"cannot listen for lookups on 127.0.0.1:{port}"):
        MetadataServer(config).start()
    assert listening_sockets() == before  # the gRPC port it had bound is let go
    taken.close()


def test_a_hello_for_another_service_instance_is_refused(tmp_path):
    with running_server(tmp_path) as server, connect(server) as sock:
        send(sock, pb.LookupHello(version=1, instance=b"0" * 16).SerializeToString())
        refused = answer(sock)
        assert refused.status_code == FAILED_PRECONDITION
        assert "another service instance's" in refused.status_message
        assert ended(sock)


def test_many_threads_share_a_client_s_few_connections(tmp_path):
    with running_server(tmp_path) as server, client_for(server) as client:
        publish(client)
        wrong = []

        def look_up(count: int) -> None:
            for n in range(count):
                found = client.lookup("t", KEYS[: 1 + n % 8]).prefix_length
                if found != min(5, 1 + n % 8):
                    wrong.append((n, found))

        threads = [threading.Thread(target=look_up, args=(60,)) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert wrong == []
        sockets = client._lookup_sockets
        assert sockets._open == len(sockets._idle) <= lookup_sockets.MAX_OPEN
        assert calls(server, "LookupPort") <= lookup_sockets.MAX_OPEN
        assert calls(server, "Lookup") == 8 * 60  # each answered once, whichever way
        client.close()
        assert sockets._open == 0 and sockets._idle == []


def test_threads_past_the_client_s_connections_keep_getting_answers(tmp_path):
    """Threads looking up in a loop, twice as many as a client's connections: each is answered
    throughout (a version whose fifth thread waited for a connection starved it: the thread
    that gave one back took it again before the waiter woke)."""
    with running_server(tmp_path) as server, client_for(server) as client:
        publish(client)
        answered, failed = [0] * 8, []
        stop_at = time.monotonic() + 1.5

        def look_up(index: int) -> None:
            while time.monotonic() < stop_at:
                try:
                    assert client.lookup("t", KEYS, timeout_s=0.5).prefix_length == 5
                    answered[index] += 1
                except Exception as exc:
                    failed.append(exc)
                    return

        threads = [threading.Thread(target=look_up, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert failed == []
        assert min(answered) >= 10, answered


def test_a_client_that_does_not_read_its_answers_is_no_longer_read(tmp_path):
    with running_server(tmp_path) as server, client_for(server) as client:
        publish(client)
        request = pb.LookupRequest(tenant="t", keys=KEYS).SerializeToString()
        count = 40_000  # 7 MB of requests, 8 MB of answers
        with connect(server) as sock:
            assert hello(sock, server).status_code == OK
            sender = threading.Thread(
                target=sock.sendall, args=((LENGTH.pack(len(request)) + request) * count,)
            )
            sender.start()
            time.sleep(2)  # the service answers until the socket's buffers are full
            (connection,) = server.lookup_port.connections
            assert len(connection.buffer) < 1 << 20
            assert connection.transport.get_write_buffer_size() < 1 << 20
            assert client.lookup("t", KEYS).prefix_length == 5  # others are answered meanwhile
            answers = [answer(sock).response.prefix_length for _ in range(count)]
            sender.join()
        assert answers == [5] * count


def test_a_tls_handshake_counts_against_the_hello_s_bounds(tmp_path, tls_files, monkeypatch):
    monkeypatch.setattr(lookup_connection, "HELLO_TIMEOUT_S", 0.3)
    with running_server(tmp_path, tls_cert=tls_files["cert"], tls_key=tls_files["key"]) as server:
        with connect(server) as silent:  # connected, no ClientHello
            deadline = time.monotonic() + 5
            while server.lookup_port.awaiting_hello != 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert server.lookup_port.awaiting_hello == 1
            assert ended(silent)  # cut at the hello's deadline, mid-handshake
        deadline = time.monotonic() + 5
        while server.lookup_port.awaiting_hello and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.lookup_port.awaiting_hello == 0
        assert server.lookup_port.connections == set()
        with MetadataClient(f"localhost:{server.port}", tls_ca=tls_files["ca"]) as client:
            publish(client)
            assert client.lookup("t", KEYS).prefix_length == 5
        assert calls(server, "LookupPort") == 1
