"""`kvstore bench lookup`: latency and throughput of prompt lookups against a metadata service
it starts on loopback (a separate process), beside pipelined Redis EXISTS of the same keys.

Runs in the benchmark process; clients for the concurrent runs are separate processes so the
service, not the client's GIL, is what is measured.
"""

from __future__ import annotations

import multiprocessing
import statistics
import time

from kvstore.bench import peers
from kvstore.bench.timing import check_runs, machine_info
from kvstore.errors import ConfigError
from kvstore.metadata.client import MetadataClient
from kvstore.metadata.index import BlockEntry, NodeRecord

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
    samples = [s for _ in workers for s in queue.get(timeout=duration_s + 120)]
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
    redis_runs = [_redis_exists_p50_us(64, duration_s) for _ in range(runs)]
    result["redis_exists_64_p50_us"] = statistics.median(redis_runs)
    result["lookup_64_vs_redis"] = result["lookup_64_p50_us"] / result["redis_exists_64_p50_us"]
    result["machine"] = machine_info()
    return result
