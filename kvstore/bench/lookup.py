"""`kvstore bench lookup`: latency and throughput of prompt lookups against a metadata service
it starts on loopback (a separate process), beside pipelined Redis EXISTS of the same keys; a
worker's lookups through its node agent (another process, answering from its cluster view) for
all-local, all-remote and all-absent prompts; the view's bytes per key; publish batching.

Runs in the benchmark process; clients for the concurrent runs are separate processes so the
service, not the client's GIL, is what is measured.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import statistics
import tempfile
import time
import tracemalloc
from pathlib import Path

from kvstore.bench import peers
from kvstore.bench.timing import check_runs, machine_info
from kvstore.errors import ConfigError
from kvstore.metadata.client import MetadataClient
from kvstore.metadata.index import BlockEntry, NodeRecord
from kvstore.node.view import ClusterView
from kvstore.v1 import metadata_pb2 as pb

TENANT = "bench"
PREFIX_KEYS = 512


def bench_keys(count: int = PREFIX_KEYS) -> list[bytes]:
    return [index.to_bytes(16, "little") for index in range(count)]


def _populate(address: str) -> None:
    with MetadataClient(address) as client:
        lease, _ = client.register_node(
            NodeRecord("bench-node", tcp_address="127.0.0.1:1"), 600_000
        )
        entries = [BlockEntry(key, "host", 1 << 20, 1) for key in bench_keys()]
        client.publish("bench-node", lease, TENANT, entries)


def _latencies_s(address: str, num_keys: int, duration_s: float) -> list[float]:
    keys = bench_keys(num_keys)
    samples = []
    with MetadataClient(address) as client:
        for _ in range(20):  # warm the channel
            client.lookup(TENANT, keys)
        deadline = time.perf_counter() + duration_s
        while (start := time.perf_counter()) < deadline:
            result = client.lookup(TENANT, keys)
            samples.append(time.perf_counter() - start)
            if result.prefix_length != num_keys:
                raise ConfigError(f"lookup found {result.prefix_length} of {num_keys} keys")
    return samples


def _client_process(address: str, num_keys: int, duration_s: float, queue) -> None:
    queue.put(_latencies_s(address, num_keys, duration_s))


def _concurrent_run(address: str, num_keys: int, clients: int, duration_s: float) -> dict:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    workers = [
        context.Process(target=_client_process, args=(address, num_keys, duration_s, queue))
        for _ in range(clients)
    ]
    for worker in workers:
        worker.start()
    wait_s = duration_s + 600  # 32 spawned clients take minutes to start on a loaded machine
    samples = [s for _ in workers for s in queue.get(timeout=wait_s)]
    for worker in workers:
        worker.join()
    return _summary(samples, duration_s)


def _summary(samples: list[float], duration_s: float) -> dict:
    samples = sorted(samples)
    return {
        "p50_us": samples[len(samples) // 2] * 1e6,
        "p99_us": samples[min(len(samples) - 1, int(len(samples) * 0.99))] * 1e6,
        "qps": len(samples) / duration_s,
    }


def _redis_exists_p50_us(num_keys: int, duration_s: float) -> float:
    """Pipelined EXISTS of `num_keys` keys on a redis-server started here, p50 in µs."""
    keys = bench_keys(num_keys)
    with peers.redis_server() as client:
        client.mset({key: b"1" for key in keys})
        samples = []
        deadline = time.perf_counter() + duration_s
        while (start := time.perf_counter()) < deadline:
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key)
            pipe.execute()
            samples.append(time.perf_counter() - start)
    return _summary(samples, duration_s)["p50_us"]


def _agent_lookups(address: str, runs: int, duration_s: float) -> dict:
    """p50 of a 64-key lookup through a node agent's control socket, per kind of prompt."""
    from kvstore.client import KVStoreClient  # torch: not in the spawned lookup clients

    page_bytes = 64 << 10
    with tempfile.TemporaryDirectory() as directory, peers.node_agent(
        Path(directory), page_bytes, 128, "--metadata-address", address, "--transfer", "tcp",
    ) as socket_path, KVStoreClient(socket_path, "bench") as worker:  # fmt: skip
        prompts = {
            "local": _saved_keys(worker, page_bytes // 2),
            "remote": bench_keys(64),
            "absent": [os.urandom(16) for _ in range(64)],
        }
        _wait_for_view(worker, prompts["remote"])
        result = {}
        for kind, keys in prompts.items():
            expected = {"local": (64, 0), "remote": (0, 64), "absent": (0, 0)}[kind]
            p50s = [_agent_p50_us(worker, keys, expected, duration_s) for _ in range(runs)]
            result[f"all_{kind}"] = statistics.median(p50s)
        lags_ms = sorted(_view_lag_ms(address, worker) for _ in range(20))
        view = json.loads(worker.stats())["view"]
        return {
            "agent_lookup_64_p50_us": result, "agent_view": view,
            "view_lag_p50_ms": lags_ms[len(lags_ms) // 2], "view_lag_max_ms": lags_ms[-1],
        }  # fmt: skip


def _view_lag_ms(address: str, worker, timeout_s: float = 10.0) -> float:
    """From a publish acknowledged by the service to the agent's lookup answering it."""
    key = os.urandom(16)
    with MetadataClient(address) as client:
        lease, _ = client.register_node(NodeRecord("lag-node", tcp_address="127.0.0.1:1"), 60_000)
        client.publish("lag-node", lease, TENANT, [BlockEntry(key, "host", 1, 1)])
        published = time.perf_counter()
        while worker.lookup(TENANT, [key]).remote != 1:
            if time.perf_counter() - published > timeout_s:
                raise ConfigError("the agent's view did not see a publish within 10 s")
        return (time.perf_counter() - published) * 1e3


def _saved_keys(worker, payload_bytes: int) -> list[bytes]:
    keys = [os.urandom(16) for _ in range(64)]
    reservation = worker.save(TENANT, keys, payload_bytes)
    if worker.commit(reservation) != len(keys):
        raise ConfigError("the bench agent could not store its 64 local blocks")
    return keys


def _wait_for_view(worker, keys: list[bytes], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while worker.lookup(TENANT, keys).remote != len(keys):
        if time.monotonic() > deadline:
            raise ConfigError("the agent's view did not learn the published keys in time")
        time.sleep(0.05)


def _agent_p50_us(worker, keys, expected: tuple[int, int], duration_s: float) -> float:
    samples = []
    deadline = time.perf_counter() + duration_s
    while (start := time.perf_counter()) < deadline:
        counts = worker.lookup(TENANT, keys)
        samples.append(time.perf_counter() - start)
        if (counts.local, counts.remote) != expected:
            raise ConfigError(f"agent lookup gave {counts}, expected {expected}")
    return _summary(samples, duration_s)["p50_us"]


def view_bytes_per_key(num_keys: int = 200_000, num_nodes: int = 16) -> float:
    """Memory of a ClusterView per key (tracemalloc), keys spread over `num_nodes` holders."""
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    view = ClusterView("self", frozenset({"*"}), num_keys)
    for index in range(num_keys):
        key = os.urandom(16)
        view.apply("stored", TENANT, key, f"node-{index % num_nodes}", "host")
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return used / num_keys


def _publish_keys_per_s(address: str, batch: int) -> float:
    """Publish new keys in batches of `batch` (one RPC each; 512 RPCs at most) from one
    client: what batching buys per key."""
    total = min(8192, 512 * batch)
    with MetadataClient(address) as client:
        node_id = f"publisher-{batch}"
        lease, _ = client.register_node(NodeRecord(node_id, tcp_address="127.0.0.1:1"), 600_000)
        entries = [BlockEntry(os.urandom(16), "host", 1 << 20, 1) for _ in range(total)]
        started = time.perf_counter()
        for start in range(0, total, batch):
            client.publish(node_id, lease, TENANT, entries[start : start + batch])
        elapsed = time.perf_counter() - started
        client.deregister_node(node_id, lease)
    return total / elapsed


def _echo_server(queue) -> None:
    """Child: a grpc.aio server whose one method returns its request: the floor under any
    unary RPC of the metadata service on this machine."""
    import asyncio

    import grpc

    async def echo(payload: bytes, context) -> bytes:
        return payload

    async def serve() -> None:
        server = grpc.aio.server()
        handler = grpc.unary_unary_rpc_method_handler(echo)
        server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler("bench.Echo", {"Echo": handler})]
        )
        queue.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


def _echo_p50_us(payload: bytes, duration_s: float) -> float:
    """p50 of a unary gRPC echo of `payload` (a 64-key LookupRequest's size) on loopback."""
    import grpc

    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    server = context.Process(target=_echo_server, args=(queue,), daemon=True)
    server.start()
    try:
        port = queue.get(timeout=60)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/bench.Echo/Echo")
            for _ in range(20):
                call(payload, timeout=5)
            samples = []
            deadline = time.perf_counter() + duration_s
            while (start := time.perf_counter()) < deadline:
                call(payload, timeout=5)
                samples.append(time.perf_counter() - start)
        return _summary(samples, duration_s)["p50_us"]
    finally:
        server.terminate()
        server.join(timeout=10)


def run_lookup(runs: int = 5, duration_s: float = 2.0, concurrency=(1, 8, 32)) -> dict:
    """Medians over `runs` runs of each measurement; see the module docstring."""
    check_runs(runs)
    result: dict = {"runs": runs, "duration_s": duration_s}
    with peers.metadata_service() as address:
        _populate(address)
        for num_keys in (64, 512):
            single = [_summary(_latencies_s(address, num_keys, duration_s), duration_s)
                      for _ in range(runs)]  # fmt: skip
            result[f"lookup_{num_keys}_p50_us"] = statistics.median(s["p50_us"] for s in single)
            result[f"lookup_{num_keys}_p99_us"] = statistics.median(s["p99_us"] for s in single)
        for clients in concurrency:
            many = [_concurrent_run(address, 64, clients, duration_s) for _ in range(runs)]
            result[f"lookup_qps_{clients}_clients"] = statistics.median(m["qps"] for m in many)
            result[f"lookup_64_p50_us_{clients}_clients"] = statistics.median(
                m["p50_us"] for m in many
            )
            result[f"lookup_64_p99_us_{clients}_clients"] = statistics.median(
                m["p99_us"] for m in many
            )
        result.update(_agent_lookups(address, runs, duration_s))
        for batch in (1, 64, 1024):
            result[f"publish_keys_per_s_batch_{batch}"] = _publish_keys_per_s(address, batch)
    result["view_bytes_per_key"] = view_bytes_per_key()
    request = pb.LookupRequest(tenant=TENANT, keys=bench_keys(64)).SerializeToString()
    echo = [_echo_p50_us(request, duration_s) for _ in range(runs)]
    result["grpc_echo_64_p50_us"] = statistics.median(echo)
    result["lookup_64_vs_grpc_echo"] = result["lookup_64_p50_us"] / result["grpc_echo_64_p50_us"]
    redis_runs = [_redis_exists_p50_us(64, duration_s) for _ in range(runs)]
    result["redis_exists_64_p50_us"] = statistics.median(redis_runs)
    result["lookup_64_vs_redis"] = result["lookup_64_p50_us"] / result["redis_exists_64_p50_us"]
    result["machine"] = machine_info()
    return result
