"""`kvstore bench lookup`: latency and throughput of prompt lookups against a metadata service
it starts on loopback (a separate process), on its lookup port (the client's way; the
client's gRPC ways, LookupStream calls and unary Lookups, beside it), beside pipelined Redis
EXISTS of the same keys and the machine's echo floors (raw TCP, gRPC); a
worker's lookups through its node agent (another process, answering from its cluster view) for
all-local, all-remote and all-absent prompts (with the client's default wait, polling for the
answer before sleeping, and with a client that sleeps at once), each beside a raw unix-socket
round trip between two processes waiting the same way (the floor under them); the view's
bytes per key; publish batching; the idle 64-key lookup on each backend (BACKENDS: services
on a redis-server and on a 3-master Redis Cluster started here, one slot and sharded).

Runs in the benchmark process; clients for the concurrent runs are separate processes so the
service, not the client's GIL, is what is measured. They share the machine's cores with the
service (on 2 cores they compete for them): the service's CPU per lookup is reported beside qps,
and the echo floor (kvstore/bench/grpc_floor.py) is measured under the same clients.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import statistics
import tempfile
import time
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvstore.bench import peers
from kvstore.bench.grpc_floor import (
    READY_TIMEOUT_S,
    concurrent_run,
    echo_floor,
    summary,
    timed_calls,
    unix_socket_floor_p50_us,
)
from kvstore.bench.redis_cluster_procs import RedisClusterProcesses
from kvstore.bench.timing import check_runs, machine_info
from kvstore.errors import ConfigError
from kvstore.framing import LENGTH_BYTES
from kvstore.metadata.client import MetadataClient
from kvstore.metadata.records import BlockEntry, NodeRecord
from kvstore.node.view import ClusterView
from kvstore.v1 import agent_pb2 as agent_pb
from kvstore.v1 import metadata_pb2 as pb

TENANT = "bench"
PREFIX_KEYS = 512
QPS_CLIENTS = 8  # the client processes of the issue's qps goal
_CONCURRENT_FIELDS = (
    ("qps", "lookup_qps_{}_clients"),
    ("p50_us", "lookup_64_p50_us_{}_clients"),
    ("p99_us", "lookup_64_p99_us_{}_clients"),
    ("server_cpu_us_per_call", "lookup_server_cpu_us_{}_clients"),
)


def bench_keys(count: int = PREFIX_KEYS) -> list[bytes]:
    return [index.to_bytes(16, "little") for index in range(count)]


# the idle 64-key lookup on each (BACKEND_ARGS: how its service is started)
BACKENDS = ("memory", "lmdb", "redis", "redis-cluster", "redis-cluster-sharded")


def _populate(address: str) -> None:
    """PREFIX_KEYS keys of one chain, naming their anchor (a sharded index keeps them on one
    shard, as agents that name anchors would)."""
    keys = bench_keys()
    with MetadataClient(address, timeout_s=60.0) as client:  # a loaded machine's slow start
        lease, _ = client.register_node(
            NodeRecord("bench-node", tcp_address="127.0.0.1:1"), 600_000
        )
        entries = [
            BlockEntry(key, "host", 1 << 20, 1, b"" if i == 0 else keys[1])
            for i, key in enumerate(keys)
        ]
        client.publish("bench-node", lease, TENANT, entries)


@contextmanager
def _service(*args: str) -> Iterator[tuple[str, int]]:
    """A metadata service process on a free loopback port (LMDB, or `args`); yields (address,
    its pid)."""
    with (
        tempfile.TemporaryDirectory() as data_dir,
        peers.cli_process(
            "metadata",
            *(args or ("--backend", "lmdb", "--data-dir", data_dir)),
            "--listen",
            "127.0.0.1:0",
            ready="listening on",
        ) as (process, line),
    ):
        yield line.split("listening on ", 1)[1].split(",", 1)[0], process.pid


@contextmanager
def _backend_service(backend: str) -> Iterator[str]:
    """A metadata service on `backend` (BACKENDS), its Redis started here; yields its address."""
    with contextlib.ExitStack() as stack:
        if backend in ("memory", "lmdb"):
            args = ("--backend", backend, "--data-dir", stack.enter_context(_temporary_dir()))
        elif backend == "redis":
            port = stack.enter_context(peers.redis_server()).connection_pool.connection_kwargs
            args = ("--backend", "redis", "--redis-url", f"redis://127.0.0.1:{port['port']}/0")
        else:
            cluster = RedisClusterProcesses(Path(stack.enter_context(_temporary_dir())))
            stack.callback(cluster.stop)
            cluster.start()
            shards = "0" if backend.endswith("-sharded") else "1"
            args = ("--backend", "redis-cluster", "--redis-url", cluster.url)
            args += ("--redis-shards", shards)
        address, _ = stack.enter_context(_service(*args))
        yield address


def _temporary_dir():
    return tempfile.TemporaryDirectory(prefix="kvstore-bench-")


def run_backend_lookups(runs: int, duration_s: float, backends=BACKENDS) -> dict:
    """The idle 64-key lookup of one client on each backend, on the lookup port and as a
    unary Lookup: medians over `runs` of each run's p50 and p99; the port's p50 and p99 on
    each backend over the memory backend's."""
    result: dict = {f"backend_lookup_64_{name}_us": {} for name in ("p50", "p99", "unary_p50")}
    for backend in backends:
        with _backend_service(backend) as address:
            _populate(address)
            port = [summary(_latencies_s(address, 64, duration_s), duration_s) for _ in range(runs)]
            unary = [
                summary(_latencies_s(address, 64, duration_s, way="unary"), duration_s)
                for _ in range(runs)
            ]
        result["backend_lookup_64_p50_us"][backend] = statistics.median(s["p50_us"] for s in port)
        result["backend_lookup_64_p99_us"][backend] = statistics.median(s["p99_us"] for s in port)
        result["backend_lookup_64_unary_p50_us"][backend] = statistics.median(
            s["p50_us"] for s in unary
        )
    if "memory" in backends:
        for quantile in ("p50", "p99"):
            by_backend = result[f"backend_lookup_64_{quantile}_us"]
            result[f"backend_lookup_64_{quantile}_vs_memory"] = {
                backend: latency / by_backend["memory"] for backend, latency in by_backend.items()
            }
    result["load_avg_1m"] = os.getloadavg()[0]
    return result


# how a client asks: on the lookup port (its way, where the service has one); on LookupStream
# calls (where it has none, or the client wants gRPC); unary Lookups
WAYS = ("port", "stream", "unary")


def _latencies_s(
    address: str, num_keys: int, duration_s: float, start=None, way: str = "port"
) -> list[float]:
    """Timed lookups of one client, asked `way` (WAYS)."""
    keys = bench_keys(num_keys)

    def lookup() -> None:
        found = client.lookup(TENANT, keys).prefix_length
        if found != num_keys:
            raise ConfigError(f"lookup found {found} of {num_keys} keys")

    with MetadataClient(
        address, lookup_port=way == "port", lookup_streams=way != "unary"
    ) as client:
        client.wait_ready(READY_TIMEOUT_S)
        return timed_calls(lookup, duration_s, start)


def _client_process(
    address: str, num_keys: int, way: str, duration_s: float, start, results
) -> None:
    """Child of concurrent_run: lookups of `num_keys` keys asked `way`; puts the samples."""
    results.put(_latencies_s(address, num_keys, duration_s, start, way))


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
    return summary(samples, duration_s)["p50_us"]


def _agent_lookups(address: str, runs: int, duration_s: float) -> dict:
    """p50 of a 64-key lookup through a node agent's control socket, per kind of prompt: with
    the client's default wait (it polls for the answer before sleeping) and, beside it, a
    client that sleeps at once; each beside its floor, a raw round trip waiting the same way."""
    from kvstore.client import DEFAULT_ANSWER_SPIN_US, KVStoreClient  # torch: not in clients

    page_bytes = 64 << 10
    with (
        tempfile.TemporaryDirectory() as directory,
        peers.node_agent(
            Path(directory),
            page_bytes,
            128,
            "--metadata-address",
            address,
            "--transfer",
            "tcp",
            "--cluster-secret-file",
            str(peers.secret_file(Path(directory))),
        ) as socket_path,
        KVStoreClient(socket_path, "bench") as worker,
        KVStoreClient(socket_path, "bench-sleeps", answer_spin_us=0) as sleeper,
    ):
        prompts = {
            "local": _saved_keys(worker, page_bytes // 2),
            "remote": bench_keys(64),
            "absent": [os.urandom(16) for _ in range(64)],
        }
        _wait_for_view(worker, prompts["remote"])
        result = {"agent_lookup_64_p50_us": {}, "agent_lookup_64_blocking_p50_us": {}}
        for kind, keys in prompts.items():
            expected = {"local": (64, 0), "remote": (0, 64), "absent": (0, 0)}[kind]
            for name, client in (("", worker), ("_blocking", sleeper)):
                p50s = [_agent_p50_us(client, keys, expected, duration_s) for _ in range(runs)]
                result[f"agent_lookup_64{name}_p50_us"][f"all_{kind}"] = statistics.median(p50s)
        lags_ms = sorted(_view_lag_ms(address, worker) for _ in range(20))
        result["agent_view"] = json.loads(worker.stats())["view"]
    floor = functools.partial(_agent_floor_p50_us, prompts["local"], runs, duration_s)
    return result | {
        "agent_lookup_floor_p50_us": floor(DEFAULT_ANSWER_SPIN_US / 1e6),
        "agent_lookup_floor_blocking_p50_us": floor(0.0),
        "view_lag_p50_ms": lags_ms[len(lags_ms) // 2],
        "view_lag_max_ms": lags_ms[-1],
    }


def _agent_floor_p50_us(keys: list[bytes], runs: int, duration_s: float, spin_s: float) -> float:
    """A raw unix-socket round trip with the bytes of a 64-key agent lookup and its answer."""
    request = agent_pb.AgentRequest(
        request_id=1, lookup=agent_pb.LookupKeysRequest(tenant=TENANT, keys=keys)
    )
    response = agent_pb.AgentResponse(request_id=1)
    response.lookup.local_hits, response.lookup.tiers = len(keys), b"h" * len(keys)
    framed = LENGTH_BYTES + response.ByteSize()
    return unix_socket_floor_p50_us(
        LENGTH_BYTES + request.ByteSize(), framed, runs, duration_s, spin_s
    )


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
    return summary(samples, duration_s)["p50_us"]


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


def run_lookup(runs: int = 5, duration_s: float = 2.0, concurrency=(1, 8, 32)) -> dict:
    """Medians over `runs` runs of each measurement; see the module docstring."""
    check_runs(runs)
    result: dict = {"runs": runs, "duration_s": duration_s}
    with _service() as (address, pid):
        _populate(address)
        result.update(_service_lookups(address, pid, runs, duration_s, concurrency))
        result.update(_agent_lookups(address, runs, duration_s))
        for batch in (1, 64, 1024):
            result[f"publish_keys_per_s_batch_{batch}"] = _publish_keys_per_s(address, batch)
    result["view_bytes_per_key"] = view_bytes_per_key()
    result.update(run_backend_lookups(runs, duration_s))
    clients = min(QPS_CLIENTS, max(concurrency))
    result.update(_floors(runs, duration_s, clients))
    for floor in ("tcp_echo", "grpc_echo", "grpc_stream_echo"):
        result[f"lookup_64_vs_{floor}"] = result["lookup_64_p50_us"] / result[f"{floor}_64_p50_us"]
        if f"lookup_qps_{clients}_clients" in result:
            result[f"lookup_qps_vs_{floor}_{clients}_clients"] = (
                result[f"lookup_qps_{clients}_clients"] / result[f"{floor}_qps_{clients}_clients"]
            )
    result["lookup_64_vs_redis"] = result["lookup_64_p50_us"] / result["redis_exists_64_p50_us"]
    result["machine"] = machine_info()
    return result


def _service_lookups(address: str, pid: int, runs: int, duration_s: float, concurrency) -> dict:
    """On the lookup port: latency with one client; qps, latency and the service's CPU per
    lookup with each number of client processes. Beside them, for the gRPC ways: latency, and
    qps and service CPU with the qps goal's clients."""
    result = {}
    for num_keys in (64, 512):
        single = [
            summary(_latencies_s(address, num_keys, duration_s), duration_s) for _ in range(runs)
        ]
        result[f"lookup_{num_keys}_p50_us"] = statistics.median(s["p50_us"] for s in single)
        result[f"lookup_{num_keys}_p99_us"] = statistics.median(s["p99_us"] for s in single)
    for clients in concurrency:
        many = [
            concurrent_run(_client_process, (address, 64, "port"), clients, duration_s, pid)
            for _ in range(runs)
        ]
        for field, name in _CONCURRENT_FIELDS:
            result[name.format(clients)] = statistics.median(m[field] for m in many)
    clients = min(QPS_CLIENTS, max(concurrency))
    for way in WAYS[1:]:
        single = [
            summary(_latencies_s(address, 64, duration_s, way=way), duration_s)["p50_us"]
            for _ in range(runs)
        ]
        result[f"lookup_{way}_64_p50_us"] = statistics.median(single)
        many = [
            concurrent_run(_client_process, (address, 64, way), clients, duration_s, pid)
            for _ in range(runs)
        ]
        result[f"lookup_{way}_qps_{clients}_clients"] = statistics.median(m["qps"] for m in many)
        result[f"lookup_{way}_server_cpu_us_{clients}_clients"] = statistics.median(
            m["server_cpu_us_per_call"] for m in many
        )
    return result


def _floors(runs: int, duration_s: float, clients: int) -> dict:
    """The gRPC echo floor and Redis beside the lookups of `result`, measured after them."""
    request = pb.LookupRequest(tenant=TENANT, keys=bench_keys(64)).SerializeToString()
    result = echo_floor(request, runs, duration_s, clients)
    result["qps_note"] = (
        f"client processes share this machine's {os.cpu_count()} CPUs with the server; "
        "tcp_echo_qps_*_clients is the most round trips an asyncio server (the lookup port's "
        "kind) answers here with those clients, grpc_echo_qps_* the most unary RPCs, "
        "grpc_stream_echo_qps_* the most messages on open streams (lookup_stream_* and "
        "lookup_unary_* are the service's on those gRPC ways); 1e6 / lookup_server_cpu_us_* "
        "is the lookups one server core could answer"
    )
    redis_runs = [_redis_exists_p50_us(64, duration_s) for _ in range(runs)]
    result["redis_exists_64_p50_us"] = statistics.median(redis_runs)
    return result
