"""`kvstore bench soak`: the chaos cluster without kills, under a steady mixed save / load /
lookup load (a target rate per worker), sampled from /proc every few seconds: RSS, threads and
open file descriptors of every process, and the bytes of /dev/shm. Reports per role (sums over
its processes) the first and last values and the least-squares slope per hour, fitted after a
warm-up (the first fifth of the run, at most 30 s); `rss_anon` (private memory) shows leaks,
`rss` also counts the arena pages a process touched. Runs in the benchmark process.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

from kvstore.bench.chaos import Tally, lost_blocks, sleep_watching, stop_workers
from kvstore.bench.cluster import (
    Cluster,
    ClusterSpec,
    isolate_shm,
    process_sample,
    shm_sample,
    work_directory,
)

logger = logging.getLogger(__name__)
ROLES = ("metadata", "agent", "worker")


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


def sample(cluster: Cluster) -> dict[str, float]:
    """One row: per role and per process, the sum of each metric; and /dev/shm."""
    row: Counter[str] = Counter()
    for name, member in cluster.members.items():
        found = process_sample(member.process.pid) if member.process else None
        for metric, value in (found or {}).items():
            row[f"{member.role}.{metric}"] += value
            row[f"process:{name}.{metric}"] += value
    for metric, value in shm_sample(cluster.all_pids()).items():
        row[f"shm.{metric}"] = value
    return dict(row)


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
        summary.setdefault(group, {}).update({
            f"{metric}_first": round(values[0], 3), f"{metric}_last": round(values[-1], 3),
            f"{unit}_slope{suffix}": round(slope_per_hour(fitted_s, values), 3),
        })  # fmt: skip
    return summary


def _per_process(summary: dict[str, dict]) -> dict[str, dict]:
    return {n.removeprefix("process:"): s for n, s in summary.items() if n.startswith("process:")}


def run_soak(
    minutes: float, ops_per_s: float = 20.0, sample_s: float = 5.0, shared_shm: bool = False
) -> dict:
    """Run the soak benchmark (see `run_chaos` about the private /dev/shm)."""
    private_shm = not shared_shm and isolate_shm()
    tally, crashes = Tally(), Counter()
    times_s, rows = [], []
    with work_directory("kvstore-soak-") as workdir:
        spec = ClusterSpec(workdir, minutes * 60, ops_per_s=ops_per_s)
        sample_s = min(sample_s, max(0.5, spec.duration_s / 10))
        with Cluster(spec, tally.handle) as cluster:
            deadline = cluster.started + spec.duration_s
            while (now := time.monotonic()) < deadline:
                times_s.append(now - cluster.started)
                rows.append(sample(cluster))
                sleep_watching(cluster, min(deadline, now + sample_s), crashes)
            times_s.append(time.monotonic() - cluster.started)
            rows.append(sample(cluster))
            stuck = stop_workers(cluster)
            audit = lost_blocks(cluster, tally)
        child_pids = cluster.all_pids()
    summary = summarize(times_s, rows, warmup_s=min(30.0, spec.duration_s / 5))
    totals = tally.totals()
    return {
        "operations": totals["ops"], "errors": totals["errors"] + sum(crashes.values()),
        "ops_per_s": round(totals["ops"] / spec.duration_s, 2),
        "target_ops_per_s": ops_per_s * len(cluster.names("worker")), **totals,
        "wrong_results": totals["wrong_results"], "crashes": dict(crashes), "stuck_workers": stuck,
        "lost_blocks": audit["lost_blocks"], "lost_blocks_checked": audit["lost_blocks_checked"],
        "roles": {role: summary.get(role, {}) for role in ROLES}, "shm": summary.get("shm", {}),
        "processes": _per_process(summary),
        "samples": len(rows), "private_shm": private_shm, "child_pids": child_pids,
        "minutes": minutes,
    }  # fmt: skip
