"""`kvstore bench scale`: one real metadata service process under a simulated cluster: agent
processes playing `nodes` nodes preload `keys` keys, then heartbeat, publish and evict at the
Mooncake trace's per-node rates while an observer times 64-key lookups and event fan-out.
Runs in the benchmark process; stops by itself after `seconds` (preload bounded by RSS and time).
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from kvstore.bench.cluster import _die_with_parent, process_sample
from kvstore.bench.scale_sim import AgentPlan, run_agent, run_observer
from kvstore.errors import ConfigError
from kvstore.metadata.client import MetadataClient

logger = logging.getLogger(__name__)

PROJECT_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TRACE = (PROJECT_ROOT / "../shared/traces/mooncake/conversation_trace.jsonl").resolve()
RSS_SAMPLE_S = 0.5
STOP_GRACE_S = 10.0
RESULT_TIMEOUT_S = 60.0
LOOKUP_P99_LIMIT_US = 10_000  # a lookup slower than this costs more than recomputing a chunk
EVENT_LAG_P99_LIMIT_MS = 1_000
PUBLISH_RATE_FLOOR = 0.9  # achieved / target below this: publishing could not keep up


@dataclass(frozen=True)
class ScaleSpec:
    nodes: int = 100
    keys: int = 1_000_000
    seconds: float = 60.0
    backend: str = "memory"
    agent_processes: int = 3
    threads_per_agent: int = 4
    watchers: int = 2  # WatchEvents streams, in the observer process (its CPU bounds them)
    probers: int = 2
    lease_ttl_ms: int = 10_000
    max_events: int = 1_000_000  # the service's event ring: ~10 s of 1,000 nodes' events
    max_rss_mib: int = 6 * 1024  # preloading stops here (the machine is shared)
    max_preload_s: float = 900.0
    trace: Path = DEFAULT_TRACE

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.keys < self.nodes:
            raise ConfigError("need at least 1 node and at least one key per node")
        if self.seconds <= 0 or self.agent_processes < 1 or self.threads_per_agent < 1:
            raise ConfigError("seconds, agent processes and threads must be positive")
        if self.backend not in ("memory", "lmdb"):
            raise ConfigError("backend must be memory or lmdb (one real service process)")
        if not self.trace.is_file():
            raise ConfigError(f"trace {self.trace} not found (pass --trace)")


def trace_rates(path: Path) -> dict[str, float]:
    """Per-node rates, taking the trace as one node's traffic: requests/s and new keys/s (one
    key per 512-token block; a block never seen before is new)."""
    seen: set[int] = set()
    requests = new_keys = 0
    first_ms = last_ms = None
    with path.open() as lines:
        for line in lines:
            row = json.loads(line)
            requests += 1
            first_ms = row["timestamp"] if first_ms is None else first_ms
            last_ms = row["timestamp"]
            fresh = [h for h in row["hash_ids"] if h not in seen]
            seen.update(fresh)
            new_keys += len(fresh)
    span_s = max((last_ms - first_ms) / 1000, 1.0)
    return {"requests_per_s": requests / span_s, "new_keys_per_s": new_keys / span_s}


def start_service(spec: ScaleSpec, data_dir: Path) -> tuple[subprocess.Popen, str]:
    command = [
        sys.executable,
        "-m",
        "kvstore",
        "metadata",
        "--backend",
        spec.backend,
        "--listen",
        "127.0.0.1:0",
        "--data-dir",
        str(data_dir),
        "--max-watch-streams-per-tenant",
        str(spec.watchers + 4),
        "--lmdb-map-size-bytes",
        str(max(4 << 30, spec.keys * 1024)),
    ]
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=sys.stderr,
        text=True,
        preexec_fn=_die_with_parent,
        env={**os.environ, "KVSTORE_METADATA_MAX_EVENTS": str(spec.max_events)},
    )
    line = process.stdout.readline()
    if "listening on" not in line:
        process.kill()
        raise ConfigError(f"the metadata service did not start: {line!r}")
    return process, line.split("listening on ", 1)[1].split(",", 1)[0]


def rss_mib(pid: int) -> float:
    return (process_sample(pid) or {}).get("rss_mib", 0.0)


def run_scale(spec: ScaleSpec) -> dict:
    rates = trace_rates(spec.trace)
    context = multiprocessing.get_context("spawn")
    halt, steady, stop = context.Event(), context.Event(), context.Event()
    results = context.Queue()
    with tempfile.TemporaryDirectory(prefix="kvstore-scale-") as tmp:
        service, address = start_service(spec, Path(tmp) / "meta")
        try:
            return _run(spec, rates, service, address, context, (halt, steady, stop), results)
        finally:
            stop.set()
            _stop_service(service)


def _stop_service(service: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL: freeing millions of index entries can outlast the grace time."""
    service.terminate()
    try:
        service.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        service.kill()
        service.wait()


def _plans(spec: ScaleSpec, address: str, rates: dict) -> list[AgentPlan]:
    per_node = spec.keys // spec.nodes
    plans = []
    for p in range(min(spec.agent_processes, spec.nodes)):
        nodes = tuple(range(p, spec.nodes, spec.agent_processes))
        plans.append(
            AgentPlan(
                address,
                nodes,
                per_node,
                spec.lease_ttl_ms,
                rates["requests_per_s"],
                rates["new_keys_per_s"],
                spec.threads_per_agent,
            )
        )
    return plans


def _run(spec, rates, service, address, context, events, results) -> dict:
    halt, steady, stop = events
    base_mib = rss_mib(service.pid)
    plans = _plans(spec, address, rates)
    agents = [
        context.Process(target=run_agent, args=(plan, *events, results), daemon=True)
        for plan in plans
    ]
    for process in agents:
        process.start()
    preload = _preload(spec, service.pid, address, halt, results, len(agents))
    loaded_mib = rss_mib(service.pid)
    observer = context.Process(
        target=run_observer,
        args=(address, spec.probers, spec.watchers, stop, results),
        daemon=True,
    )
    observer.start()
    steady.set()
    steady_started = time.time()
    peak_mib = _sample_rss_until(service.pid, time.monotonic() + spec.seconds, stop)
    stop.set()
    reports = [_result(results) for _ in range(len(agents) + 1)]
    for process in [*agents, observer]:
        process.join(timeout=RESULT_TIMEOUT_S)
    summary = _summarize(spec, rates, preload, reports)
    summary.update(
        service_rss_base_mib=round(base_mib),
        service_rss_loaded_mib=round(loaded_mib),
        service_rss_peak_mib=round(max(peak_mib, loaded_mib)),
        bytes_per_key=_bytes_per_key(base_mib, loaded_mib, preload),
    )
    summary["broke_first"] = _broke_first(spec, summary, preload, steady_started)
    return summary


def _preload(spec: ScaleSpec, pid: int, address: str, halt, results, agents: int) -> dict:
    """Wait for every agent's preload; halt them at the RSS cap, the time bound or the first
    lease lost (a node's holdings purged: preloading further measures nothing)."""
    started, done, misses, stopped_by = time.monotonic(), 0, 0, ""
    while done < agents:
        if not stopped_by and rss_mib(pid) > spec.max_rss_mib:
            stopped_by = f"memory: service RSS passed {spec.max_rss_mib} MiB while preloading"
        if not stopped_by and time.monotonic() - started > spec.max_preload_s:
            stopped_by = f"time: preloading took over {spec.max_preload_s} s"
        if stopped_by:
            halt.set()
        try:
            kind, _, detail = results.get(timeout=RSS_SAMPLE_S)
        except queue.Empty:
            continue
        if kind == "lease_lost" and not stopped_by:
            stopped_by = "heartbeats: a lease expired while preloading (the service fell behind)"
        elif kind == "preloaded":
            done, misses = done + 1, misses + detail
    elapsed_s = time.monotonic() - started
    # What the service holds (the holdings of nodes whose lease expired are gone).
    with MetadataClient(address, timeout_s=RESULT_TIMEOUT_S) as client:
        keys = client.stats().blocks
    return {"keys": keys, "seconds": elapsed_s, "stopped_by": stopped_by, "misses": misses}


def _bytes_per_key(base_mib: float, loaded_mib: float, preload: dict) -> int | None:
    """Service RSS growth per key held; None once nodes expired while preloading (their
    purged holdings leave freed memory in the RSS, so the ratio would mean nothing)."""
    if preload["stopped_by"].startswith("heartbeats") or not preload["keys"]:
        return None
    return round((loaded_mib - base_mib) * (1 << 20) / preload["keys"])


def _sample_rss_until(pid: int, deadline: float, stop) -> float:
    peak = 0.0
    while time.monotonic() < deadline and not stop.is_set():
        peak = max(peak, rss_mib(pid))
        time.sleep(RSS_SAMPLE_S)
    return peak


def _result(results) -> tuple:
    """The next final report (late lease-lost notes from preloading are skipped)."""
    while True:
        try:
            report = results.get(timeout=RESULT_TIMEOUT_S)
        except queue.Empty:
            raise ConfigError("a simulation process sent no result (see its log)") from None
        if report[0] in ("agent", "observer"):
            return report


def _percentile(values: list[float], q: int) -> float:
    if len(values) < 2:
        return values[0] if values else 0.0
    return statistics.quantiles(values, n=100)[q - 1]


def _summarize(spec, rates, preload, reports) -> dict:
    agents = [r for r in reports if r[0] == "agent"]
    _, probe_us, probe_qps, lags_ms, tally = next(r for r in reports if r[0] == "observer")
    errors_by_kind: Counter[str] = sum(
        (Counter(r[1].pop("errors_by_kind")) for r in agents), Counter()
    )
    counts = {name: sum(r[1][name] for r in agents) for name in agents[0][1]}
    seconds = max(r[1]["steady_s"] for r in agents)  # the agents' own trace-rate phase
    request_us = [v for r in agents for v in r[2]["lookup_us"]]
    outbox_wait_ms = [v for r in agents for v in r[2]["outbox_wait_ms"]]
    target_keys_s = rates["new_keys_per_s"] * spec.nodes
    misses = [r[3] for r in agents if r[3] is not None]
    return {
        "nodes": spec.nodes,
        "keys_requested": spec.keys,
        "keys_loaded": preload["keys"],
        "backend": spec.backend,
        "seconds": round(seconds, 1),
        "trace_per_node": {k: round(v, 2) for k, v in rates.items()},
        "preload_seconds": round(preload["seconds"], 1),
        "preload_keys_per_s": round(preload["keys"] / max(preload["seconds"], 1e-9)),
        "target_publish_keys_per_s": round(target_keys_s),
        "publish_keys_per_s": round(counts["published"] / seconds),
        "evict_keys_per_s": round(counts["evicted"] / seconds),
        "publish_rate_ratio": round(counts["published"] / seconds / target_keys_s, 3),
        "target_requests_per_s": round(rates["requests_per_s"] * spec.nodes),
        "request_lookups_per_s": round(counts["request_lookups"] / seconds),
        "request_lookup_p50_us": round(_percentile(request_us, 50)),
        "request_lookup_p99_us": round(_percentile(request_us, 99)),
        "lookups_per_s": round(probe_qps),
        "lookup_64_p50_us": round(_percentile(probe_us, 50)),
        "lookup_64_p99_us": round(_percentile(probe_us, 99)),
        "watchers": spec.watchers,
        "event_ring": spec.max_events,
        "events_received": tally["events"],
        "event_gaps": tally["gaps"],
        "event_lag_p50_ms": round(_percentile(lags_ms, 50), 1),
        "event_lag_p99_ms": round(_percentile(lags_ms, 99), 1),
        # of the lag above, how long the oldest block of a publish waited in its outbox
        "outbox_wait_p50_ms": round(_percentile(outbox_wait_ms, 50), 1),
        "outbox_wait_p99_ms": round(_percentile(outbox_wait_ms, 99), 1),
        "heartbeats": counts["heartbeats"],
        "heartbeat_misses": counts["heartbeat_misses"],
        "heartbeat_misses_preloading": preload["misses"],
        "leases_lost": counts["leases_lost"],
        "errors": counts["errors"],
        "errors_by_kind": dict(errors_by_kind),
        "first_heartbeat_miss_at": min(misses) if misses else None,
        "machine": {"cpu_count": os.cpu_count(), "load_avg_1m": os.getloadavg()[0]},
    }


def _broke_first(spec, summary: dict, preload: dict, steady_started: float) -> str:
    """The first limit the run hit (preloading first, then the trace-rate phase); every limit
    hit goes to summary["limits_hit"], in that order. "nothing" if none."""
    miss_at = summary.pop("first_heartbeat_miss_at")
    hit = [preload["stopped_by"]] if preload["stopped_by"] else []
    if miss_at is not None:
        phase = "preloading" if miss_at < steady_started else "under trace load"
        hit.append(f"heartbeats: {summary['heartbeat_misses']} missed, the first while {phase}")
    if summary["publish_rate_ratio"] < PUBLISH_RATE_FLOOR:
        hit.append(
            f"publish rate: {summary['publish_keys_per_s']} of "
            f"{summary['target_publish_keys_per_s']} keys/s"
        )
    if summary["event_gaps"] or summary["event_lag_p99_ms"] > EVENT_LAG_P99_LIMIT_MS:
        hit.append(
            f"event fan-out: lag p99 {summary['event_lag_p99_ms']} ms, {summary['event_gaps']} gaps"
        )
    if summary["lookup_64_p99_us"] > LOOKUP_P99_LIMIT_US:
        hit.append(f"lookups: p99 {summary['lookup_64_p99_us']} us")
    summary["limits_hit"] = hit
    return hit[0] if hit else "nothing"
