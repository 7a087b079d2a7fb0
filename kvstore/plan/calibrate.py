"""Calibration of the cost model on a live engine: prefill time vs prompt length (fixed, linear
and attention's quadratic term, least squares) and the seconds a cached chunk costs to load.
Runs in the `kvstore plan --validate` process; fits numbers it is given, measures nothing.
"""

from __future__ import annotations

import statistics

import numpy as np

from kvstore.costmodel import PrefillRate, TierLink, fit_nonnegative

COLD_LENGTHS = (64, 512, 1024, 2048, 3072, 4096)
HIT_LENGTHS = (1025, 2049, 4033)


def engine_layout_bytes(dims: dict, chunk_tokens: int, itemsize: int = 4) -> int:
    """Payload bytes of one chunk of the engine's KV (float32 by default)."""
    layers, heads, head_dim = dims["num_layers"], dims["num_kv_heads"], dims["head_dim"]
    return layers * 2 * chunk_tokens * heads * head_dim * itemsize


def fit_prefill(lengths: list[int], seconds: list[float]) -> PrefillRate:
    """Least squares over t = fixed + a n + b n (n + 1) / 2, every term non-negative; points
    far above the first fit (a busy machine's stalls) are dropped and the rest refitted."""
    n, t = np.array(lengths, dtype=float), np.array(seconds, dtype=float)
    rate = _fit(n, t)
    residuals = t - np.array([rate.compute_s(int(x)) for x in n])
    spread = float(np.median(np.abs(residuals - np.median(residuals))))
    keep = residuals <= np.median(residuals) + 3 * max(spread, 1e-6)
    return _fit(n[keep], t[keep]) if keep.sum() >= 3 else rate


def _fit(n: np.ndarray, seconds: np.ndarray) -> PrefillRate:
    columns = {"fixed_s": np.ones_like(n), "per_token_s": n, "per_token_pair_s": n * (n + 1) / 2}
    return PrefillRate(**fit_nonnegative(columns, seconds))


def fit_load_link(
    rate: PrefillRate, hits: list[tuple[int, int, float]], chunk_tokens: int, chunk_bytes: int
) -> TierLink:
    """Host-tier link from (prompt tokens, cached tokens, TTFT) of prompts served from the
    store: what their TTFT exceeds the predicted compute of their uncached rest, per chunk."""
    per_chunk = [
        (seconds - rate.compute_s(tokens - cached, cached)) / (cached // chunk_tokens)
        for tokens, cached, seconds in hits
        if cached >= chunk_tokens
    ]
    chunk_s = max(statistics.median(per_chunk) if per_chunk else 0.0, 1e-6)
    return TierLink(chunk_bytes / chunk_s)
