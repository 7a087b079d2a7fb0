"""kvstore's counters inside vLLM's own metrics. `KVStoreConnectorStats` carries each step's
deltas (and latency samples) from the workers and the scheduler to vLLM's stat loggers;
`KVStorePromMetrics` shows them on the engine's /metrics as `vllm:kvstore_*`, beside vLLM's own.
Stats are built in the scheduler and worker processes; the Prometheus side runs where vLLM's
stat loggers run (the API server or LLM process).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvstore.tier import ANSWER_NAMES

COUNTERS = {  # name in the connector halves' stats -> what it counts
    "lookups": "Prompt lookups answered by the kvstore node agent",
    "lookup_failures": "Lookups that failed (agent unreachable or erroring); computed instead",
    "lookups_deferred": "Times vLLM was told to ask again: the request's lookup was in flight",
    "hit_tokens": "Prompt tokens loaded from kvstore beyond vLLM's own prefix cache",
    "prefetched_blocks": "Blocks pulled from other hosts into this host before their load",
    "promoted_blocks": "Blocks promoted from this host's disk tier to its arena before their load",
    "recomputed_chunks": "Cached chunks computed instead: predicted slower to load than compute",
    "loaded_blocks": "kvstore blocks loaded into vLLM's KV cache and verified",
    "loaded_bytes": "Bytes of KV loaded from kvstore",
    "helper_loaded_blocks": "kvstore blocks a CPU load helper copied (its chunk layers / layers)",
    "saved_blocks": "kvstore blocks saved from vLLM's KV cache",
    "saved_bytes": "Bytes of KV saved to kvstore",
    "load_failures": "kvstore blocks that could not be loaded (recomputed)",
    "save_failures": "kvstore blocks that could not be saved",
    "verify_failures": "kvstore blocks whose checksum failed as they were copied (recomputed)",
    "saves_dropped_after_load_errors": "kvstore blocks not saved: computed over a failed load",
    "saves_out_of_window": "Requests whose later chunks went unsaved: sliding-window KV freed",
}
BYPASS_PREFIX = "bypassed_"  # bypassed_<reason>: requests the store neither loads nor saves
TIER_PREFIX = "hit_tokens_"  # hit_tokens_<tier>: hit tokens found in host, disk or remote
HIT_TIERS = ANSWER_NAMES
LATENCIES = {  # sample name -> what one sample measures, in seconds
    "lookup_seconds": "Time of one kvstore prompt lookup, from its start to its answer (staged)",
    "match_seconds": "Time vLLM's scheduler waited in one kvstore get_num_new_matched_tokens",
    "load_fetch_seconds": "Time a step's kvstore loads waited for the agent's pins (worker)",
    "load_wait_seconds": "Time a step's forward waited for kvstore layer loads (worker)",
    "save_seconds": "Time a step's kvstore saves took to commit at the end of the step (worker)",
}
SAMPLES_MAX = 4096  # per latency per interval; later samples of a burst are dropped
BUCKETS_S = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]


@dataclass
class KVStoreConnectorStats(KVConnectorStats):
    """data = {"counters": {name: number}, "samples": {name: [seconds, ...]}}: counters sum,
    samples concatenate (bounded) when workers' and the scheduler's stats are aggregated."""

    def __post_init__(self) -> None:
        if "counters" not in self.data:
            self.reset()

    def reset(self) -> None:
        self.data = {"counters": {}, "samples": {}}

    def add(self, counters: dict[str, float], samples: dict[str, list[float]]) -> None:
        for name, value in counters.items():
            if value:
                self.data["counters"][name] = self.data["counters"].get(name, 0) + value
        for name, values in samples.items():
            kept = self.data["samples"].setdefault(name, [])
            kept.extend(values[: max(0, SAMPLES_MAX - len(kept))])

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not other.is_empty():
            self.add(other.data.get("counters", {}), other.data.get("samples", {}))
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = dict(self.data["counters"])
        for name, values in self.data["samples"].items():
            if values:
                out[f"{name}_avg"] = round(sum(values) / len(values), 6)
                out[f"{name}_max"] = round(max(values), 6)
        return out

    def is_empty(self) -> bool:
        return not self.data["counters"] and not any(self.data["samples"].values())


class DeltaCounters:
    """Turns a connector half's cumulative counters into the increments since the last take."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def take(self, cumulative: dict[str, float]) -> dict[str, float]:
        deltas = {}
        for name, value in cumulative.items():
            if name in COUNTERS or name.startswith((BYPASS_PREFIX, TIER_PREFIX)):
                deltas[name] = value - self._last.get(name, 0)
                self._last[name] = value
        return deltas


class KVStorePromMetrics(KVConnectorPromMetrics):
    """vllm:kvstore_<counter>_total, vllm:kvstore_bypassed_requests_total{reason},
    vllm:kvstore_hit_tokens_by_tier_total{tier} and the vllm:kvstore_<latency> histograms,
    one child per engine (vLLM's engine labels)."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: self._counter_cls(
                name=f"vllm:kvstore_{name}", documentation=doc, labelnames=labelnames
            )
            for name, doc in COUNTERS.items()
        }
        self._bypassed = self._counter_cls(
            name="vllm:kvstore_bypassed_requests",
            documentation="Requests kvstore neither loads nor saves, by reason (multimodal, ...)",
            labelnames=[*labelnames, "reason"],
        )
        self._by_tier = self._counter_cls(
            name="vllm:kvstore_hit_tokens_by_tier",
            documentation="Prompt tokens loaded from kvstore by the tier they were found in: "
            "host (this host's arena), disk (its disk tier), remote (another host)",
            labelnames=[*labelnames, "tier"],
        )
        self._latencies = {
            name: self._histogram_cls(
                name=f"vllm:kvstore_{name}",
                documentation=doc,
                buckets=BUCKETS_S,
                labelnames=labelnames,
            )
            for name, doc in LATENCIES.items()
        }
        for labels in per_engine_labelvalues.values():  # shown (at 0) from the start
            for metric in (*self._counters.values(), *self._latencies.values()):
                metric.labels(*labels)
            for tier in HIT_TIERS:
                self._by_tier.labels(*labels, tier)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for name, value in transfer_stats_data.get("counters", {}).items():
            if name in self._counters:
                self._counters[name].labels(*labels).inc(value)
            elif name.startswith(BYPASS_PREFIX):
                reason = name.removeprefix(BYPASS_PREFIX)
                self._bypassed.labels(*labels, reason).inc(value)
            elif name.startswith(TIER_PREFIX):
                self._by_tier.labels(*labels, name.removeprefix(TIER_PREFIX)).inc(value)
        for name, values in transfer_stats_data.get("samples", {}).items():
            if name in self._latencies:
                histogram = self._latencies[name].labels(*labels)
                for value in values:
                    histogram.observe(value)


class LatencySamples:
    """Latency samples of one connector half since the last take (bounded per name)."""

    def __init__(self) -> None:
        self._samples: dict[str, list[float]] = {}

    def add(self, name: str, seconds: float) -> None:
        kept = self._samples.setdefault(name, [])
        if len(kept) < SAMPLES_MAX:
            kept.append(seconds)

    def take(self) -> dict[str, list[float]]:
        samples, self._samples = self._samples, {}
        return samples
