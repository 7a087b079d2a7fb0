"""The copy engine over every physical KV layout vLLM 0.32 has, with the per-layer views built
by vLLM's own `create_kv_cache_views`: a chunk saved from one layout and loaded into another
gives identical KV, the stored payload does not depend on the layout it came from, and
caches the engine cannot copy are refused by name."""

import itertools

import pytest
import torch
import xxhash
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheTensor,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvstore.errors import ConfigError
from kvstore.kvcopy.engine import ChunkCopier
from kvstore.kvcopy.paged import check_paged_layer
from kvstore.kvcopy.streams import HostStreams
from kvstore.kvcopy.verified import Hasher
from kvstore.layout import KVLayout

BLOCK, HEADS, DIM, LAYERS, NUM_BLOCKS = 16, 2, 8, 3, 6
LAYOUT = KVLayout(LAYERS, HEADS, DIM, "bfloat16", chunk_tokens=2 * BLOCK)
SPEC = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=DIM, dtype=torch.bfloat16)


def vllm_views(layout: KVCacheLayout, seed: int | None) -> list[torch.Tensor]:
    """Per-layer caches exactly as vLLM's model runner builds them for `layout`."""
    layer_stride, block_stride, *_ = compute_layout_strides(SPEC, NUM_BLOCKS, LAYERS, layout)
    raw = torch.zeros(LAYERS * NUM_BLOCKS * SPEC.page_size_bytes, dtype=torch.int8)
    tensor = KVCacheTensor(
        size=raw.numel(),
        layers=[f"layer{i}" for i in range(LAYERS)],
        layer_stride=layer_stride,
        block_stride=block_stride,
    )
    views = create_kv_cache_views(raw, SPEC, NUM_BLOCKS, layout, tensor)
    if seed is not None:
        generator = torch.Generator().manual_seed(seed)
        for view in views:  # the same logical content whatever the physical order
            view.copy_(torch.randn(view.shape, generator=generator).to(view.dtype))
    return views


def save_chunk(views, blocks, in_place: bool = True) -> torch.Tensor:
    """Save from `views`; `in_place=False`: the staged path every device shares."""
    payload = torch.zeros(LAYOUT.payload_bytes, dtype=torch.uint8)
    copier = ChunkCopier(LAYOUT, BLOCK, "cpu")
    copier.streams = HostStreams(in_place=in_place)
    hasher = Hasher()
    for layer, view in enumerate(views):
        start, stop = LAYOUT.layer_range(layer)
        copier.save_layer(view, copier.block_index(blocks), payload[start:stop], hasher)
    assert hasher.intdigest() == xxhash.xxh3_64_intdigest(payload.numpy())
    return payload


def load_chunk(payload, views, blocks, keep: range, in_place: bool = True) -> int:
    """Load into `views`; `in_place=False`: the staged path every device shares."""
    copier = ChunkCopier(LAYOUT, BLOCK, "cpu")
    copier.streams = HostStreams(in_place=in_place)
    index = copier.block_index(blocks, keep)
    hasher = Hasher()
    for layer, view in enumerate(views):
        start, stop = LAYOUT.layer_range(layer)
        copier.load_layer(payload[start:stop], hasher, view, index)
    return hasher.intdigest()


@pytest.mark.parametrize(
    ("source", "target"),
    list(itertools.product(KVCacheLayout, KVCacheLayout)),
    ids=lambda layout: layout.name,
)
@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "staged"])
def test_a_chunk_saved_from_one_layout_loads_into_another_unchanged(source, target, in_place):
    saved_from = vllm_views(source, seed=1)
    payload = save_chunk(saved_from, blocks=[4, 1], in_place=in_place)
    loaded_into = vllm_views(target, seed=None)
    digest = load_chunk(payload, loaded_into, blocks=[0, 3], keep=range(2), in_place=in_place)
    assert digest == xxhash.xxh3_64_intdigest(payload.numpy())
    for before, after in zip(saved_from, loaded_into, strict=True):
        assert torch.equal(after[0], before[4]) and torch.equal(after[3], before[1])
        assert not after[[1, 2, 4, 5]].any(), "no other block is touched"


def test_the_payload_is_the_same_whatever_layout_and_path_it_came_from():
    """Saved in place (the CPU: engine blocks straight into the page) or staged (gathered,
    then written out: every device), from any layout: the same bytes."""
    payloads = [
        save_chunk(vllm_views(layout, seed=2), [2, 5], in_place)
        for layout in KVCacheLayout
        for in_place in (True, False)
    ]
    assert all(torch.equal(payloads[0], payload) for payload in payloads)


def test_skipped_blocks_are_left_alone():
    payload = save_chunk(vllm_views(KVCacheLayout.LBNHC, seed=3), [0, 1])
    target = vllm_views(KVCacheLayout.LBNHC, seed=None)
    load_chunk(payload, target, blocks=[2, 3], keep=range(1, 2))  # block 2 was computed locally
    assert not target[0][2].any() and target[0][3].any()


@pytest.mark.parametrize(
    ("cache", "message"),
    [
        (torch.zeros(4, HEADS + 1, BLOCK, 2 * DIM, dtype=torch.bfloat16), "has shape"),
        (torch.zeros(4, HEADS, BLOCK, 2 * DIM, dtype=torch.float16), "is torch.float16"),
        (torch.zeros(2, 4, HEADS, BLOCK, DIM, dtype=torch.bfloat16), "has shape"),
        (
            torch.zeros(4, HEADS, 2 * DIM, BLOCK, dtype=torch.bfloat16).transpose(2, 3),
            "not contiguous",
        ),
    ],
    ids=["heads", "dtype", "split-kv", "strided-dim"],
)
def test_caches_the_engine_cannot_copy_are_refused_by_name(cache, message):
    with pytest.raises(ConfigError, match=message):
        check_paged_layer("model.layers.0.attn", cache, LAYOUT, BLOCK)


def test_the_load_path_allocates_no_per_layer_tensors():
    """Loads reuse the copier's staging buffer: after the first layer, copying a chunk layer
    allocates no tensor storage (views only)."""
    from torch.profiler import ProfilerActivity, profile

    views = vllm_views(KVCacheLayout.LBHNC, seed=4)
    payload = save_chunk(views, [0, 1])
    target = vllm_views(KVCacheLayout.LBHNC, seed=None)
    copier = ChunkCopier(LAYOUT, BLOCK, "cpu")
    index = copier.block_index([2, 3])  # once per step
    hasher = Hasher()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiled:
        for layer, view in enumerate(target):
            start, stop = LAYOUT.layer_range(layer)
            copier.load_layer(payload[start:stop], hasher, view, index)
    allocated = sum(max(0, event.cpu_memory_usage) for event in profiled.events())
    assert allocated == 0, f"the load path allocated {allocated} bytes"


@pytest.mark.parametrize("codec", ["raw", "fp8"])
def test_a_tail_of_one_block_goes_through_the_chunks_copier(codec):
    """A prompt's tail (a block of fewer tokens than a chunk) is saved and loaded by the copier
    of whole chunks, with the tail's layout: its payload is the chunk's first block, alone."""
    layout = KVLayout(LAYERS, HEADS, DIM, "bfloat16", chunk_tokens=2 * BLOCK, codec=codec)
    tail = layout.with_tokens(BLOCK)
    copier = ChunkCopier(layout, BLOCK, "cpu")
    source, target = vllm_views(KVCacheLayout.LBNHC, seed=4), vllm_views(KVCacheLayout.LBNHC, None)
    payload = torch.zeros(tail.payload_bytes, dtype=torch.uint8)
    for layer, view in enumerate(source):
        start, stop = tail.layer_range(layer)
        copier.save_layer(view, copier.block_index([5]), payload[start:stop], None, tail)
    hasher = Hasher()
    for layer, view in enumerate(target):
        start, stop = tail.layer_range(layer)
        copier.load_layer(payload[start:stop], hasher, view, copier.block_index([2]), tail)
    assert hasher.intdigest() == xxhash.xxh3_64_intdigest(payload.numpy())
    for before, after in zip(source, target, strict=True):
        if codec == "raw":
            assert torch.equal(after[2], before[5])
        else:  # fp8: within the codec's rounding
            assert torch.allclose(after[2].float(), before[5].float(), rtol=0.1, atol=0.1)
        assert not after[[0, 1, 3, 4, 5]].any()
    other_heads = KVLayout(LAYERS, HEADS + 1, DIM, "bfloat16", BLOCK, codec)
    with pytest.raises(ConfigError, match="not a tail"):
        copier.load_layer(payload[:16], Hasher(), target[0], copier.block_index([2]), other_heads)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_vllms_cpu_layout_loads_in_place_with_k_transposed(dtype):
    """vLLM's CPU cache ([blocks, heads, block, 2 * dim], K kept as [head][dim][token]), filled
    by vLLM's own CPU kernel: a chunk saved from it loads in place into other blocks of another
    cache, its K transposed on the way, positions the engine has left alone, and the digest
    is the payload's."""
    from vllm import _custom_ops as ops

    from kvstore.connectors.vllm.compat import paged_layer_view

    block, heads, dim = 16, 2, 64
    layout = KVLayout(1, heads, dim, dtype, chunk_tokens=3 * block)
    torch_dtype = layout.torch_dtype
    source = torch.zeros(8, heads, block, 2 * dim, dtype=torch_dtype)
    key, value = torch.randn(2, 3 * block, heads, dim).to(torch_dtype)
    key_cache, value_cache = source.view(8, heads, 2 * block, dim).chunk(2, dim=2)
    slots = torch.tensor([b * block + t for b in (4, 1, 6) for t in range(block)])
    isa = "vec" if dtype == "float32" else "vec16"
    ops.cpu_attn_reshape_and_cache(
        key,
        value,
        key_cache,
        value_cache,
        slots,
        isa,
        k_scale=1.0,
        v_scale=1.0,
        kv_cache_dtype="auto",
    )
    copier = ChunkCopier(layout, block, "cpu")
    payload = torch.zeros(layout.payload_bytes, dtype=torch.uint8)
    copier.save_layer(paged_layer_view(source, isa), copier.block_index([4, 1, 6]), payload, None)
    target = torch.zeros_like(source)
    hasher = Hasher()
    index = copier.block_index([0, 2, 5], range(1, 3))  # block 0 was computed locally
    copier.load_layer(payload, hasher, paged_layer_view(target, isa), index)
    assert hasher.intdigest() == xxhash.xxh3_64_intdigest(payload.numpy())
    keys, values = paged_layer_view(target, isa)
    assert torch.equal(keys[[2, 5]].flatten(0, 1), key[block:])
    assert torch.equal(values[[2, 5]].flatten(0, 1), value[block:])
    assert not target[[0, 1, 3, 4, 6, 7]].any()
