"""The load-or-recompute decision: a chunk is loaded only when that is predicted faster."""

import pytest

from kvstore.costmodel import PrefillRate, RateMeter, TierLink, best_load_prefix
from kvstore.errors import ConfigError

RATE = PrefillRate(per_token_s=1e-4, per_token_pair_s=1e-8, fixed_s=0.01)
CHUNK_BYTES = 1 << 20


def test_a_fast_tier_is_loaded_whole():
    links = {"host": TierLink(10e9)}
    count, ttft_s = best_load_prefix(["host"] * 4, [256] * 4, CHUNK_BYTES, 1100, RATE, links)
    assert count == 4
    assert ttft_s < RATE.compute_s(1100)


def test_a_tier_slower_than_compute_is_recomputed():
    links = {"host": TierLink(10e9), "disk": TierLink(1e6)}  # 1 s per chunk: far slower
    count, ttft_s = best_load_prefix(
        ["host", "host", "disk", "disk"], [256] * 4, CHUNK_BYTES, 1100, RATE, links
    )
    assert count == 2
    assert ttft_s == pytest.approx(
        links["host"].load_s(2 * CHUNK_BYTES) + RATE.compute_s(1100 - 512, 512)
    )


def test_overlap_hides_loads_under_compute():
    links = {"host": TierLink(CHUNK_BYTES / 0.02)}  # 20 ms a chunk
    serial = best_load_prefix(["host"] * 2, [256] * 2, CHUNK_BYTES, 600, RATE, links)[1]
    overlapped = best_load_prefix(["host"] * 2, [256] * 2, CHUNK_BYTES, 600, RATE, links, True)[1]
    assert overlapped < serial


def test_bad_rates_are_refused():
    with pytest.raises(ConfigError):
        TierLink(0)
    with pytest.raises(ConfigError):
        PrefillRate(per_token_s=-1)
    meter = RateMeter(1e9)
    meter.observe(1e6, 0)  # ignored
    meter.observe(2e9, 1.0)
    assert 1e9 < meter.per_s < 2e9 and meter.observations == 1
