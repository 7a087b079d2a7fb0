"""The client's side of the lookup port (lookup_port.py): open connections reused across lookups.

Runs in the process of a MetadataClient (node agents, routers, the bench), in the threads that
look up; no thread of its own. The port and the service's instance id are learnt from Describe;
the port is dialled on the host of the gRPC address, with TLS where the channel has it. A lookup
takes an idle connection (or opens one, up to MAX_OPEN), sends its request and reads the answer
in the asking thread, the socket's timeout its deadline. Where none is to be had (no lookup
port, all in use, or the port failed or refused in the last RETRY_AFTER_S), `lookup` returns
None and the caller asks over gRPC instead, with what is left of the deadline. A connection
that timed out, failed or sat idle for CLIENT_IDLE_S is closed, never reused (an answer still
on its way would be read as the next lookup's); so are those a forked child inherited.
"""

from __future__ import annotations

import os
import socket
import ssl
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc

from kvstore import errors
from kvstore.framing import FrameTimeoutError, recv_answer
from kvstore.metadata.status import lookup_answer
from kvstore.metadata.wire import LENGTH, LOOKUP_FRAMING_VERSION
from kvstore.v1 import metadata_pb2 as pb

MAX_OPEN = 4  # connections per client; more lookups at once than this go over gRPC
CONNECT_BUDGET_S = 0.5  # at most this of a lookup's deadline goes to connecting and the hello
RETRY_AFTER_S = 10.0  # after the port failed, gRPC only for this long
DESCRIBE_AGAIN_S = 60.0  # a service with no lookup port is asked again after this long
DESCRIBE_TIMEOUT_S = 1.0
CLIENT_IDLE_S = 30.0  # the service closes connections idle for 60 s (lookup_stream_idle_s)


def grpc_host(address: str) -> str | None:
    """The host of a gRPC target ("host:port", "[v6]:port", "dns:///host:port"); None for
    targets with no host to dial (unix sockets)."""
    address = address.removeprefix("dns:///").removeprefix("ipv4:").removeprefix("ipv6:")
    if address.startswith("unix"):
        return None
    host, _, _ = address.rpartition(":")
    return host.strip("[]") or None


class _Connection:
    """One open connection, its hello answered; used by one lookup at a time."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.answered = 0  # lookups answered (the hello is not one)
        self.used_at = time.monotonic()

    def ask(self, message, deadline: float, max_bytes: int) -> pb.LookupStreamResponse:
        """Send `message` and read its answer: one recv where the answer arrives whole (the
        common case). A request is alone on its connection, so bytes past the answer are the
        service breaking the protocol: the connection is dropped."""
        payload = message.SerializeToString()
        self.sock.settimeout(max(1e-3, deadline - time.monotonic()))
        self.sock.sendall(LENGTH.pack(len(payload)) + payload)
        self.sock.settimeout(max(1e-3, deadline - time.monotonic()))  # the read: what is left
        answer = recv_answer(self.sock, pb.LookupStreamResponse, max_bytes, deadline)
        if answer is None:
            raise ConnectionResetError("the service closed the lookup connection")
        self.used_at = time.monotonic()
        return answer

    def close(self) -> None:
        self.sock.close()


class LookupSockets:
    def __init__(
        self,
        stub,
        metadata: Callable[[], tuple],
        address: str,
        tls_ca: Path | None,
        max_message_bytes: int,
        enabled: bool = True,
    ) -> None:
        """`metadata`: of each Describe call, its bearer token also each new connection's
        hello (the token may change; client.call_metadata)."""
        self._stub = stub
        self._metadata = metadata
        self._host = grpc_host(address)
        self._tls = ssl.create_default_context(cafile=str(tls_ca)) if tls_ca else None
        self._max_bytes = max_message_bytes
        self._described: pb.DescribeResponse | None = None  # None: to be asked
        self._lock = threading.Lock()
        self._idle: list[_Connection] = []
        self._open = 0
        self._pid = os.getpid()
        self._retry_at = 0.0 if enabled and self._host else float("inf")
        self._closed = False

    def lookup(self, request: pb.LookupRequest, deadline: float) -> pb.LookupResponse | None:
        """The service's answer on a lookup connection; None: ask over gRPC instead. A refused
        request raises its error, as a gRPC call's would."""
        for _ in range(2):
            connection = self._take(deadline)
            if connection is None:
                return None
            try:
                answer = connection.ask(request, deadline, self._max_bytes)
                if not answer.status_code and not answer.HasField("response"):
                    raise errors.KVStoreError("a lookup answer with no response")
            except (TimeoutError, FrameTimeoutError):
                self._drop(connection)
                raise errors.UnavailableError(
                    "DEADLINE_EXCEEDED: no lookup answer by its deadline"
                ) from None
            except (OSError, errors.KVStoreError):
                self._drop(connection)
                if connection.answered:  # closed while idle (the service's idle timeout)
                    continue
                self._back_off()
                return None
            except BaseException:  # an interrupted wait: the connection's state is unknown
                self._drop(connection)
                raise
            connection.answered += 1
            self._give(connection)
            return lookup_answer(answer)
        return None

    def _take(self, deadline: float) -> _Connection | None:
        stale: list[_Connection] = []
        try:
            with self._lock:
                if self._closed:
                    raise errors.UnavailableError("UNAVAILABLE: the metadata client is closed")
                self._forget_inherited()
                while self._idle:
                    connection = self._idle.pop()
                    if time.monotonic() - connection.used_at < CLIENT_IDLE_S:
                        return connection
                    stale.append(connection)
                    self._open -= 1
                if self._open >= MAX_OPEN or time.monotonic() < self._retry_at:
                    return None
                self._open += 1
        finally:
            for connection in stale:
                connection.close()
        connection = None
        try:
            connection = self._connect(deadline)
            return connection
        finally:
            if connection is None:
                with self._lock:
                    self._open -= 1

    def _forget_inherited(self) -> None:
        """In a forked child: the parent's connections are the parent's (both reading one
        socket would take each other's answers); close the child's copies, start afresh."""
        if os.getpid() != self._pid:
            self._pid = os.getpid()
            for connection in self._idle:
                connection.close()
            self._idle, self._open = [], 0

    def _connect(self, deadline: float) -> _Connection | None:
        """A new connection, its hello accepted; None where there is no port or it failed
        (the port is then left alone for RETRY_AFTER_S, unless the caller's own deadline was
        too short to tell)."""
        described = self._describe(deadline)
        if described is None:
            return None
        budget = min(CONNECT_BUDGET_S, deadline - time.monotonic())
        connect_by = time.monotonic() + budget
        hello = pb.LookupHello(
            token=self._token(), version=LOOKUP_FRAMING_VERSION, instance=described.instance
        )
        sock = None
        try:
            sock = socket.create_connection((self._host, described.lookup_port), max(1e-3, budget))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            if self._tls is not None:
                sock.settimeout(max(1e-3, connect_by - time.monotonic()))
                sock = self._tls.wrap_socket(sock, server_hostname=self._host)
            connection = _Connection(sock)
            answer = connection.ask(hello, connect_by, self._max_bytes)
        except (OSError, errors.KVStoreError):
            if sock is not None:
                sock.close()
            if budget >= CONNECT_BUDGET_S:
                self._described = None  # the service may have moved: ask it again
                self._back_off()
            return None
        if answer.status_code:  # no slot, another instance, a bad token: gRPC says more
            connection.close()
            self._described = None
            self._back_off()
            return None
        return connection

    def _token(self) -> str:
        """The bearer token of the calls' metadata ("" for none), for a hello."""
        for name, value in self._metadata():
            if name == "authorization":
                return value.removeprefix("Bearer ")
        return ""

    def _describe(self, deadline: float) -> pb.DescribeResponse | None:
        """The service's lookup port and instance, asked once while it answers (None: none,
        or the service did not say; gRPC meanwhile)."""
        described = self._described
        if described is None:
            timeout_s = min(DESCRIBE_TIMEOUT_S, max(1e-3, deadline - time.monotonic()))
            try:
                described = self._stub.Describe(
                    pb.DescribeRequest(), timeout=timeout_s, metadata=self._metadata()
                )
            except grpc.RpcError as exc:  # UNIMPLEMENTED: a service from before the port
                unimplemented = exc.code() == grpc.StatusCode.UNIMPLEMENTED
                self._back_off(DESCRIBE_AGAIN_S if unimplemented else RETRY_AFTER_S)
                return None
            if not described.lookup_port:
                self._back_off(DESCRIBE_AGAIN_S)
                return None
            self._described = described
        return described

    def _back_off(self, seconds: float = RETRY_AFTER_S) -> None:
        with self._lock:
            self._retry_at = time.monotonic() + seconds

    def _give(self, connection: _Connection) -> None:
        with self._lock:
            if not self._closed and os.getpid() == self._pid:
                self._idle.append(connection)
                return
            self._open -= 1
        connection.close()

    def _drop(self, connection: _Connection) -> None:
        with self._lock:
            self._open -= 1
        connection.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            self._open -= len(idle)
        for connection in idle:
            connection.close()
