"""The load-or-recompute decision: a chunk is loaded only when that is predicted faster."""

import pytest

from kvstore.costmodel import (
    OnlineLoadPlanner,
    PrefillRate,
    TierLink,
    best_load_prefix,
)
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


def _planner_after_steps(remote_chunk_s: float) -> OnlineLoadPlanner:
    """Three steps computing prompts at 1 ms a token, then one loading 4 remote chunks."""
    planner = OnlineLoadPlanner(chunk_tokens=128, probe_every=1000)
    now = 0.0
    for number, tokens in enumerate((200, 400, 800)):
        planner.step_started([(f"cold-{number}", tokens, 0)], now)
        now += 0.01 + tokens * 1e-3
        planner.step_ended(now)
    assert planner.chunks_to_load("probe", ["remote"] * 4, 600) == 4  # unmeasured: loaded
    planner.step_started([("probe", 88, 512)], now)
    planner.step_ended(now + 0.01 + 88 * 1e-3 + 4 * remote_chunk_s)
    return planner


def test_the_online_planner_computes_chunks_of_a_tier_it_measured_slow():
    planner = _planner_after_steps(remote_chunk_s=1.0)  # 1 s a chunk vs 0.128 s to compute
    rate, per_chunk_s = planner.estimates()
    assert rate.per_token_s == pytest.approx(1e-3, rel=0.05)
    assert per_chunk_s["remote"] == pytest.approx(1.0, rel=0.05)
    assert planner.chunks_to_load("next", ["local", "remote", "remote"], 600) == 1
    assert planner.recomputed_chunks == 2


def test_the_online_planner_loads_a_fast_tier_and_tolerates_noise():
    planner = _planner_after_steps(remote_chunk_s=0.2)  # slower than compute, within the margin
    assert planner.chunks_to_load("next", ["remote"] * 4, 600) == 4
    assert planner.recomputed_chunks == 0


def test_a_slow_tier_is_probed_again():
    planner = _planner_after_steps(remote_chunk_s=1.0)
    planner.probe_every = 2
    decisions = [planner.chunks_to_load(f"r{n}", ["remote"] * 2, 600) for n in range(4)]
    assert sorted(decisions) == [0, 0, 2, 2]


def test_the_prefill_fit_ignores_a_stall():
    from kvstore.plan.calibrate import fit_prefill

    lengths = [64, 512, 1024, 2048, 3072, 4096] * 3
    truth = PrefillRate(per_token_s=1e-4, per_token_pair_s=1e-8, fixed_s=0.05)
    seconds = [truth.compute_s(n) for n in lengths]
    seconds[4] += 2.0  # the machine stalled once
    fitted = fit_prefill(lengths, seconds)
    assert fitted.compute_s(2000) == pytest.approx(truth.compute_s(2000), rel=0.01)


def test_an_unmeasured_tier_is_loaded_even_when_compute_looks_free():
    """Regression: a rate fitted flat (every prompt the same time) made any load a loss."""
    planner = OnlineLoadPlanner(chunk_tokens=128)
    for number in range(4):
        planner.step_started([(f"cold-{number}", 200 * (number + 1), 0)], float(number))
        planner.step_ended(number + 0.02)  # 20 ms whatever the length
    assert planner.chunks_to_load("probe", ["remote"] * 4, 600) == 4
