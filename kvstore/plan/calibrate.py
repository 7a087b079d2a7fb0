"""Calibration of the cost model on a live engine: prefill time vs prompt length (fixed, linear
and attention's quadratic term), what a save costs, what loading cached chunks costs, and how
much slower than its fitted speed the shared machine ran at each moment of the run.
Runs in the `kvstore plan --validate` process; fits numbers it is given, measures nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvstore.costmodel import PrefillRate, TierLink, fit_nonnegative

WARMUP_LENGTHS = (256, 1024, 2048, 4096) * 2  # an engine's first runs are slower
MEDIAN_FIT_ROUNDS = 30
SPEED_NEIGHBOURS = 6  # cold runs whose median ratio gives the machine's slowdown at a run
SPEED_ROUNDS = 4  # alternations of (fit the rate on de-trended times, re-measure the slowdown)


@dataclass(frozen=True)
class Calibration:
    """What the validation predicts with, on a steady machine (this one at its median speed
    over the run): the engine's prefill rate; `save_s`, what a prompt that stores a new chunk
    pays once beyond its tokens (the connector's commit, and vLLM's delayed free of the
    request's blocks; prompts that store none, fully loaded or under a chunk, are measured
    not to pay it); the host-tier link; and `slowdown[i]`: how much slower than that the
    machine ran at run i, measured by the cold runs nearest to it (other tenants' load)."""

    rate: PrefillRate
    save_s: float
    link: TierLink
    slowdown: np.ndarray

    def ttft_s(self, tokens: int, loaded_chunks: int, chunk_tokens: int, chunk_bytes: int) -> float:
        """Steady-machine TTFT of a prompt whose first `loaded_chunks` chunks are loaded."""
        cached = loaded_chunks * chunk_tokens
        load_s = self.link.latency_s + self.link.load_s(loaded_chunks * chunk_bytes)
        seconds = self.rate.compute_s(tokens - cached, cached) + (load_s if cached else 0.0)
        return seconds + (self.save_s if saves(tokens, loaded_chunks, chunk_tokens) else 0.0)


def saves(tokens, loaded_chunks, chunk_tokens: int):
    """Whether the connector stores a chunk of the prompt: a full one beyond those loaded."""
    return tokens // chunk_tokens > loaded_chunks


def engine_layout_bytes(dims: dict, chunk_tokens: int, itemsize: int = 4) -> int:
    """Payload bytes of one chunk of the engine's KV (float32 by default)."""
    layers, heads, head_dim = dims["num_layers"], dims["num_kv_heads"], dims["head_dim"]
    return layers * 2 * chunk_tokens * heads * head_dim * itemsize


def calibrate(
    lengths: np.ndarray,
    cached: np.ndarray,
    seconds: np.ndarray,
    cold: np.ndarray,
    hit: np.ndarray,
    chunk_tokens: int,
    chunk_bytes: int,
) -> Calibration:
    """Per run (in the order run): prompt tokens, tokens served from the store, TTFT; `cold`
    marks runs of fresh prompts (nothing cached), `hit` runs of a prompt stored just before.
    The rate is fitted on cold runs' times divided by the machine's slowdown at each, and the
    slowdown re-measured against that rate, until they settle; the link on hit runs likewise."""
    slowdown = np.ones(len(seconds))
    positions = np.flatnonzero(cold)
    for _ in range(SPEED_ROUNDS):
        rate, save_s = fit_cold(lengths[cold], (seconds / slowdown)[cold], chunk_tokens)
        fitted = [
            rate.compute_s(int(n)) + save_s * saves(n, 0, chunk_tokens) for n in lengths[cold]
        ]
        slowdown = machine_slowdown(positions, seconds[cold] / np.array(fitted), len(seconds))
        slowdown /= np.median(slowdown[cold])  # 1: the machine's median speed over the run
    steady = seconds / slowdown
    save_paid = save_s * saves(lengths, cached // chunk_tokens, chunk_tokens)
    hits = [
        (int(lengths[i]), int(cached[i]), float(steady[i] - save_paid[i]))
        for i in np.flatnonzero(hit)
    ]
    link = fit_load_link(rate, hits, chunk_tokens, chunk_bytes)
    return Calibration(rate, save_s, link, slowdown)


def machine_slowdown(positions: np.ndarray, ratios: np.ndarray, runs: int) -> np.ndarray:
    """For each of `runs` runs, the median measured/fitted ratio of the SPEED_NEIGHBOURS cold
    runs nearest to it in run order (at `positions`)."""
    count = min(SPEED_NEIGHBOURS, len(positions))
    distance = np.abs(np.arange(runs)[:, None] - positions[None, :])
    nearest = np.argsort(distance, axis=1, kind="stable")[:, :count]
    return np.median(ratios[nearest], axis=1)


def fit_cold(
    lengths: np.ndarray, seconds: np.ndarray, chunk_tokens: int
) -> tuple[PrefillRate, float]:
    """`fit_prefill` with one more term: the save every prompt of a full chunk or more pays."""
    n = np.asarray(lengths, dtype=float)
    columns = {**_prefill_columns(n), "save_s": saves(n, 0, chunk_tokens).astype(float)}
    values = _median_fit(columns, np.asarray(seconds, dtype=float))
    save_s = values.pop("save_s")
    return PrefillRate(**values), save_s


def fit_prefill(lengths: list[int], seconds: list[float]) -> PrefillRate:
    """Median regression (iteratively reweighted least squares) over t = fixed + a n +
    b n (n + 1) / 2, every term non-negative: the time a typical prompt of each length takes on
    this machine, which a busy machine's stalls do not drag up."""
    columns = _prefill_columns(np.array(lengths, dtype=float))
    return PrefillRate(**_median_fit(columns, np.array(seconds, dtype=float)))


def _prefill_columns(n: np.ndarray) -> dict[str, np.ndarray]:
    return {"fixed_s": np.ones_like(n), "per_token_s": n, "per_token_pair_s": n * (n + 1) / 2}


def _median_fit(columns: dict[str, np.ndarray], seconds: np.ndarray) -> dict[str, float]:
    weights = np.ones_like(seconds)
    for _ in range(MEDIAN_FIT_ROUNDS):
        weighted = {name: column * weights for name, column in columns.items()}
        values = fit_nonnegative(weighted, seconds * weights)
        predicted = sum(values[name] * column for name, column in columns.items())
        weights = 1.0 / np.sqrt(np.maximum(np.abs(seconds - predicted), 1e-4))
    return values


def fit_load_link(
    rate: PrefillRate, hits: list[tuple[int, int, float]], chunk_tokens: int, chunk_bytes: int
) -> TierLink:
    """Host-tier link from (prompt tokens, cached tokens, TTFT) of prompts served from the
    store: what their TTFT exceeds the predicted compute of their uncached rest, as a latency
    per load plus a time per chunk (median regression)."""
    rows = [
        (cached // chunk_tokens, seconds - rate.compute_s(tokens - cached, cached))
        for tokens, cached, seconds in hits
        if cached >= chunk_tokens
    ]
    if len(rows) < 2:
        return TierLink(chunk_bytes / 1e-6)
    chunks, extra_s = (np.array(values, dtype=float) for values in zip(*rows, strict=True))
    fitted = _median_fit({"latency_s": np.ones_like(chunks), "chunk_s": chunks}, extra_s)
    return TierLink(chunk_bytes / max(fitted["chunk_s"], 1e-6), fitted["latency_s"])
