"""Trace replay, narrated: a tiny Mooncake-format trace with a known answer goes through the
real store under every policy; bad inputs are refused with ConfigError."""

import json

import pytest

from kvstore.errors import ConfigError
from kvstore.eviction import policy_names
from kvstore.eviction.belady import NEVER
from kvstore.replay import TraceKeyer, TraceRequest, load_trace, next_uses, run_replay

# Three turns of one conversation plus an unrelated request, written out of timestamp order.
# turn 1: blocks 0 1 2 (2 partial)            -> no hit
# other : blocks 0 7 (7 partial)              -> hits block 0
# turn 2: blocks 0 1 3 4 (4 partial)          -> hits 0 1
# turn 3: blocks 0 1 3 5 6 (6 partial)        -> hits 0 1 3
REQUESTS = [
    {"timestamp": 0, "input_length": 1200, "output_length": 5, "hash_ids": [0, 1, 2]},
    {"timestamp": 3000, "input_length": 2100, "output_length": 5, "hash_ids": [0, 1, 3, 5, 6]},
    {"timestamp": 1000, "input_length": 600, "output_length": 5, "hash_ids": [0, 7]},
    {"timestamp": 2000, "input_length": 1700, "output_length": 5, "hash_ids": [0, 1, 3, 4]},
]


@pytest.fixture
def trace(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(request) + "\n" for request in REQUESTS))
    return str(path)


@pytest.mark.parametrize("policy", policy_names())
def test_a_cache_that_holds_everything_hits_every_repeated_prefix(trace, policy):
    result = run_replay(trace, policy, capacity_blocks=100, progress=False)
    assert result["requests"] == 4
    assert result["blocks"] == 14
    assert result["hit_blocks"] == 1 + 2 + 3
    assert result["block_hit_ratio"] == pytest.approx(6 / 14)
    assert result["tokens"] == 1200 + 600 + 1700 + 2100
    assert result["hit_tokens"] == 512 * 6
    assert result["stored_blocks"] == 14 - 6
    assert result["policy"] == policy and result["capacity_blocks"] == 100


@pytest.mark.parametrize("policy", policy_names())
def test_a_tiny_cache_still_replays_and_hits_at_most_as_often(trace, policy):
    result = run_replay(trace, policy, capacity_blocks=2, progress=False)
    assert 0 <= result["hit_blocks"] <= 6


def test_hindsight_beats_recency_in_a_three_block_cache(trace):
    # Belady drops 2 and 7 (never read again) and, for 4, the block of turn 3 read last: 1+2+2.
    assert run_replay(trace, "belady", capacity_blocks=3, progress=False)["hit_blocks"] == 5
    # LRU evicts block 1 for 7, so turn 2 hits only block 0, and turn 3 has lost block 0: 1+1+0.
    assert run_replay(trace, "lru", capacity_blocks=3, progress=False)["hit_blocks"] == 2


def test_unknown_policy_and_capacity_below_one_block_are_refused(trace):
    with pytest.raises(ConfigError, match="unknown eviction policy"):
        run_replay(trace, "clairvoyant", capacity_blocks=10, progress=False)
    with pytest.raises(ConfigError, match="capacity_blocks"):
        run_replay(trace, "lru", capacity_blocks=0, progress=False)


def test_malformed_traces_name_the_bad_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(REQUESTS[0]) + "\n{not json\n")
    with pytest.raises(ConfigError, match=r"bad\.jsonl:2"):
        load_trace(path)
    path.write_text(json.dumps({"timestamp": 0, "input_length": 2000, "hash_ids": [0]}) + "\n")
    with pytest.raises(ConfigError, match="one per 512-token block"):
        load_trace(path)


def test_equal_id_prefixes_give_equal_chained_keys():
    keyer = TraceKeyer()
    first = keyer.keys(TraceRequest(0, 1200, (0, 1, 2)))
    again = TraceKeyer().keys(TraceRequest(0, 1700, (0, 1, 3, 4)))
    assert first[:2] == again[:2]  # deterministic across keyers (and processes)
    assert len(set(first) | set(again)) == 5
    moved = keyer.keys(TraceRequest(0, 1024, (1, 0)))
    assert moved[1] != first[0]  # the same id after a different prefix is a different block
    partial = keyer.keys(TraceRequest(0, 300, (0,)))
    assert partial[0] != first[0]  # a partial block differs from the full block with its id


def test_next_uses_point_at_the_following_occurrence():
    a, b, c = (bytes([n]) * 16 for n in range(3))
    assert next_uses([[a, b], [a, c], [a]]) == [[2, NEVER], [4, NEVER], [NEVER]]
