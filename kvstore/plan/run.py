"""`kvstore plan`: every candidate configuration (codec × DRAM × NVMe × nodes) replayed and
costed; the cheapest one meeting the TTFT SLA marked. Runs in the `kvstore plan` process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import product

import numpy as np

from kvstore.plan import cost
from kvstore.plan.model import ModelSpec
from kvstore.plan.options import PlanOptions
from kvstore.plan.progress import Progress, silent
from kvstore.plan.tiers import KeyedRequest, TierHits, keyed_trace, replay_tiers
from kvstore.plan.traces import PlanTrace
from kvstore.replay import TRACE_BLOCK_TOKENS


@dataclass(frozen=True)
class Candidate:
    codec: str
    dram_bytes: int
    nvme_bytes: int
    nodes: int


def candidates(options: PlanOptions) -> list[Candidate]:
    grid = product(options.codecs, options.dram_bytes, options.nvme_bytes, options.nodes)
    return [Candidate(*values) for values in grid]


class Planner:
    """Replays each distinct (host blocks, disk blocks) once; costs every candidate.

    `progress` counts requests through every pass over the trace: keying it, one replay per
    distinct store size, one costing per candidate; `run` closes it."""

    def __init__(
        self,
        trace: PlanTrace,
        model: ModelSpec,
        options: PlanOptions,
        progress: Progress | None = None,
    ):
        self.trace = trace
        self.model = model
        self.options = options
        self.progress = progress or silent()
        self.candidates = candidates(options)
        self.tokens = np.array([r.input_tokens for r in trace.requests], dtype=np.int64)
        stamps = np.array([r.timestamp_ms for r in trace.requests]) / 1000.0
        self.arrivals_s = cost.spread_ties(stamps - stamps[0])
        self.progress.start(len(self.tokens) * self.passes(), "keys")
        self.keyed = (
            keyed_trace(trace.requests, self.progress)
            if trace.has_prefix_info
            else [KeyedRequest((), (int(tokens),), 0) for tokens in self.tokens]
        )
        self._replays: dict[tuple[int, int], TierHits] = {}

    def run(self) -> dict:
        rows = []
        try:
            for number, candidate in enumerate(self.candidates, 1):
                self.progress.describe(f"config {number}/{len(self.candidates)}")
                rows.append(self.evaluate(candidate))
                self.progress.advance(len(self.tokens))
        finally:
            self.progress.close()  # an error message then starts on a line of its own
        mark_cheapest(rows)
        return self.summary(rows)

    def passes(self) -> int:
        """Passes over the trace `run` makes: keys and replays (with prefix info), costings."""
        if not self.trace.has_prefix_info:
            return len(self.candidates)
        sizes = {self.store_blocks(c) for c in self.candidates} - {(0, 0)}
        return 1 + len(sizes) + len(self.candidates)

    def store_blocks(self, candidate: Candidate) -> tuple[int, int]:
        """(host blocks, disk blocks) of a candidate's store, over all its nodes."""
        chunk_bytes = self.model.block_bytes(
            candidate.codec, self.options.tp_size, TRACE_BLOCK_TOKENS
        )
        return (
            candidate.nodes * candidate.dram_bytes // chunk_bytes,
            candidate.nodes * candidate.nvme_bytes // chunk_bytes,
        )

    def hits(self, host_blocks: int, disk_blocks: int) -> TierHits:
        """Tier hits of a store this size: replayed once per size (none without prefix info)."""
        key = (host_blocks, disk_blocks) if self.trace.has_prefix_info else (0, 0)
        if key not in self._replays:
            self._replays[key] = replay_tiers(
                self.keyed,
                *key,
                self.options.host_policy,
                self.options.disk_policy,
                self.progress,
            )
        return self._replays[key]

    def evaluate(self, candidate: Candidate) -> dict:
        options, tp = self.options, self.options.tp_size
        chunk_bytes = self.model.block_bytes(candidate.codec, tp, TRACE_BLOCK_TOKENS)
        host_blocks, disk_blocks = self.store_blocks(candidate)
        hits = self.hits(host_blocks, disk_blocks)
        times = cost.service_times(
            self.tokens,
            hits.hit_chunks,
            TRACE_BLOCK_TOKENS,
            chunk_bytes,
            options.prefill_rate(self.model),
            cost.instance_links(options, candidate.nodes),
            options.overlap,
        )
        speedup, ttft = cost.max_load_at_sla(
            self.arrivals_s, times.service_s, options.sla_ttft_s, options.sla_quantile
        )
        meets = ttft is not None
        ttft = ttft if meets else times.service_s
        return self._row(candidate, host_blocks, disk_blocks, hits, times, speedup, ttft, meets)

    def _row(self, candidate, host_blocks, disk_blocks, hits, times, speedup, ttft, meets) -> dict:
        options, span_s = self.options, max(float(self.arrivals_s[-1]), 1e-9)
        tokens_per_s = speedup * float(self.tokens.sum()) / span_s
        usd_per_s = options.tp_size * options.prices.gpu_hour / 3600.0
        usd_per_s += (
            options.prices.storage_usd_per_s(candidate.dram_bytes, candidate.nvme_bytes)
            / options.instances_per_node
        )
        per_node_req_s = speedup * len(self.tokens) / span_s * options.instances_per_node
        return {
            "codec": candidate.codec,
            "dram_gib": candidate.dram_bytes / (1 << 30),
            "nvme_gib": candidate.nvme_bytes / (1 << 30),
            "nodes": candidate.nodes,
            "host_blocks": host_blocks,
            "disk_blocks": disk_blocks,
            "token_hit_ratio": hits.token_hit_ratio,
            "host_token_hit_ratio": hits.tier_token_hit_ratio("host"),
            "disk_token_hit_ratio": hits.tier_token_hit_ratio("disk"),
            "block_hit_ratio": hits.block_hit_ratio,
            "prefill_tokens_saved_ratio": float(times.loaded_tokens.sum() / self.tokens.sum()),
            "hit_chunks_recomputed": times.recomputed_hit_chunks,
            "ttft_p50_s": float(np.quantile(ttft, 0.5)),
            "ttft_p90_s": float(np.quantile(ttft, 0.9)),
            "ttft_idle_p50_s": float(np.quantile(times.service_s, 0.5)),
            "ttft_idle_p90_s": float(np.quantile(times.service_s, 0.9)),
            "ttft_by_class": cost.class_percentiles(self.tokens, ttft),
            "ttft_at": "max load meeting the SLA" if meets else "idle instance (SLA not met)",
            "gpu_s_per_request": float(times.service_s.mean() * options.tp_size),
            "throughput_at_sla_req_s": speedup * len(self.tokens) / span_s,
            "throughput_at_sla_tokens_s": tokens_per_s,
            "nodes_for_trace_rate": (
                math.ceil(len(self.tokens) / span_s / per_node_req_s) if per_node_req_s else None
            ),
            "usd_per_mtok": usd_per_s / tokens_per_s * 1e6 if tokens_per_s else None,
            "meets_sla": meets,
            "cheapest": False,
            "_service_s": times.service_s,
        }

    def summary(self, rows: list[dict]) -> dict:
        options, model = self.options, self.model
        return {
            "trace": self.trace.path,
            "requests": len(self.tokens),
            "prompt_tokens": int(self.tokens.sum()),
            "trace_duration_s": float(self.arrivals_s[-1]),
            "sharing": self.trace.note,
            "model": model.name,
            "tp_size": options.tp_size,
            "gpus_per_node": options.gpus_per_node,
            "kv_bytes_per_token": {
                c: model.kv_bytes_per_token(c, options.tp_size) for c in options.codecs
            },
            "block_tokens": TRACE_BLOCK_TOKENS,
            "sla_ttft_s": options.sla_ttft_s,
            "sla": f"TTFT p{round(options.sla_quantile * 100)} <= {options.sla_ttft_s} s",
            "prices": vars(options.prices),
            "bandwidths_bytes_per_s": options.bandwidths,
            "prefill": vars(options.prefill_rate(model)),
            "host_policy": options.host_policy,
            "disk_policy": options.disk_policy,
            "configs": rows,
            "cheapest": next((_public(r) for r in rows if r["cheapest"]), None),
        }


def mark_cheapest(rows: list[dict]) -> None:
    feasible = [r for r in rows if r["meets_sla"] and r["usd_per_mtok"] is not None]
    if feasible:
        min(feasible, key=lambda r: r["usd_per_mtok"])["cheapest"] = True


def _public(row: dict) -> dict:
    return {name: value for name, value in row.items() if not name.startswith("_")}


def public_result(result: dict) -> dict:
    """The result without per-request arrays (what --json prints)."""
    return {**result, "configs": [_public(r) for r in result["configs"]]}
