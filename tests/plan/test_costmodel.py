"""The load-or-recompute decision: a chunk is loaded only when that is predicted faster."""

import pytest

from kvstore.costmodel import (
    FETCH_SAMPLES,
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


def _planner_after_steps(remote_chunk_s: float | None) -> OnlineLoadPlanner:
    """Three steps computing prompts at 1 ms a token (a 128-token chunk: 128 ms), then (unless
    None) a background probe that read one remote chunk in `remote_chunk_s`; "local" is free."""
    planner = OnlineLoadPlanner(chunk_tokens=128, free_tiers=frozenset({"local"}))
    now = 0.0
    for number, tokens in enumerate((200, 400, 800)):
        planner.step_started([(f"cold-{number}", tokens, 0)], now)
        now += 0.01 + tokens * 1e-3
        planner.step_ended(now)
    if remote_chunk_s is not None:
        planner.observe_fetch("remote", 1, remote_chunk_s)
    return planner


def test_the_online_planner_computes_chunks_of_a_tier_it_measured_slow():
    planner = _planner_after_steps(remote_chunk_s=1.0)  # 1 s a chunk vs 0.128 s to compute
    rate, per_chunk_s = planner.estimates()
    assert rate.per_token_s == pytest.approx(1e-3, rel=0.05)
    assert per_chunk_s["remote"] == pytest.approx(1.0, rel=0.05)
    assert planner.chunks_to_load("next", ["local", "remote", "remote"], 600) == 1
    assert planner.recomputed_chunks == 2


def test_the_online_planner_loads_a_tier_only_when_faster_than_computing():
    """No margin for noise in the load's favour: 0.2 s a chunk against 0.128 s to compute it
    is computed (the old rule loaded up to twice slower); 0.1 s is loaded."""
    slower = _planner_after_steps(remote_chunk_s=0.2)
    assert slower.chunks_to_load("next", ["remote"] * 4, 600) == 0
    faster = _planner_after_steps(remote_chunk_s=0.1)
    assert faster.chunks_to_load("next", ["remote"] * 4, 600) == 4
    assert faster.recomputed_chunks == 0


def test_an_unmeasured_tier_is_computed_until_a_probe_prices_it():
    """Regression (issue 31): an unmeasured tier was loaded on a live request to measure it,
    and a slow one every 32nd decision. Now it is computed until a probe prices it; the free
    prefix before it is loaded."""
    planner = _planner_after_steps(remote_chunk_s=None)
    assert planner.chunks_to_load("next", ["remote"] * 4, 600) == 0
    assert planner.chunks_to_load("mixed", ["local", "remote", "local"], 600) == 1
    assert planner.recomputed_chunks == 6
    planner.observe_fetch("remote", 1, 0.01)  # the probe: 10 ms a chunk
    assert planner.chunks_to_load("after", ["remote"] * 4, 600) == 4


def test_a_slow_tier_is_loaded_again_once_its_probes_say_it_recovered():
    planner = _planner_after_steps(remote_chunk_s=1.0)
    decisions = []
    for _ in range(FETCH_SAMPLES):
        decisions.append(planner.chunks_to_load("r", ["remote"] * 2, 600))
        planner.observe_fetch("remote", 1, 0.01)  # a background probe: recovered
    assert decisions[0] == 0 and decisions[-1] == 2
    assert planner.estimates()[1]["remote"] == pytest.approx(0.01)


def test_the_prefill_fit_ignores_a_stall():
    from kvstore.plan.calibrate import fit_prefill

    lengths = [64, 512, 1024, 2048, 3072, 4096] * 3
    truth = PrefillRate(per_token_s=1e-4, per_token_pair_s=1e-8, fixed_s=0.05)
    seconds = [truth.compute_s(n) for n in lengths]
    seconds[4] += 2.0  # the machine stalled once
    fitted = fit_prefill(lengths, seconds)
    assert fitted.compute_s(2000) == pytest.approx(truth.compute_s(2000), rel=0.01)


def test_everything_is_loaded_until_the_compute_rate_is_known():
    """Nothing to compare a load with on a fresh engine: it loads, as without the rule; and a
    rate fitted flat (every prompt the same time) then prices any load as a loss."""
    planner = OnlineLoadPlanner(chunk_tokens=128)
    assert planner.chunks_to_load("first", ["remote"] * 4, 600) == 4
    for number in range(4):
        planner.step_started([(f"cold-{number}", 200 * (number + 1), 0)], float(number))
        planner.step_ended(number + 0.02)  # 20 ms whatever the length
    assert planner.chunks_to_load("second", ["remote"] * 4, 600) == 0  # unmeasured: computed
    planner.observe_fetch("remote", 4, 1e-3)
    assert planner.chunks_to_load("third", ["remote"] * 4, 600) == 0  # any load is a loss
