"""The simulated side of `kvstore bench scale`: agent processes that each play many nodes
(register, heartbeat, preload, then store and evict at trace rates into each node's outbox,
flushed as a node agent's link flushes it, with request lookups on threads of their own), and
one observer process (closed-loop 64-key lookups, event watchers measuring fan-out lag).

Runs in child processes (spawn) of the benchmark process; each reports one dict on a queue.
A key is node index (4 bytes) | counter (8) | store time in ms mod 2**32 (4; 0 while preloading).
"""

from __future__ import annotations

import logging
import random
import struct
import threading
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from kvstore.bench.cluster import _die_with_parent
from kvstore.errors import KVStoreError, LeaseError, NotFoundError
from kvstore.events import BlockEvent, EventKind
from kvstore.metadata.client import MetadataClient
from kvstore.metadata.records import BlockEntry, NodeRecord
from kvstore.node.flush_pacing import FlushPacing
from kvstore.node.outbox import Batch, Outbox

logger = logging.getLogger(__name__)

TENANT = "scale"
MAX_BATCH = 4096  # the service's default max_batch
TICK_S = 0.25
REQUEST_KEYS = 24  # the trace's mean blocks per request
PROBE_KEYS = 64
HEARTBEAT_THREADS = 16
SAMPLES = 20_000  # latency samples kept per process (reservoir)
OUTBOX_EVENTS = 1 << 16  # per simulated node (a node agent's default is 1 << 18)
PACING = FlushPacing(interval_s=TICK_S)  # a node agent's link's, at the simulation's tick


def make_key(node: int, counter: int, send_ms: int) -> bytes:
    return struct.pack(">IQI", node, counter, send_ms & 0xFFFFFFFF)


def now_ms() -> int:
    return int(time.time() * 1000)


class Reservoir:
    """A bounded uniform sample of a stream of numbers (thread-safe enough: appends only)."""

    def __init__(self, size: int = SAMPLES, seed: int = 0) -> None:
        self.values: list[float] = []
        self.seen = 0
        self._size, self._rng = size, random.Random(seed)

    def add(self, value: float) -> None:
        self.seen += 1
        if len(self.values) < self._size:
            self.values.append(value)
        elif (slot := self._rng.randrange(self.seen)) < self._size:
            self.values[slot] = value


@dataclass(frozen=True)
class AgentPlan:
    address: str
    nodes: tuple[int, ...]  # global node indexes this process plays
    keys_per_node: int
    lease_ttl_ms: int
    requests_per_s: float  # per node
    new_keys_per_s: float  # per node; as many are evicted
    threads: int = 4  # for the trace-rate phase; preloading runs one batch at a time


@dataclass
class SimNode:
    index: int
    lease: int = 0
    next_counter: int = 0
    batches: deque = field(default_factory=deque)  # [first counter, count, send_ms], oldest first
    last_ok_s: float = 0.0
    publish_credit: float = 0.0
    request_credit: float = 0.0
    outbox: Outbox = field(default_factory=lambda: Outbox(OUTBOX_EVENTS))
    next_flush_s: float = 0.0

    @property
    def node_id(self) -> str:
        return f"sim-{self.index:05d}"

    def take_new(self, count: int, send_ms: int) -> list[bytes]:
        first = self.next_counter
        self.next_counter += count
        self.batches.append([first, count, send_ms])
        return [make_key(self.index, c, send_ms) for c in range(first, first + count)]

    def take_oldest(self, count: int) -> list[bytes]:
        keys: list[bytes] = []
        while count and self.batches:
            batch = self.batches[0]
            used = min(count, batch[1])
            keys += [make_key(self.index, c, batch[2]) for c in range(batch[0], batch[0] + used)]
            batch[0] += used
            batch[1] -= used
            count -= used
            if batch[1] == 0:
                self.batches.popleft()
        return keys

    def newest(self, count: int) -> list[bytes]:
        if not self.batches:
            return []
        first, size, send_ms = self.batches[-1]
        start = max(first, first + size - count)
        return [make_key(self.index, c, send_ms) for c in range(start, first + size)]


def _entries(keys: list[bytes]) -> list[BlockEntry]:
    return [BlockEntry(key, "host", 1 << 20, 0) for key in keys]


def _events(kind: EventKind, keys: list[bytes]) -> list[BlockEvent]:
    return [BlockEvent(0, kind, key, "host", 1 << 20, TENANT) for key in keys]


class Agent:
    """The nodes of one process. `halt` stops preloading, `steady` starts the trace-rate phase,
    `stop` ends it."""

    def __init__(self, plan: AgentPlan, halt, steady, stop) -> None:
        self.plan, self.halt, self.steady, self.stop = plan, halt, steady, stop
        self.results = None  # where a lease lost while preloading is reported
        self.client = MetadataClient(plan.address, timeout_s=30)
        self.nodes = [SimNode(index) for index in plan.nodes]
        self.counts = {name: 0 for name in COUNTERS}
        self.errors: Counter[str] = Counter()  # by exception class
        self.lookup_us = Reservoir(seed=plan.nodes[0] if plan.nodes else 0)
        self.outbox_wait_ms = Reservoir(seed=1 + (plan.nodes[0] if plan.nodes else 0))
        self.first_miss_s: float | None = None
        self._lock = threading.Lock()

    def count(self, name: str, by: int = 1) -> None:
        with self._lock:
            self.counts[name] += by

    def failed(self, exc: KVStoreError) -> None:
        self.count("errors")
        with self._lock:
            self.errors[type(exc).__name__] += 1

    def register(self, node: SimNode) -> None:
        record = NodeRecord(node.node_id, tcp_address=f"127.0.0.1:{node.index}")
        node.lease, _ = self.client.register_node(record, self.plan.lease_ttl_ms)
        node.last_ok_s = time.monotonic()

    def _register_again(self, node: SimNode) -> None:
        try:
            self.register(node)
        except KVStoreError as exc:  # the service is behind: the next round tries again
            self.failed(exc)

    # ---- heartbeats ------------------------------------------------------------------------
    def heartbeat_loop(self) -> None:
        """Every node every ttl/3, HEARTBEAT_THREADS at a time: real agents beat independently."""
        period_s, ttl_s = self.plan.lease_ttl_ms / 3000, self.plan.lease_ttl_ms / 1000
        with ThreadPoolExecutor(HEARTBEAT_THREADS, thread_name_prefix="heartbeat") as pool:
            while not self.stop.wait(period_s):
                list(pool.map(lambda node: self._heartbeat(node, ttl_s), self.nodes))

    def _heartbeat(self, node: SimNode, ttl_s: float) -> None:
        self.count("heartbeats")
        late = time.monotonic() - node.last_ok_s > ttl_s
        try:
            self.client.heartbeat(node.node_id, node.lease)
            node.last_ok_s = time.monotonic()
        except (LeaseError, NotFoundError):
            self.count("leases_lost")
            if not self.steady.is_set() and self.results is not None:
                self.results.put(("lease_lost", node.node_id, time.time()))
            late = True
            self._register_again(node)
        except KVStoreError:
            late = True
        if late:
            self.count("heartbeat_misses")
            if self.first_miss_s is None:
                self.first_miss_s = time.time()

    # ---- preload ---------------------------------------------------------------------------
    def preload(self, nodes: list[SimNode]) -> None:
        for node in nodes:
            while node.next_counter < self.plan.keys_per_node and not self.halt.is_set():
                count = min(MAX_BATCH, self.plan.keys_per_node - node.next_counter)
                self._publish(node, node.take_new(count, 0), "preloaded")

    def _publish(self, node: SimNode, keys: list[bytes], counter: str) -> None:
        try:
            self.client.publish(node.node_id, node.lease, TENANT, _entries(keys))
            self.count(counter, len(keys))
        except KVStoreError as exc:
            self.failed(exc)

    # ---- the trace-rate phase --------------------------------------------------------------
    def steady_loop(self, nodes: list[SimNode]) -> None:
        """Each node stores and evicts its trace rate into its outbox every tick, and flushes
        the outbox when its pacing says (as a node agent's link does)."""
        self._ticks(nodes, self._store_and_flush)

    def lookup_loop(self, nodes: list[SimNode]) -> None:
        """Each node's request lookups at its trace rate (workers ask apart from the link)."""
        rng = random.Random(nodes[0].index if nodes else 0)
        self._ticks(nodes, lambda node, elapsed_s: self._lookups(node, elapsed_s, rng))

    def _ticks(self, nodes: list[SimNode], step) -> None:
        last = time.monotonic()
        while not self.stop.is_set():
            started = time.monotonic()
            elapsed, last = started - last, started
            for node in nodes:
                if self.stop.is_set():  # a tick may outlast the run when the service lags
                    break
                step(node, elapsed)
            self.stop.wait(max(0.0, TICK_S - (time.monotonic() - started)))

    def _store_and_flush(self, node: SimNode, elapsed_s: float) -> None:
        node.publish_credit += self.plan.new_keys_per_s * elapsed_s
        count = int(node.publish_credit)
        if count:
            node.publish_credit -= count
            node.outbox.add(_events(EventKind.STORED, node.take_new(count, now_ms())))
            node.outbox.add(_events(EventKind.REMOVED, node.take_oldest(count)))
        if time.monotonic() >= node.next_flush_s:
            self._flush(node)

    def _flush(self, node: SimNode) -> None:
        started, failed = time.monotonic(), False
        while (batch := node.outbox.take(MAX_BATCH)) is not None:
            if not self._send(node, batch):
                node.outbox.restore(batch)
                failed = True
                break
        spent_s = time.monotonic() - started
        node.next_flush_s = time.monotonic() + PACING.wait_s(spent_s, failed)

    def _send(self, node: SimNode, batch: Batch) -> bool:
        keys = [event.key for event in batch.events]
        stored = batch.kind is EventKind.STORED
        if stored:  # how long its oldest block waited in the outbox
            stamp = struct.unpack(">I", keys[0][12:])[0]
            self.outbox_wait_ms.add((now_ms() - stamp) & 0xFFFFFFFF)
        call = self.client.publish if stored else self.client.unpublish
        try:
            call(node.node_id, node.lease, TENANT, _entries(keys))
        except KVStoreError as exc:
            self.failed(exc)
            return False
        self.count("published" if stored else "evicted", len(keys))
        return True

    def _lookups(self, node: SimNode, elapsed_s: float, rng: random.Random) -> None:
        node.request_credit += self.plan.requests_per_s * elapsed_s
        while node.request_credit >= 1:
            node.request_credit -= 1
            self._request_lookup(rng.choice(self.nodes))

    def _request_lookup(self, node: SimNode) -> None:
        keys = node.newest(REQUEST_KEYS)
        if not keys:  # a node preloading never reached (the RSS cap) and that published nothing
            return
        started = time.perf_counter()
        try:
            self.client.lookup(TENANT, keys)
        except KVStoreError as exc:
            self.failed(exc)
            return
        self.lookup_us.add((time.perf_counter() - started) * 1e6)
        self.count("request_lookups")


COUNTERS = (
    "heartbeats",
    "heartbeat_misses",
    "leases_lost",
    "preloaded",
    "published",
    "evicted",
    "request_lookups",
    "errors",
)


def _threads(target, groups: list) -> list[threading.Thread]:
    threads = [threading.Thread(target=target, args=(g,), daemon=True) for g in groups if g]
    for thread in threads:
        thread.start()
    return threads


def run_agent(plan: AgentPlan, halt, steady, stop, results) -> None:
    """Child process entry: register, preload (report), wait for steady, run, report."""
    _die_with_parent()
    agent = Agent(plan, halt, steady, stop)
    agent.results = results
    with ThreadPoolExecutor(HEARTBEAT_THREADS) as pool:
        list(pool.map(agent.register, agent.nodes))
    heartbeats = threading.Thread(target=agent.heartbeat_loop, daemon=True)
    heartbeats.start()
    agent.preload(agent.nodes)  # one batch in flight per process: the service's pace
    results.put(("preloaded", agent.counts["preloaded"], agent.counts["heartbeat_misses"]))
    groups = [agent.nodes[i :: plan.threads] for i in range(plan.threads)]
    steady.wait()
    started = time.monotonic()
    threads = _threads(agent.steady_loop, groups) + _threads(agent.lookup_loop, groups)
    for thread in threads:
        thread.join()
    agent.counts["steady_s"] = time.monotonic() - started
    agent.counts["errors_by_kind"] = dict(agent.errors)
    samples = {"lookup_us": agent.lookup_us.values, "outbox_wait_ms": agent.outbox_wait_ms.values}
    results.put(("agent", dict(agent.counts), samples, agent.first_miss_s))
    heartbeats.join()  # its round ends, then the stop ends it: no call on a closed channel
    agent.client.close()


def run_observer(address: str, probers: int, watchers: int, stop, results) -> None:
    """Child process entry: 64-key lookups closed-loop from `probers` threads on a probe node's
    keys, and `watchers` WatchEvents streams timing every stored event of the run."""
    _die_with_parent()
    client = MetadataClient(address, timeout_s=30)
    probe = SimNode(1 << 30)
    lease, _ = client.register_node(NodeRecord(probe.node_id), 600_000)
    keys = probe.take_new(PROBE_KEYS, 0)
    client.publish(probe.node_id, lease, TENANT, _entries(keys))
    alive = threading.Thread(target=_keep_alive, args=(client, probe.node_id, lease, stop))
    alive.daemon = True
    alive.start()
    lookups_us, lags_ms, tally = Reservoir(seed=1), Reservoir(seed=2), {"events": 0, "gaps": 0}
    started = time.monotonic()
    for _ in range(watchers):
        threading.Thread(target=_watch, args=(address, lags_ms, tally), daemon=True).start()
    prober_threads = [
        threading.Thread(target=_probe, args=(client, keys, lookups_us, stop), daemon=True)
        for _ in range(probers)
    ]
    for thread in prober_threads:
        thread.start()
    for thread in prober_threads:
        thread.join()
    elapsed_s = time.monotonic() - started
    results.put(("observer", lookups_us.values, lookups_us.seen / elapsed_s, lags_ms.values, tally))
    # a thread left waiting on `stop` when the process exits may hold its lock for good, and
    # the benchmark's own stop.set() would then wait for ever
    alive.join()


def _keep_alive(client: MetadataClient, node_id: str, lease: int, stop) -> None:
    while not stop.wait(60):
        try:
            client.heartbeat(node_id, lease)
        except KVStoreError:
            logger.warning("the probe node's heartbeat failed")


def _probe(client: MetadataClient, keys: list[bytes], samples: Reservoir, stop) -> None:
    while not stop.is_set():
        started = time.perf_counter()
        try:
            found = client.lookup(TENANT, keys).prefix_length
        except KVStoreError:
            continue
        if found == len(keys):
            samples.add((time.perf_counter() - started) * 1e6)


def _watch(address: str, lags_ms: Reservoir, tally: dict) -> None:
    with MetadataClient(address, timeout_s=30) as client:
        for event in client.watch_events(0, TENANT):
            tally["events"] += 1
            if event.kind == 3:  # KIND_GAP
                tally["gaps"] += 1
            elif event.kind == 1 and len(event.key) == 16:
                sent = struct.unpack(">I", event.key[12:])[0]
                if sent:
                    lags_ms.add((now_ms() - sent) & 0xFFFFFFFF)
