"""`kvstore bench soak`: the chaos cluster without kills, under a steady mixed save / load /
lookup load (a target rate per worker), sampled from /proc every few seconds: RSS, threads and
open file descriptors of every process, and the bytes of /dev/shm. Reports per role (sums over
its processes) the first and last values and the least-squares slope per hour, fitted after a
warm-up (the first fifth of the run, at most 30 s); `rss_anon` (private memory) shows leaks,
`rss` also counts the arena pages a process touched. The metadata service keeps its newest
`max_events` index events (its event ring): until the ring is full its RSS grows by design, so
`metadata_ring` says when it filled and its bound in MiB, and the metadata service's slopes are
also fitted after the fill (`..._after_fill`). Runs in the benchmark process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import secrets
import time
import tracemalloc
from collections import Counter
from collections.abc import Iterator

from kvstore.bench.chaos import Tally, lost_blocks, sleep_watching, stop_workers
from kvstore.bench.cluster import (
    Cluster,
    ClusterSpec,
    isolate_shm,
    process_sample,
    shm_sample,
    work_directory,
)
from kvstore.errors import ConfigError, KVStoreError
from kvstore.metadata.client import MetadataClient
from kvstore.metadata.index.ring import EventRing
from kvstore.metadata.records import IndexEvent

logger = logging.getLogger(__name__)
ROLES = ("metadata", "agent", "worker")
MAX_EVENTS_ENV = "KVSTORE_METADATA_MAX_EVENTS"  # the metadata service's event ring size
RING_SLOPES = ("rss_slope_mib_per_hour", "rss_anon_slope_mib_per_hour")


def slope_per_hour(times_s: list[float], values: list[float]) -> float:
    """Least-squares slope of values over time, per hour; 0.0 with fewer than two samples."""
    n = len(times_s)
    if n < 2:
        return 0.0
    mean_t, mean_v = sum(times_s) / n, sum(values) / n
    spread = sum((t - mean_t) ** 2 for t in times_s)
    if spread == 0:
        return 0.0
    covariance = sum((t - mean_t) * (v - mean_v) for t, v in zip(times_s, values, strict=True))
    return covariance / spread * 3600


def sample(cluster: Cluster, metadata=None) -> dict[str, float]:
    """One row: per role and per process, the sum of each metric; /dev/shm; and the events
    the metadata service emitted, asked through `metadata` (a MetadataClient) if given."""
    row: Counter[str] = Counter()
    for name, member in cluster.members.items():
        found = process_sample(member.process.pid) if member.process else None
        for metric, value in (found or {}).items():
            row[f"{member.role}.{metric}"] += value
            row[f"process:{name}.{metric}"] += value
    for metric, value in shm_sample(cluster.all_pids()).items():
        row[f"shm.{metric}"] = value
    if metadata is not None:
        with contextlib.suppress(KVStoreError):  # silent: no count in this row
            row["ring.events_emitted"] = metadata.stats().last_event_seq
    return dict(row)


def default_max_events() -> int:
    from kvstore.metadata.server.server import MetadataConfig

    return next(f.default for f in dataclasses.fields(MetadataConfig) if f.name == "max_events")


def ring_bytes_per_event(events: int = 20_000) -> float:
    """Python heap bytes (tracemalloc) an EventRing keeps per event, its slot included, for
    events shaped as the service makes them (a 16-byte key, tenant and node id decoded afresh
    per event: an upper bound, since one request's events share them). Run before any thread
    of ours starts (tracemalloc counts every thread's allocations)."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        ring = EventRing(events)
        for seq in range(1, events + 1):
            tenant, node_id = b"chaos".decode(), b"agent-1".decode()
            ring.append(IndexEvent(seq, "stored", tenant, secrets.token_bytes(16), node_id, "host"))
        return (tracemalloc.get_traced_memory()[0] - before) / events
    finally:
        tracemalloc.stop()


@contextlib.contextmanager
def ring_size(max_events: int) -> Iterator[int]:
    """Children started inside get a metadata event ring of `max_events` (0: the service's
    setting or default, unchanged); yields the ring size the service will use."""
    if max_events < 0:
        raise ConfigError("metadata_max_events must be 0 (the default) or positive")
    previous = os.environ.get(MAX_EVENTS_ENV)
    if max_events:
        os.environ[MAX_EVENTS_ENV] = str(max_events)
    try:
        yield int(os.environ.get(MAX_EVENTS_ENV) or default_max_events())
    finally:
        if previous is None:
            os.environ.pop(MAX_EVENTS_ENV, None)
        else:
            os.environ[MAX_EVENTS_ENV] = previous


def summarize(times_s: list[float], rows: list[dict], warmup_s: float) -> dict:
    """First and last value after the warm-up, and the slope per hour fitted to the samples
    after it, of every series in `rows`, grouped by its prefix."""
    fitted = [i for i, t in enumerate(times_s) if t >= warmup_s] or list(range(len(times_s)))
    summary: dict[str, dict] = {}
    for series in sorted({name for row in rows for name in row}):
        group, metric = series.rsplit(".", 1)
        values = [rows[i].get(series, 0.0) for i in fitted]
        fitted_s = [times_s[i] for i in fitted]
        unit = metric.removesuffix("_mib")
        suffix = "_mib_per_hour" if metric.endswith("mib") else "_per_hour"
        summary.setdefault(group, {}).update(
            {
                f"{metric}_first": round(values[0], 3),
                f"{metric}_last": round(values[-1], 3),
                f"{unit}_slope{suffix}": round(slope_per_hour(fitted_s, values), 3),
            }
        )
    return summary


def ring_report(
    times_s: list[float], rows: list[dict], max_events: int, bytes_per_event: float
) -> tuple[dict, dict[str, dict]]:
    """The event ring's fill (when its events reached `max_events`) and bound, and the
    RING_SLOPES of the metadata role and process fitted after the fill (None: it never filled,
    or fewer than 3 samples came after)."""
    emitted = [
        (t, row["ring.events_emitted"])
        for t, row in zip(times_s, rows, strict=True)
        if "ring.events_emitted" in row
    ]
    full_at_s = next((t for t, count in emitted if count >= max_events), None)
    later = {}
    if full_at_s is not None and sum(t >= full_at_s for t in times_s) >= 3:
        later = summarize(times_s, rows, warmup_s=full_at_s)
    slopes = {
        group: {f"{name}_after_fill": later.get(group, {}).get(name) for name in RING_SLOPES}
        for group in ("metadata", "process:metadata")
    }
    report = {
        "max_events": max_events,
        "events_emitted": emitted[-1][1] if emitted else None,
        "full_at_s": None if full_at_s is None else round(full_at_s, 1),
        "bytes_per_event": round(bytes_per_event),
        "bound_mib": round(max_events * bytes_per_event / 2**20, 1),
    }
    return report, slopes


def _per_process(summary: dict[str, dict]) -> dict[str, dict]:
    return {n.removeprefix("process:"): s for n, s in summary.items() if n.startswith("process:")}


def run_soak(
    minutes: float,
    ops_per_s: float = 20.0,
    sample_s: float = 5.0,
    shared_shm: bool = False,
    metadata_max_events: int = 0,
) -> dict:
    """Run the soak benchmark (see `run_chaos` about the private /dev/shm); a positive
    `metadata_max_events` sizes the metadata service's event ring (0: its default)."""
    bytes_per_event = ring_bytes_per_event()
    private_shm = not shared_shm and isolate_shm()
    tally, crashes = Tally(), Counter()
    times_s, rows = [], []
    with (
        ring_size(metadata_max_events) as max_events,
        work_directory("kvstore-soak-") as workdir,
    ):
        spec = ClusterSpec(workdir, minutes * 60, ops_per_s=ops_per_s)
        sample_s = min(sample_s, max(0.5, spec.duration_s / 10))
        with (
            Cluster(spec, tally.handle) as cluster,
            MetadataClient(cluster.metadata_address, timeout_s=2) as metadata,  # one channel
        ):
            deadline = cluster.started + spec.duration_s
            while (now := time.monotonic()) < deadline:
                times_s.append(now - cluster.started)
                rows.append(sample(cluster, metadata))
                sleep_watching(cluster, min(deadline, now + sample_s), crashes)
            times_s.append(time.monotonic() - cluster.started)
            rows.append(sample(cluster, metadata))
            stuck = stop_workers(cluster)
            audit = lost_blocks(cluster, tally)
        child_pids = cluster.all_pids()
    summary = summarize(times_s, rows, warmup_s=min(30.0, spec.duration_s / 5))
    ring, after_fill = ring_report(times_s, rows, max_events, bytes_per_event)
    for group, slopes in after_fill.items():
        summary.setdefault(group, {}).update(slopes)
    ring.update(summary.pop("ring", {}))
    totals = tally.totals()
    return {
        "operations": totals["ops"],
        "errors": totals["errors"] + sum(crashes.values()),
        "ops_per_s": round(totals["ops"] / spec.duration_s, 2),
        "target_ops_per_s": ops_per_s * len(cluster.names("worker")),
        **totals,
        "wrong_results": totals["wrong_results"],
        "crashes": dict(crashes),
        "stuck_workers": stuck,
        "lost_blocks": audit["lost_blocks"],
        "lost_blocks_checked": audit["lost_blocks_checked"],
        "roles": {role: summary.get(role, {}) for role in ROLES},
        "shm": summary.get("shm", {}),
        "metadata_ring": ring,
        "processes": _per_process(summary),
        "samples": len(rows),
        "private_shm": private_shm,
        "child_pids": child_pids,
        "minutes": minutes,
    }
