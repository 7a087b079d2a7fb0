"""The machine's floor under the metadata service's lookups: an echo of a lookup-sized request on
loopback over gRPC (unary, on a grpc.aio server, the service's kind, and a sync one; messages on
an open stream) and over a raw TCP connection to an asyncio server (the lookup port's kind), and
the clients that measure it and the service alike (separate processes; the servers' CPU per
call counted).
And the floor under a worker's call to its node agent: a raw unix-socket round trip between two
processes.

Runs in the benchmark process; the echo servers and the clients are child processes it spawns.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import select
import socket
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from queue import Empty

from kvstore.bench.transfer import _process_cpu_s
from kvstore.errors import ConfigError
from kvstore.framing import spin_until_readable

WARMUP_CALLS = 20
READY_TIMEOUT_S = 60.0  # a spawned client's first connection on a loaded machine
START_TIMEOUT_S = 600.0  # 32 spawned clients take minutes to start on a loaded machine
SERVER_KINDS = ("aio", "sync", "tcp")
SYNC_SERVER_THREADS = 4


def summary(samples: list[float], duration_s: float) -> dict:
    samples = sorted(samples)
    return {
        "p50_us": samples[len(samples) // 2] * 1e6,
        "p99_us": samples[min(len(samples) - 1, int(len(samples) * 0.99))] * 1e6,
        "qps": len(samples) / duration_s,
    }


def timed_calls(call: Callable[[], object], duration_s: float, start=None) -> list[float]:
    """Seconds of each call of `call` for `duration_s`, after WARMUP_CALLS untimed ones and,
    with `start` (concurrent_run's), once every client is warm (their windows overlap)."""
    for _ in range(WARMUP_CALLS):
        call()
    if start is not None:
        ready, go = start
        ready.put(None)
        if not go.wait(START_TIMEOUT_S):
            raise ConfigError("the bench never opened the timed window")
    samples = []
    deadline = time.perf_counter() + duration_s
    while (begun := time.perf_counter()) < deadline:
        call()
        samples.append(time.perf_counter() - begun)
    return samples


def concurrent_run(
    client: Callable, args: tuple, clients: int, duration_s: float, server_pid: int
) -> dict:
    """`clients` processes each running `client(*args, duration_s, start, results)`, which
    times calls through `timed_calls(..., start)` and puts its samples in `results`: p50/p99/qps
    over all of them, and the server's CPU µs per call over the common timed window."""
    context = multiprocessing.get_context("spawn")
    results, ready, go = context.Queue(), context.Queue(), context.Event()
    workers = [
        context.Process(target=client, args=(*args, duration_s, (ready, go), results))
        for _ in range(clients)
    ]
    for worker in workers:
        worker.start()
    for _ in workers:
        _next(ready, workers, START_TIMEOUT_S)
    go.set()
    cpu_before_s = _process_cpu_s(server_pid)
    samples = [s for _ in workers for s in _next(results, workers, duration_s + READY_TIMEOUT_S)]
    cpu_s = _process_cpu_s(server_pid) - cpu_before_s
    for worker in workers:
        worker.join()
    result = summary(samples, duration_s)
    result["server_cpu_us_per_call"] = cpu_s / len(samples) * 1e6
    return result


def _next(queue, workers: list, timeout_s: float):
    """The next item of `queue`; ConfigError once a worker failed, or after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return queue.get(timeout=1.0)
        except Empty:
            failed = [w.exitcode for w in workers if w.exitcode not in (None, 0)]
            if failed:
                message = f"a bench client exited with {failed[0]}; its log is above"
                raise ConfigError(message) from None
    raise ConfigError(f"the bench clients sent nothing within {timeout_s} s")


def _echo_server(kind: str, queue) -> None:
    """Child: a server whose one method returns its request; "tcp": an asyncio server (the
    lookup port's kind) answering each read with its bytes."""
    import asyncio
    from concurrent import futures

    import grpc

    def handlers(echo, echo_stream=None) -> list:
        methods = {"Echo": grpc.unary_unary_rpc_method_handler(echo)}
        if echo_stream is not None:
            methods["EchoStream"] = grpc.stream_stream_rpc_method_handler(echo_stream)
        return [grpc.method_handlers_generic_handler("bench.Echo", methods)]

    if kind == "sync":
        server = grpc.server(futures.ThreadPoolExecutor(SYNC_SERVER_THREADS))
        server.add_generic_rpc_handlers(handlers(lambda payload, context: payload))
        queue.put(server.add_insecure_port("127.0.0.1:0"))
        server.start()
        server.wait_for_termination()
        return

    class TcpEcho(asyncio.Protocol):
        def connection_made(self, transport) -> None:
            self.transport = transport

        def data_received(self, data: bytes) -> None:
            self.transport.write(data)

    async def echo(payload: bytes, context) -> bytes:
        return payload

    async def echo_stream(payloads, context):
        async for payload in payloads:
            yield payload

    async def serve() -> None:
        if kind == "tcp":
            server = await asyncio.get_running_loop().create_server(TcpEcho, "127.0.0.1", 0)
            queue.put(server.sockets[0].getsockname()[1])
            await server.serve_forever()
        server = grpc.aio.server()
        server.add_generic_rpc_handlers(handlers(echo, echo_stream))
        queue.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


@contextmanager
def echo_server(kind: str) -> Iterator[tuple[str, int]]:
    """An echo server process of `kind` (SERVER_KINDS); yields (address, its pid)."""
    if kind not in SERVER_KINDS:
        raise ConfigError(f"echo server kind {kind!r} unknown; use one of {SERVER_KINDS}")
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    server = context.Process(target=_echo_server, args=(kind, queue), daemon=True)
    server.start()
    try:
        yield f"127.0.0.1:{queue.get(timeout=READY_TIMEOUT_S)}", server.pid
    finally:
        server.terminate()
        server.join(timeout=10)


def echo_samples(
    address: str, payload: bytes, duration_s: float, start=None, way: str = "unary"
) -> list[float]:
    """Timed echoes: unary calls; "stream", messages on one open call, sent and read as the
    metadata client's LookupStream calls are (kvstore/metadata/client/lookup_calls.py); "tcp", a
    send and the reads of its echo on one TCP connection."""
    if way == "tcp":
        return _tcp_echo_samples(address, payload, duration_s, start)
    import grpc

    with grpc.insecure_channel(address) as channel:
        grpc.channel_ready_future(channel).result(timeout=READY_TIMEOUT_S)
        if way == "unary":
            call = channel.unary_unary("/bench.Echo/Echo")
            return timed_calls(lambda: call(payload, timeout=5), duration_s, start)
        requests = queue.SimpleQueue()
        answers = channel.stream_stream("/bench.Echo/EchoStream")(iter(requests.get, None))

        def ask() -> None:
            requests.put(payload)
            next(answers)

        try:
            return timed_calls(ask, duration_s, start)
        finally:
            requests.put(None)
            answers.cancel()


def _tcp_echo_samples(address: str, payload: bytes, duration_s: float, start) -> list[float]:
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=READY_TIMEOUT_S) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buffer = bytearray(len(payload))

        def ask() -> None:
            sock.sendall(payload)
            view, got = memoryview(buffer), 0
            while got < len(buffer):
                received = sock.recv_into(view[got:])
                if not received:
                    raise ConfigError("the TCP echo closed")
                got += received

        return timed_calls(ask, duration_s, start)


def echo_client(address: str, payload: bytes, way: str, duration_s: float, start, results) -> None:
    """Child of concurrent_run: echo calls for `duration_s`; puts the samples."""
    results.put(echo_samples(address, payload, duration_s, start, way))


# (server kind, the client's way, the name of its figures, the name of its server CPU per call)
ECHO_KINDS = (
    ("aio", "unary", "grpc_echo", "grpc_echo_server"),
    ("sync", "unary", "grpc_echo_sync_server", "grpc_echo_sync_server"),
    ("aio", "stream", "grpc_stream_echo", "grpc_stream_echo_server"),
    ("tcp", "tcp", "tcp_echo", "tcp_echo_server"),
)


def echo_floor(payload: bytes, runs: int, duration_s: float, clients: int) -> dict:
    """Medians over `runs` of the echo's p50 (one client), its qps and server CPU per call
    with `clients` client processes: for each of ECHO_KINDS."""
    result = {}
    for kind, way, name, server in ECHO_KINDS:
        with echo_server(kind) as (address, pid):
            p50s = [
                summary(echo_samples(address, payload, duration_s, None, way), duration_s)["p50_us"]
                for _ in range(runs)
            ]
            many = [
                concurrent_run(echo_client, (address, payload, way), clients, duration_s, pid)
                for _ in range(runs)
            ]
        result[f"{name}_64_p50_us"] = statistics.median(p50s)
        result[f"{name}_qps_{clients}_clients"] = statistics.median(m["qps"] for m in many)
        result[f"{server}_cpu_us_per_call"] = statistics.median(
            m["server_cpu_us_per_call"] for m in many
        )
    return result


def _socket_echo(path: str, response_bytes: int, ready) -> None:
    """Child: answers each message on a unix socket with `response_bytes` bytes."""
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(1)
    ready.put(None)
    connection, _ = listener.accept()
    answer = bytes(response_bytes)
    while connection.recv(1 << 16):
        connection.sendall(answer)


def unix_socket_floor_p50_us(
    request_bytes: int, response_bytes: int, runs: int, duration_s: float, spin_s: float = 0.0
) -> float:
    """Median over `runs` of the p50 of a raw round trip to another process over a unix
    socket (one send and one recv each side, no framing, no parsing; the client polls for the
    answer `spin_s` before sleeping, as KVStoreClient does): what a worker's call to its node
    agent cannot beat on this machine."""
    context = multiprocessing.get_context("spawn")
    ready = context.Queue()
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "floor.sock")
        echo = context.Process(target=_socket_echo, args=(path, response_bytes, ready))
        echo.start()
        try:
            ready.get(timeout=READY_TIMEOUT_S)
            with socket.socket(socket.AF_UNIX) as client:
                client.connect(path)
                request = bytes(request_bytes)
                answer = select.poll()
                answer.register(client, select.POLLIN)

                def call() -> None:
                    client.sendall(request)
                    if spin_s:
                        spin_until_readable(answer, spin_s)
                    if not client.recv(1 << 16):
                        raise ConfigError("the unix-socket echo closed")

                p50s = [
                    summary(timed_calls(call, duration_s), duration_s)["p50_us"]
                    for _ in range(runs)
                ]
        finally:
            echo.terminate()
            echo.join(timeout=10)
    return statistics.median(p50s)
