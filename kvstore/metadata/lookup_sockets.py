"""The client's side of the lookup port (lookup_port.py): open connections reused across lookups.

Runs in the process of a MetadataClient (node agents, routers, the bench), in the threads that
look up; no thread of its own. The port is learnt once from the service's Describe and dialled
on the host of the gRPC address, with TLS where the channel has it. A lookup takes an idle
connection (or opens one, up to MAX_OPEN), sends its request and reads the answer in the asking
thread, the socket's timeout its deadline. Where none is to be had (no lookup port, all in use,
or the port failed, refused a slot or went unanswered in the last RETRY_AFTER_S), `lookup`
returns None and the caller asks over gRPC instead, with what is left of the deadline.
"""

from __future__ import annotations

import socket
import ssl
import threading
import time
from pathlib import Path

import grpc

from kvstore import errors
from kvstore.framing import FrameTimeoutError, recv_message, send_message
from kvstore.metadata.lookup_port import VERSION
from kvstore.metadata.status import code_of, error_for, lookup_answer
from kvstore.v1 import metadata_pb2 as pb

MAX_OPEN = 4  # connections per client; more lookups at once than this go over gRPC
RETRY_AFTER_S = 10.0  # after the port failed, gRPC only for this long
DESCRIBE_AGAIN_S = 60.0  # a service with no lookup port is asked again after this long
DESCRIBE_TIMEOUT_S = 1.0
# a hello refused for these is the caller's error, as it would be on gRPC: raise it
_CALLERS_FAULT = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


def grpc_host(address: str) -> str | None:
    """The host of a gRPC target ("host:port", "[v6]:port", "dns:///host:port"); None for
    targets with no host to dial (unix sockets)."""
    address = address.removeprefix("dns:///").removeprefix("ipv4:").removeprefix("ipv6:")
    if address.startswith("unix"):
        return None
    host, _, _ = address.rpartition(":")
    return host.strip("[]") or None


class _Connection:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.answered = 0

    def ask(self, request: pb.LookupRequest, deadline: float, max_bytes: int):
        self.sock.settimeout(max(1e-3, deadline - time.monotonic()))
        send_message(self.sock, request)
        answer = recv_message(
            self.sock, pb.LookupStreamResponse, max_bytes, deadline - time.monotonic()
        )
        if answer is None:
            raise ConnectionResetError("the service closed the lookup connection")
        self.answered += 1
        return answer

    def close(self) -> None:
        self.sock.close()


class LookupSockets:
    def __init__(
        self, stub, metadata: tuple, address: str, token: str | None, tls_ca: Path | None,
        max_message_bytes: int, enabled: bool = True,
    ) -> None:  # fmt: skip
        self._stub = stub
        self._metadata = metadata
        self._host = grpc_host(address)
        self._hello = pb.LookupHello(token=token or "", version=VERSION)
        self._tls = ssl.create_default_context(cafile=str(tls_ca)) if tls_ca else None
        self._max_bytes = max_message_bytes
        self._port: int | None = None  # None: not asked yet; 0: the service has none
        self._lock = threading.Lock()
        self._idle: list[_Connection] = []
        self._open = 0
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
            except (TimeoutError, FrameTimeoutError):
                self._drop(connection)
                raise errors.UnavailableError("DEADLINE_EXCEEDED: no lookup answer by its "
                                              "deadline") from None  # fmt: skip
            except (OSError, errors.KVStoreError):
                self._drop(connection)
                if connection.answered:  # ended while idle (the service's idle timeout)
                    continue
                self._back_off()
                return None
            except BaseException:  # an interrupted wait: the connection's state is unknown
                self._drop(connection)
                raise
            self._give(connection)
            return lookup_answer(answer)
        return None

    def _take(self, deadline: float) -> _Connection | None:
        with self._lock:
            if self._closed:
                raise errors.UnavailableError("UNAVAILABLE: the metadata client is closed")
            if self._idle:
                return self._idle.pop()
            if self._open >= MAX_OPEN or time.monotonic() < self._retry_at:
                return None
            self._open += 1
        connection = None
        try:
            connection = self._connect(deadline)
            return connection
        finally:
            if connection is None:
                with self._lock:
                    self._open -= 1

    def _connect(self, deadline: float) -> _Connection | None:
        """A new connection, its hello accepted; None where there is no port or it failed."""
        port = self._describe(deadline)
        if not port:
            return None
        try:
            timeout_s = max(1e-3, deadline - time.monotonic())
            sock = socket.create_connection((self._host, port), timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:
                sock = self._tls.wrap_socket(sock, server_hostname=self._host)
            connection = _Connection(sock)
            answer = connection.ask(self._hello, deadline, self._max_bytes)
        except (OSError, errors.KVStoreError):
            self._port = None  # the service may have moved: ask it again after the back-off
            self._back_off()
            return None
        if answer.status_code:
            connection.close()
            code = code_of(answer.status_code)
            if code in _CALLERS_FAULT:
                raise error_for(code, answer.status_message)
            self._back_off()  # no slot, or the service's trouble: gRPC says more
            return None
        return connection

    def _describe(self, deadline: float) -> int:
        """The service's lookup port, asked once while it answers (0: none for now)."""
        if self._port is None:
            timeout_s = min(DESCRIBE_TIMEOUT_S, max(1e-3, deadline - time.monotonic()))
            try:
                response = self._stub.Describe(
                    pb.DescribeRequest(), timeout=timeout_s, metadata=self._metadata
                )
            except grpc.RpcError as exc:  # UNIMPLEMENTED: a service from before the port
                unimplemented = exc.code() == grpc.StatusCode.UNIMPLEMENTED
                self._back_off(DESCRIBE_AGAIN_S if unimplemented else RETRY_AFTER_S)
                return 0
            if not response.lookup_port:
                self._back_off(DESCRIBE_AGAIN_S)
                return 0
            self._port = response.lookup_port
        return self._port

    def _back_off(self, seconds: float = RETRY_AFTER_S) -> None:
        with self._lock:
            self._retry_at = time.monotonic() + seconds

    def _give(self, connection: _Connection) -> None:
        with self._lock:
            if not self._closed:
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
