"""The copies between SGLang host pages and block payloads: the canonical layer-major payload
whatever the pool's layout and head grouping, and a block whose bytes do not verify loads
as a miss (a False, and none of the pages after it), through a real node agent."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

from kvstore.bench.sglang import backend_for, host_pool
from kvstore.client import KVStoreClient
from kvstore.connectors.sglang import copies
from kvstore.connectors.sglang.pages import page_format
from tests.node.agents import running_agent

LAYERS, HEADS, HEAD_DIM, TOKENS = 3, 4, 8, 4
SHAPE = {"layers": LAYERS, "heads": HEADS, "head_dim": HEAD_DIM, "page_tokens": TOKENS}
AGENT = {"host_capacity_bytes": 4 << 20, "page_size_bytes": 64 << 10}
CASES = [(layout, heads) for layout in ("page_first", "page_first_direct") for heads in (0, 1, 2)]


def filled_pool(layout: str, pages: int = 4, seed: int = 3):
    pool = host_pool(layout, pages, **SHAPE)
    generator = torch.Generator().manual_seed(seed)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=generator))
    return pool


def canonical(pool, page: int, group_heads: int, group: int) -> bytes:
    """The block the vLLM connector stores: per layer K then V, [tokens, group's heads, dim]."""
    heads = slice(group * group_heads, (group + 1) * group_heads)
    if pool.layout == "page_first_direct":  # [2, pages, layers, tokens, heads, dim]
        kv = pool.kv_buffer[:, page, :, :, heads].permute(1, 0, 2, 3, 4)
    else:  # page_first: [2, tokens, layers, heads, dim]
        tokens = slice(page * TOKENS, (page + 1) * TOKENS)
        kv = pool.kv_buffer[:, tokens, :, heads].permute(2, 0, 1, 3, 4)
    return kv.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize(("layout", "group_heads"), CASES)
def test_payloads_are_canonical_and_load_back(layout, group_heads):
    pool = filled_pool(layout)
    fmt = page_format(pool, mla=False, codec="raw", group_heads=group_heads)
    payloads = [torch.zeros(fmt.payload_bytes, dtype=torch.uint8) for _ in range(fmt.groups)]
    checksums = copies.save_page(fmt, 2 * TOKENS, payloads)
    heads = group_heads or HEADS
    assert [p.numpy().tobytes() for p in payloads] == [
        canonical(pool, 2, heads, g) for g in range(fmt.groups)
    ]
    reader = host_pool(layout, 4, **SHAPE)
    reader_fmt = page_format(reader, mla=False, codec="raw", group_heads=group_heads)
    assert copies.load_page(reader_fmt, 1 * TOKENS, payloads, checksums)
    assert all(
        canonical(reader, 1, heads, g) == canonical(pool, 2, heads, g) for g in range(fmt.groups)
    )


@pytest.mark.parametrize(("layout", "group_heads"), CASES)
def test_a_block_changed_after_it_was_hashed_is_a_miss(layout, group_heads):
    pool = filled_pool(layout)
    fmt = page_format(pool, mla=False, codec="raw", group_heads=group_heads)
    payloads = [torch.zeros(fmt.payload_bytes, dtype=torch.uint8) for _ in range(fmt.groups)]
    checksums = copies.save_page(fmt, 0, payloads)
    payloads[-1][fmt.payload_bytes // 2] ^= 1  # one bit of the last group's block
    assert not copies.load_page(fmt, TOKENS, payloads, checksums)
    payloads[-1][fmt.payload_bytes // 2] ^= 1
    assert copies.load_page(fmt, TOKENS, payloads, checksums)
    assert not copies.load_page(fmt, TOKENS, [*payloads[:-1], payloads[-1][:-1]], checksums)


def test_save_skips_blocks_that_were_not_reserved():
    pool = filled_pool("page_first_direct")
    fmt = page_format(pool, mla=False, codec="raw", group_heads=1)
    payloads = [
        torch.zeros(fmt.payload_bytes, dtype=torch.uint8) if g % 2 else None
        for g in range(fmt.groups)
    ]
    checksums = copies.save_page(fmt, 0, payloads)
    assert [c is None for c in checksums] == [p is None for p in payloads]


@pytest.mark.parametrize(
    ("layout", "head_group_size"),
    [("page_first", 0), ("page_first_direct", 0), ("page_first_direct", 1)],
)
def test_arena_bytes_that_do_not_verify_end_the_loaded_prefix(tmp_path, layout, head_group_size):
    """A stored block whose arena bytes changed (one bit) loads as False, and so does every
    page after it: SGLang recomputes them; the pages before it are served."""
    indices = torch.arange(TOKENS, 4 * TOKENS)  # pages 1..3
    keys = ["page-a", "page-b", "page-c"]
    with running_agent(tmp_path, **AGENT) as agent:
        socket_path = agent.config.socket_path
        writer = backend_for(socket_path, filled_pool(layout), head_group_size=head_group_size)
        assert writer.batch_set_v1(keys, indices) == [True] * 3
        with KVStoreClient(socket_path) as client:
            assert client.access == "shared"
            loaded = client.load("default", writer._store_keys(keys[1:2]))
            loaded.payloads[-1][7] ^= 0x10  # the arena page itself
            client.release(loaded)
        reader_pool = host_pool(layout, 4, **SHAPE)
        reader = backend_for(socket_path, reader_pool, head_group_size=head_group_size)
        assert reader.batch_exists(keys) == 3, "the agent still holds all three"
        assert reader.batch_get_v1(keys, indices) == [True, False, False]
        totals = reader.get_stats().totals
        assert (totals["get_pages"], totals["get_failed_pages"]) == (1, 2)
        first = reader._format.page(TOKENS)
        assert all(
            np.array_equal(a, b) for a, b in zip(first, writer._format.page(TOKENS), strict=True)
        )
