"""Calibration of the cost model on a live engine: prefill time vs prompt length (fixed, linear
and attention's quadratic term, least squares) and the seconds a cached chunk costs to load.
Runs in the `kvstore plan --validate` process; fits numbers it is given, measures nothing.
"""

from __future__ import annotations

import numpy as np

from kvstore.costmodel import PrefillRate, TierLink, fit_nonnegative

WARMUP_LENGTHS = (256, 1024, 2048, 4096) * 2  # an engine's first runs are slower
MEDIAN_FIT_ROUNDS = 30


def engine_layout_bytes(dims: dict, chunk_tokens: int, itemsize: int = 4) -> int:
    """Payload bytes of one chunk of the engine's KV (float32 by default)."""
    layers, heads, head_dim = dims["num_layers"], dims["num_kv_heads"], dims["head_dim"]
    return layers * 2 * chunk_tokens * heads * head_dim * itemsize


def fit_prefill(lengths: list[int], seconds: list[float]) -> PrefillRate:
    """Median regression (iteratively reweighted least squares) over t = fixed + a n +
    b n (n + 1) / 2, every term non-negative: the time a typical prompt of each length takes on
    this machine, which a busy machine's stalls do not drag up."""
    n, t = np.array(lengths, dtype=float), np.array(seconds, dtype=float)
    columns = {"fixed_s": np.ones_like(n), "per_token_s": n, "per_token_pair_s": n * (n + 1) / 2}
    return PrefillRate(**_median_fit(columns, t))


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
    rows = [(cached // chunk_tokens, seconds - rate.compute_s(tokens - cached, cached))
            for tokens, cached, seconds in hits if cached >= chunk_tokens]  # fmt: skip
    if len(rows) < 2:
        return TierLink(chunk_bytes / 1e-6)
    chunks, extra_s = (np.array(values, dtype=float) for values in zip(*rows, strict=True))
    fitted = _median_fit({"latency_s": np.ones_like(chunks), "chunk_s": chunks}, extra_s)
    return TierLink(chunk_bytes / max(fitted["chunk_s"], 1e-6), fitted["latency_s"])
