"""`kvstore bench shards`: publish throughput on a real 3-master Redis Cluster (started here),
the one-slot index (S = 1) beside the sharded one (S = 12), with each master's CPU per key; and
64-key lookup latency of each, at the index (no service). docs/scale.md has its figures.

Runs in the CLI's process, with writer processes of its own and the cluster's redis-servers.

Writers are processes, each its own index (as service replicas would be), publishing 4,096-entry
batches of anchored 8-key chains whose depth-0 keys are 8 (most prompts share their first)."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from kvstore.bench.redis_cluster_procs import RedisClusterProcesses
from kvstore.metadata.index.redis_index import RedisIndex
from kvstore.metadata.index.redis_shards import ShardedRedisIndex
from kvstore.metadata.index.shard_map import ROOT
from kvstore.metadata.records import BlockEntry, NodeRecord

BATCH, CHAIN, ROOTS = 4096, 8, 8


def batches(seed: str):
    """Endless publish batches of fresh chains."""
    n = 0
    while True:
        out = []
        for c in range(BATCH // CHAIN):
            root = hashlib.blake2b(f"root/{c % ROOTS}".encode(), digest_size=16).digest()
            keys = [root]
            parent = hashlib.blake2b(f"{seed}/{n}/{c}".encode(), digest_size=16).digest()
            for i in range(1, CHAIN):
                parent = hashlib.blake2b(parent + bytes([i]), digest_size=16).digest()
                keys.append(parent)
            out += [
                BlockEntry(k, "host", 1 << 20, 1, b"" if i == 0 else keys[1])
                for i, k in enumerate(keys)
            ]
        n += 1
        yield out


def chain(name: str, length: int) -> list[bytes]:
    """A prompt's chained keys: key_i = H(key_{i-1} || name/i)."""
    keys, parent = [], hashlib.blake2b(b"namespace", digest_size=16).digest()
    for i in range(length):
        parent = hashlib.blake2b(parent + f"{name}/{i}".encode(), digest_size=16).digest()
        keys.append(parent)
    return keys


def anchored(keys: list[bytes], tier: str = "host") -> list[BlockEntry]:
    """Entries as an agent that knows the chain sends them: depth 0 a root, then keys[1]."""
    return [
        BlockEntry(key, tier, 10, 1, ROOT if depth == 0 else keys[1])
        for depth, key in enumerate(keys)
    ]


def writer(url: str, prefix: str, shards: int, seconds: float, queue) -> None:
    if shards == 1:
        index = RedisIndex(url, prefix=prefix, cluster=True)
    else:
        index = ShardedRedisIndex(url, prefix=prefix, cluster=True, shards=shards)
    node = f"n-{os.getpid()}"
    lease = index.register_node(NodeRecord(node), 600_000).lease_id
    gen = batches(node)
    done, start = 0, time.monotonic()
    while time.monotonic() - start < seconds:
        batch = next(gen)
        index.publish(node, lease, "t", batch)
        done += len(batch)
    elapsed = time.monotonic() - start
    index.events_since(0, 0)  # relays what is left
    queue.put((done, elapsed))
    index.close()


def master_cpu_s(cluster: RedisClusterProcesses) -> dict[int, float]:
    """Each master's CPU seconds so far (INFO cpu: user + sys), by port."""
    out = {}
    for port in cluster.running():
        with cluster._client(port) as client:
            if client.info("replication")["role"] != "master":
                continue
            cpu = client.info("cpu")
            out[port] = cpu["used_cpu_user"] + cpu["used_cpu_sys"]
    return out


def run(cluster: RedisClusterProcesses, shards: int, writers: int, seconds: float) -> dict:
    prefix = f"bench-{uuid.uuid4().hex[:6]}"
    queue = mp.Queue()
    procs = [
        mp.Process(target=writer, args=(cluster.url, prefix, shards, seconds, queue))
        for _ in range(writers)
    ]
    before = master_cpu_s(cluster)
    for p in procs:
        p.start()
    results = [queue.get() for _ in procs]
    for p in procs:
        p.join()
    after = master_cpu_s(cluster)
    keys = sum(done for done, _ in results)
    cpu = sorted((round(after[p] - before[p], 2) for p in after), reverse=True)
    return {
        "shards": shards,
        "writers": writers,
        "keys": keys,
        "keys_per_s": round(keys / max(elapsed for _, elapsed in results)),
        "master_cpu_s": cpu,
        "busiest_master_cpu_us_per_key": round(cpu[0] / keys * 1e6, 1),
    }


def lookups(cluster: RedisClusterProcesses, shards: int, prompts: int = 50) -> dict:
    """p50 / p99 of 64-key lookups of held prompts, one thread, index level (no service)."""
    prefix = f"lookup-{uuid.uuid4().hex[:6]}"
    if shards == 1:
        index = RedisIndex(cluster.url, prefix=prefix, cluster=True)
    else:
        index = ShardedRedisIndex(cluster.url, prefix=prefix, cluster=True, shards=shards)
    lease = index.register_node(NodeRecord("n1"), 600_000).lease_id
    chains = [chain(f"{prefix}-{i}", 64) for i in range(prompts)]
    for keys in chains:
        index.publish("n1", lease, "t", anchored(keys))
    took = []
    for _ in range(20):
        for keys in chains:
            started = time.perf_counter()
            assert len(index.lookup("t", keys)) == 64
            took.append(time.perf_counter() - started)
    index.close()
    took.sort()
    return {
        "shards": shards,
        "lookups": len(took),
        "p50_us": round(took[len(took) // 2] * 1e6),
        "p99_us": round(took[len(took) * 99 // 100] * 1e6),
    }


def run_shards(seconds: float = 10.0, writers: int = 4, shards: int = 12, runs: int = 2) -> dict:
    """Alternating runs of the one-slot and the sharded index: publish keys/s with `writers`
    processes for `seconds` each, then lookup latency; medians of keys/s per layout."""
    cluster = RedisClusterProcesses(Path(tempfile.mkdtemp()), masters=3)
    cluster.start()
    try:
        publish = [run(cluster, s, writers, seconds) for _ in range(runs) for s in (1, shards)]
        lookup = [lookups(cluster, s) for _ in range(runs) for s in (1, shards)]
    finally:
        cluster.stop()
    rates = {
        s: statistics.median(r["keys_per_s"] for r in publish if r["shards"] == s)
        for s in (1, shards)
    }
    return {
        "publish": publish,
        "lookup": lookup,
        "sharded_vs_one_slot_keys_per_s": round(rates[shards] / rates[1], 2),
    }
