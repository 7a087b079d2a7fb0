"""Eviction sweep: each policy's hit ratio at each capacity on a time slice of a Mooncake trace,
as a fraction of Belady's (through the real replay), and each policy's own time per block access.

Runs in the CLI's process: `kvstore bench eviction --trace T --slice-from 0.5 --json`.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

from kvstore.eviction import make_policy
from kvstore.keys import BlockKey
from kvstore.replay import TraceKeyer, load_trace, run_replay


def trace_slice(trace: str, start: float, stop: float, into: Path) -> Path:
    """Write the requests from fraction `start` to `stop` of the trace (in arrival order) to
    `into`, as a Mooncake trace; output lengths are dropped (the replay does not read them)."""
    requests = load_trace(trace)
    chosen = requests[round(start * len(requests)) : round(stop * len(requests))]
    with open(into, "w", encoding="utf-8") as out:
        for request in chosen:
            record = {
                "timestamp": request.timestamp_ms,
                "input_length": request.input_tokens,
                "output_length": 0,
                "hash_ids": list(request.hash_ids),
            }
            out.write(json.dumps(record) + "\n")
    return into


def hit_ratios(trace: str, policies: list[str], capacities: list[int]) -> list[dict]:
    """Block hit ratio of every policy at every capacity, and its fraction of Belady's."""
    rows = []
    for capacity in capacities:
        oracle = run_replay(trace, "belady", capacity, progress=False)["block_hit_ratio"]
        for policy in policies:
            ratio = run_replay(trace, policy, capacity, progress=False)["block_hit_ratio"]
            rows.append(
                {
                    "policy": policy,
                    "capacity_blocks": capacity,
                    "block_hit_ratio": round(ratio, 4),
                    "belady_block_hit_ratio": round(oracle, 4),
                    "x_belady": round(ratio / oracle, 3) if oracle else None,
                }
            )
    return rows


def ns_per_access(trace: str, policies: list[str], capacity: int, runs: int) -> dict[str, int]:
    """Median over `runs` (the policies taking turns, so a busy machine slows all alike) of the
    nanoseconds each policy alone spends per block of the trace."""
    keyer = TraceKeyer()
    requests_keys = [keyer.keys(request) for request in load_trace(trace)]
    timings: dict[str, list[float]] = {policy: [] for policy in policies}
    for _ in range(runs):
        for policy in policies:
            timings[policy].append(_ns_per_block(requests_keys, policy, capacity))
    return {policy: round(statistics.median(times)) for policy, times in timings.items()}


def _ns_per_block(requests_keys: list[list[BlockKey]], policy: str, capacity: int) -> float:
    """Touches of the resident prefix, then victim + remove + insert per stored block: what
    the replay asks of the policy, without the store around it."""
    evictor = make_policy(policy)
    started = time.perf_counter_ns()
    for keys in requests_keys:
        hits = 0
        while hits < len(keys) and keys[hits] in evictor:
            evictor.touch(keys[hits])
            hits += 1
        for index in range(hits, len(keys)):
            if keys[index] in evictor:
                continue
            if len(evictor) >= capacity:
                evictor.remove(evictor.victim(lambda _: True))
            evictor.insert(keys[index], keys[index - 1] if index else None)
    return (time.perf_counter_ns() - started) / sum(len(keys) for keys in requests_keys)


def run_eviction(
    trace: str,
    policies: tuple[str, ...],
    capacities: tuple[int, ...],
    slice_from: float = 0.0,
    slice_to: float = 1.0,
    timing_capacity: int = 10_000,
    timing_runs: int = 3,
) -> dict:
    """Hit ratios (and × Belady) of `policies` at `capacities` on the requests from fraction
    `slice_from` to `slice_to` of `trace`, and each policy's nanoseconds per block access."""
    with tempfile.TemporaryDirectory() as folder:
        sliced = str(trace_slice(trace, slice_from, slice_to, Path(folder) / "slice.jsonl"))
        return {
            "trace": trace,
            "slice": [slice_from, slice_to],
            "hit_ratios": hit_ratios(sliced, list(policies), list(capacities)),
            "ns_per_access": ns_per_access(sliced, list(policies), timing_capacity, timing_runs),
        }
