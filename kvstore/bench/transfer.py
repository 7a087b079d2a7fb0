"""`kvstore bench transfer`: block get/put throughput on every data path, each beside the limit
of the machine measured in the same run: (a) worker <-> local agent through the shared arena vs
numpy.copyto of the same bytes between the same kinds of memory, in turns with it (and the
copy loop of kvstore._copyhash without its hash, where it outruns libc's memcpy); (b) agent <-
remote agent over tcp, run by run beside a raw socket sendall/recv_into (with each end's CPU
seconds per GiB), and (c) over ucx; (d) Redis pipelined SET/MGET (redis-py + hiredis) as the
baseline.

Runs in the benchmark process; every holder, agent and server is a separate child process.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from kvstore._copyhash import plain_copy
from kvstore.bench import peers
from kvstore.bench.timing import check_runs, gbps, machine_info
from kvstore.block import HEADER_BYTES
from kvstore.client import KVStoreClient
from kvstore.eviction import make_policy
from kvstore.keys import BlockKey
from kvstore.kvcopy.verified import copy_and_checksum
from kvstore.store import TieredStore, TierSlot
from kvstore.tiers.host import HostTier
from kvstore.transfer.base import make_engine

MIB = 1 << 20
BATCH = 64


def _keys(run: int, count: int) -> list[BlockKey]:
    return [BlockKey((run * 1_000_000 + i).to_bytes(16, "little")) for i in range(count)]


def _median_gbps(seconds: list[float], total_bytes: int) -> float:
    return gbps(total_bytes, statistics.median(seconds))


# ---- (a) shared memory: worker <-> local agent ------------------------------------------------
def shm_results(block_bytes: int, batch: int, runs: int, access: str = "shared") -> dict:
    """Save and load through a local agent: a shared worker writes and reads arena pages in
    place (copy + checksum in one pass each way); a private one (another tenant's worker on a
    shared host) goes through its own buffer, and the agent copies. Beside the shared rounds,
    in turns, the same copies without the store: the source into `batch` pages of shared
    memory, the kind an arena is (4 KiB pages), and each page into the same destination."""
    source = torch.randint(0, 256, (block_bytes,), dtype=torch.uint8)
    destination = torch.zeros_like(source)
    pages = peers.shared_pages(batch, block_bytes) if access == "shared" else None
    with tempfile.TemporaryDirectory() as directory:
        flags = _private_flags(Path(directory), block_bytes * batch) if access == "private" else ()
        with (
            peers.node_agent(Path(directory), block_bytes + HEADER_BYTES, batch, *flags) as path,
            KVStoreClient(path, "bench") as client,
        ):
            assert client.access == access, f"the agent granted {client.access}, not {access}"
            samples, limits = [], []
            for run in range(runs + 1):  # the first of each warms up (page faults): dropped
                samples.append(_shm_round(client, _keys(run, batch), source, destination))
                if pages is not None:
                    limits.append(_memcpy_s(source, destination, pages))
    total = block_bytes * batch
    prefix = "shm" if access == "shared" else "shm_private"
    result = {
        f"{prefix}_put_GBps": _median_gbps([put for put, _ in samples[1:]], total),
        f"{prefix}_get_GBps": _median_gbps([get for _, get in samples[1:]], total),
    }
    if pages is not None:
        result["memcpy_put_GBps"] = _median_gbps([limit[0] for limit in limits[1:]], total)
        result["memcpy_GBps"] = _median_gbps([limit[1] for limit in limits[1:]], total)
        result["copy_kernel_GBps"] = _median_gbps([limit[2] for limit in limits[1:]], total)
    return result


def _private_flags(directory: Path, buffer_bytes: int) -> tuple[str, ...]:
    table = directory / "workers.conf"
    table.write_text(f"uid:{os.getuid()} bench private\n")
    return ("--worker-credentials", str(table), "--private-buffer-bytes", str(buffer_bytes))


def _shm_round(client, keys, source, destination) -> tuple[float, float]:
    started = time.perf_counter()
    reservation = client.save("bench", keys, source.numel())
    checksums = [copy_and_checksum(view, source) for view in reservation.payloads]
    client.commit(reservation, checksums=checksums)
    put_s = time.perf_counter() - started
    started = time.perf_counter()
    loaded = client.load("bench", keys, verify=False)  # verified as copied, below
    verified = all(loaded.copy_to(index, destination) for index in range(len(loaded)))
    client.release(loaded)
    get_s = time.perf_counter() - started
    assert len(loaded) == len(keys) and verified, f"loaded {len(loaded)} of {len(keys)}"
    return put_s, get_s


def _memcpy_s(source: torch.Tensor, destination: torch.Tensor, pages: np.ndarray):
    """(put s, get s, kernel get s): plain numpy.copyto of `source` into each page and of
    each page into `destination`, a round's bytes between the same kinds of memory without
    the store; then the get again through the copy loop of kvstore._copyhash without its hash
    (on CPUs where it outruns libc's memcpy, the stricter limit)."""
    started = time.perf_counter()
    for page in pages:
        np.copyto(page, source.numpy())
    put_s = time.perf_counter() - started
    started = time.perf_counter()
    for page in pages:
        np.copyto(destination.numpy(), page)
    get_s = time.perf_counter() - started
    started = time.perf_counter()
    for page in pages:
        plain_copy(destination.numpy(), page)
    return put_s, get_s, time.perf_counter() - started


# ---- (b, c) between agents -------------------------------------------------------------------
def remote_results(engine_name: str, block_bytes: int, batch: int, runs: int) -> dict[str, float]:
    """Reader-side fetch of `batch` blocks from a holder process, authenticated with a cluster
    secret as between real agents: received straight into arena pages with each block's MAC
    verified, checksummed, committed; then dropped for the next run."""
    page_bytes = block_bytes + HEADER_BYTES
    keys = _keys(0, batch)
    secret = os.urandom(32)
    with peers.block_holder(engine_name, block_bytes, batch, secret) as address:
        engine = make_engine(engine_name, cluster_secret=secret)
        store = TieredStore(
            [TierSlot(HostTier(batch * page_bytes, page_bytes), make_policy("lru"))]
        )
        try:
            seconds = [_fetch_s(engine, store, address, keys) for _ in range(runs + 1)][1:]
        finally:
            engine.close()
            store.close()
    return {f"{engine_name}_get_GBps": _median_gbps(seconds, page_bytes * batch)}


def _fetch_s(engine, store: TieredStore, address: str, keys: list[BlockKey]) -> float:
    pages = [store.reserve_page(key) for key in keys]
    checksums = [None] * len(keys)  # the tcp engine hashes each payload as it lands
    started = time.perf_counter()
    received = engine.fetch(address, peers.TENANT, keys, pages, 120, checksums)
    committed = sum(
        store.commit_received(key, size, checksum)
        for key, size, checksum in zip(keys, received, checksums, strict=True)
        if size
    )
    elapsed = time.perf_counter() - started
    if committed != len(keys):
        raise AssertionError(f"only {committed} of {len(keys)} blocks arrived intact")
    store.remove(keys)
    return elapsed


def tcp_vs_socket_results(block_bytes: int, batch: int, runs: int) -> dict[str, float]:
    """(b) beside its limit, round by round: with a holder and a raw sender both up, each run
    fetches the batch over the authenticated tcp engine, then recv_into's it raw; the ratio is
    the median of the runs' ratios (a loaded machine slows both alike), and each end's CPU
    seconds per GiB say what the data plane costs whatever the scheduler does.

    The baseline moves the same bytes between comparable memory, and nothing else: the raw
    sender sends `batch` distinct pages (as cold as the holder's arena pages, not one hot
    buffer again) with plain sendall, and the receiver recv_into's `batch` distinct pages (as
    the reader's arena pages), both in shared memory with 4 KiB pages like an arena's (measured
    here: the same CPU per GiB as numpy's huge-paged arrays). What tcp adds on top is the
    data plane's own cost: the handshake, framing, deadlines, a GMAC per block at each end
    and, at the reader, the xxh3 the store checks (hashed as the bytes land), commit included.
    On a loaded machine the ratio tends to the ratio of both ends' CPU seconds per GiB."""
    page_bytes = block_bytes + HEADER_BYTES
    gib = page_bytes * batch / (1 << 30)
    keys, secret = _keys(0, batch), os.urandom(32)
    raw_pages = peers.shared_pages(batch, page_bytes)
    rows = []
    with (
        _child(peers.raw_sender(page_bytes, batch)) as (conn, sender),
        _child(peers.block_holder("tcp", block_bytes, batch, secret)) as (address, holder),
    ):
        engine = make_engine("tcp", cluster_secret=secret)
        store = TieredStore(
            [TierSlot(HostTier(batch * page_bytes, page_bytes), make_policy("lru"))]
        )
        try:
            for run in range(runs + 1):  # the first run of each warms up
                tcp = _cpu_s(holder, lambda: _fetch_s(engine, store, address, keys))
                raw = _cpu_s(sender, lambda: peers.raw_receive_s(conn, raw_pages))
                if run:
                    rows.append((tcp, raw))
        finally:
            engine.close()
            store.close()
    median = statistics.median
    return {
        "tcp_get_GBps": _median_gbps([tcp[0] for tcp, _ in rows], page_bytes * batch),
        "socket_GBps": _median_gbps([raw[0] for _, raw in rows], page_bytes * batch),
        "tcp_get_vs_socket": median(raw[0] / tcp[0] for tcp, raw in rows),
        "tcp_reader_cpu_s_per_GiB": median(tcp[1] for tcp, _ in rows) / gib,
        "tcp_holder_cpu_s_per_GiB": median(tcp[2] for tcp, _ in rows) / gib,
        "socket_receiver_cpu_s_per_GiB": median(raw[1] for _, raw in rows) / gib,
        "socket_sender_cpu_s_per_GiB": median(raw[2] for _, raw in rows) / gib,
    }


@contextlib.contextmanager
def _child(peer):
    """Enter a peers.* context that starts one child process; yields (its value, its pid)."""
    before = {child.pid for child in multiprocessing.active_children()}
    with peer as value:
        (pid,) = {child.pid for child in multiprocessing.active_children()} - before
        yield value, pid


def _cpu_s(pid: int, timed) -> tuple[float, float, float]:
    """`timed()`'s seconds, this process's CPU seconds and child `pid`'s meanwhile."""
    own, other = time.process_time(), _process_cpu_s(pid)
    seconds = timed()
    return seconds, time.process_time() - own, _process_cpu_s(pid) - other


def _process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` (/proc/PID/stat utime, stime)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---- (d) Redis -----------------------------------------------------------------------------
def redis_results(block_bytes: int, batch: int, runs: int) -> dict[str, float]:
    payload = np.random.default_rng(0).integers(0, 256, block_bytes, dtype=np.uint8).tobytes()
    keys = [f"block:{i}" for i in range(batch)]
    set_s, get_s = [], []
    with peers.redis_server() as client:
        for _ in range(runs + 1):
            started = time.perf_counter()
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.set(key, payload)
            pipe.execute()
            set_s.append(time.perf_counter() - started)
            started = time.perf_counter()
            values = client.mget(keys)
            get_s.append(time.perf_counter() - started)
            assert all(len(v) == block_bytes for v in values)
            del values
    total = block_bytes * batch
    return {
        "redis_put_GBps": _median_gbps(set_s[1:], total),
        "redis_get_GBps": _median_gbps(get_s[1:], total),
    }


# ---- all together ----------------------------------------------------------------------------
def run_transfer(runs: int = 5, sizes_mib=(4, 16), batch: int = BATCH, ucx: bool = True) -> dict:
    check_runs(runs)
    multiprocessing.set_start_method("spawn", force=True)
    result: dict = {"runs": runs, "batch": batch}
    for size_mib in sizes_mib:
        block_bytes = size_mib * MIB
        measured = {}
        measured.update(shm_results(block_bytes, batch, runs))
        measured.update(shm_results(block_bytes, batch, runs, access="private"))
        measured.update(tcp_vs_socket_results(block_bytes, batch, runs))
        if ucx:
            measured.update(remote_results("ucx", block_bytes, batch, runs))
        measured.update(redis_results(block_bytes, batch, runs))
        measured["shm_get_vs_memcpy"] = measured["shm_get_GBps"] / measured["memcpy_GBps"]
        measured["shm_get_vs_copy_kernel"] = measured["shm_get_GBps"] / measured["copy_kernel_GBps"]
        measured["shm_put_vs_memcpy"] = measured["shm_put_GBps"] / measured["memcpy_put_GBps"]
        measured["private_get_vs_shared"] = (
            measured["shm_private_get_GBps"] / measured["shm_get_GBps"]
        )
        measured["tcp_get_vs_redis"] = measured["tcp_get_GBps"] / measured["redis_get_GBps"]
        result.update({f"{name}_{size_mib}MiB": value for name, value in measured.items()})
        if size_mib == max(sizes_mib):
            result.update(measured)  # the largest block size is also reported unsuffixed
    result["machine"] = machine_info()
    return result
