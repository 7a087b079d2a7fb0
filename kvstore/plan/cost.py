"""From per-request tier hits to what an operator buys: per-request service time (load or
recompute, kvstore.costmodel), TTFT under load (one FIFO prefill queue per model instance),
throughput at the TTFT SLA, GPU-seconds per request and $ per million prompt tokens.
Runs in the `kvstore plan` process.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvstore.costmodel import PrefillRate, TierLink, best_load_prefix
from kvstore.plan.options import PlanOptions

REQUEST_CLASSES = (("short<4k", 0, 4096), ("medium4k-16k", 4096, 16384), ("long>=16k", 16384, None))
SEARCH_STEPS = 40


@dataclass(frozen=True)
class ServiceTimes:
    """Per request: prefill service time on an idle instance, and prompt tokens loaded."""

    service_s: np.ndarray
    loaded_tokens: np.ndarray
    recomputed_hit_chunks: int  # cached chunks predicted slower to load than to compute


def instance_links(options: PlanOptions, nodes: int) -> dict[str, TierLink]:
    """Per instance: host chunks cross PCIe; disk chunks are read then cross PCIe; with more
    nodes than one, a share (nodes-1)/nodes of every tier's chunks comes from a peer first."""
    bw, share = options.bandwidths, options.instances_per_node
    host_s = 1.0 / (bw["host"] * options.tp_size)
    disk_s = share / bw["disk"] + host_s
    remote_share = (nodes - 1) / nodes
    remote_s = share / bw["remote"]
    per_byte = {"host": host_s, "disk": disk_s}
    return {
        tier: TierLink(1.0 / (seconds + remote_share * remote_s))
        for tier, seconds in per_byte.items()
    }


def service_times(
    tokens: np.ndarray,
    hit_chunks: dict[str, np.ndarray],
    chunk_tokens: int,
    chunk_bytes: int,
    rate: PrefillRate,
    links: dict[str, TierLink],
    overlap: bool,
) -> ServiceTimes:
    """Each request loads the prefix the cost model picks (host chunks first, then disk) and
    computes the rest of its prompt."""
    service = np.empty(len(tokens))
    loaded = np.zeros(len(tokens), dtype=np.int64)
    recomputed = 0
    for number, prompt_tokens in enumerate(tokens.tolist()):
        host, disk = int(hit_chunks["host"][number]), int(hit_chunks["disk"][number])
        tiers = ["host"] * host + ["disk"] * disk
        sizes = [min(chunk_tokens, prompt_tokens - i * chunk_tokens) for i in range(len(tiers))]
        count, service[number] = best_load_prefix(
            tiers, sizes, chunk_bytes, prompt_tokens, rate, links, overlap
        )
        loaded[number] = sum(sizes[:count])
        recomputed += len(tiers) - count
    return ServiceTimes(service, loaded, recomputed)


def spread_ties(arrivals_s: np.ndarray) -> np.ndarray:
    """Requests sharing a timestamp (a trace logged at coarse resolution) spread evenly up to
    the next distinct timestamp, so a speed-up of the arrivals can separate them."""
    spread = arrivals_s.astype(float).copy()
    distinct, starts, counts = np.unique(arrivals_s, return_index=True, return_counts=True)
    last_gap = float(np.median(np.diff(distinct))) if len(distinct) > 1 else 0.0
    gaps = np.diff(distinct, append=distinct[-1] + last_gap)
    for start, count, gap in zip(starts.tolist(), counts.tolist(), gaps.tolist(), strict=True):
        spread[start : start + count] += np.arange(count) * gap / count
    return spread


def queue_ttft_s(arrivals_s: np.ndarray, service_s: np.ndarray) -> np.ndarray:
    """TTFT of each request in one FIFO prefill queue (Lindley's recursion)."""
    ttft = np.empty(len(service_s))
    free_at = -np.inf
    for index, (arrival, service) in enumerate(
        zip(arrivals_s.tolist(), service_s.tolist(), strict=True)
    ):
        start = max(arrival, free_at)
        free_at = start + service
        ttft[index] = free_at - arrival
    return ttft


def max_load_at_sla(
    arrivals_s: np.ndarray, service_s: np.ndarray, sla_s: float, quantile: float
) -> tuple[float, np.ndarray | None]:
    """The largest speed-up of the trace's arrivals that one instance serves with the TTFT
    quantile within `sla_s`, and the TTFTs there; (0, None) if even an idle one cannot."""
    if np.quantile(service_s, quantile) > sla_s:
        return 0.0, None
    span_s = max(float(arrivals_s[-1] - arrivals_s[0]), 1e-9)
    low, high = 0.0, span_s / max(float(service_s.sum()), 1e-12)  # high: utilisation 1
    best = None
    for _ in range(SEARCH_STEPS):
        middle = (low + high) / 2
        ttft = queue_ttft_s(arrivals_s / middle, service_s) if middle > 0 else service_s
        if np.quantile(ttft, quantile) <= sla_s:
            low, best = middle, ttft
        else:
            high = middle
    return low, (best if best is not None else service_s)


def class_percentiles(tokens: np.ndarray, ttft_s: np.ndarray) -> dict[str, dict[str, float]]:
    """TTFT p50/p90 per request class (prompt length bucket)."""
    result = {}
    for name, low, high in REQUEST_CLASSES:
        mask = (tokens >= low) & (tokens < (high or np.iinfo(np.int64).max))
        if mask.any():
            values = ttft_s[mask]
            result[name] = {
                "requests": int(mask.sum()),
                "ttft_p50_s": float(np.quantile(values, 0.5)),
                "ttft_p90_s": float(np.quantile(values, 0.9)),
            }
    return result
