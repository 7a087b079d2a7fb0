"""The validation's calibration on synthetic timings: a prefill rate, the cost of a save and a
host link recovered through a machine whose speed changes mid-run (other tenants' load); the
cold calibration prompts compute what trace requests compute."""

import numpy as np
import pytest

from kvstore.costmodel import PrefillRate, TierLink
from kvstore.plan import calibrate as cal
from kvstore.plan.scaled import keyed_prompt
from kvstore.plan.validate import CHUNK_TOKENS, ScaledSlice, schedule, stored_prefixes

TRUTH = PrefillRate(per_token_s=3e-5, per_token_pair_s=2e-8, fixed_s=0.008)
LINK = TierLink(bandwidth_bytes_per_s=1e9, latency_s=0.001)
SAVE_S = 0.004
CHUNK_BYTES = 524288


def _timings(runs: int = 400, seed: int = 0):
    """Every 3rd run cold, every 10th a full hit of 1-8 chunks, the rest load one chunk (as
    most trace requests do); the machine runs 4x slower over the middle third; 5 % jitter."""
    rng = np.random.default_rng(seed)
    lengths = np.where(
        rng.random(runs) < 0.3, rng.integers(2, 200, runs), rng.integers(20, 4096, runs)
    )
    cold = np.arange(runs) % 3 == 0
    hit = (np.arange(runs) % 10 == 5) & ~cold
    cached = np.where(cold, 0, np.minimum(lengths - 1, 64) // 64 * 64)
    cached[hit] = 64 * rng.integers(1, 9, hit.sum())
    lengths[hit] = cached[hit] + rng.integers(1, 64, hit.sum())
    slowdown = np.where((np.arange(runs) > runs // 3) & (np.arange(runs) < 2 * runs // 3), 4, 1)
    steady = np.array([_ttft(int(n), int(c)) for n, c in zip(lengths, cached, strict=True)])
    seconds = steady * slowdown * rng.lognormal(0, 0.05, runs)
    return lengths, cached, seconds, cold, hit, steady * slowdown


def _ttft(tokens: int, cached: int) -> float:
    load_s = LINK.latency_s + LINK.load_s(cached // 64 * CHUNK_BYTES) if cached else 0.0
    save_s = SAVE_S if tokens // 64 > cached // 64 else 0.0  # a new full chunk is stored
    return load_s + save_s + TRUTH.compute_s(tokens - cached, cached)


def test_calibration_follows_the_machine_speed_through_a_load_burst():
    lengths, cached, seconds, cold, hit, truth = _timings()
    fitted = cal.calibrate(lengths, cached, seconds, cold, hit, 64, CHUNK_BYTES)
    assert fitted.rate.compute_s(1000) == pytest.approx(TRUTH.compute_s(1000), rel=0.05)
    assert fitted.save_s == pytest.approx(SAVE_S, rel=0.25)
    chunk_s = CHUNK_BYTES / fitted.link.bandwidth_bytes_per_s
    assert chunk_s + fitted.link.latency_s == pytest.approx(
        LINK.latency_s + LINK.load_s(CHUNK_BYTES), rel=0.2
    )  # one chunk's load, what most trace requests pay
    assert np.median(fitted.slowdown[150:240]) == pytest.approx(4, rel=0.05)
    assert np.median(fitted.slowdown[:100]) == pytest.approx(1, rel=0.05)
    steady = np.array(
        [
            fitted.ttft_s(int(n), int(c) // 64, 64, CHUNK_BYTES)
            for n, c in zip(lengths, cached, strict=True)
        ]
    )
    predicted = steady * fitted.slowdown
    trace = ~cold & ~hit
    assert np.median(predicted[trace] / truth[trace]) == pytest.approx(1, abs=0.03)
    for quantile in (0.5, 0.9):
        expected = np.quantile(truth[trace], quantile)
        assert np.quantile(predicted[trace], quantile) == pytest.approx(expected, rel=0.1)


def test_a_global_fit_misses_the_burst():
    """Why the slowdown is measured: one rate for the whole run puts the p90 far off."""
    lengths, cached, seconds, cold, hit, truth = _timings()
    rate = cal.fit_prefill(lengths[cold].tolist(), seconds[cold].tolist())
    trace = ~cold & ~hit
    pairs = zip(lengths[trace], cached[trace], strict=True)
    predicted = [rate.compute_s(int(n - c), int(c)) for n, c in pairs]
    assert np.quantile(predicted, 0.9) < 0.7 * np.quantile(truth[trace], 0.9)


def test_cold_prompts_compute_what_trace_requests_compute():
    base = list(range(4, 4 + 3 * CHUNK_TOKENS))  # three chunks
    prompts = [base[:100], base + [7] * 10, list(range(600, 700))]
    slice_ = ScaledSlice("x", prompts, [keyed_prompt(p, CHUNK_TOKENS) for p in prompts])
    # the second prompt finds the first one's single full chunk; the third shares nothing
    assert stored_prefixes(slice_) == [0, 1, 0]
    cold = [r for r in schedule(slice_) if r.role == "cold"]  # after every COLD_EVERY requests
    assert len(cold) == 1 and len(cold[0].prompt) in (100, len(base) + 10 - CHUNK_TOKENS)
