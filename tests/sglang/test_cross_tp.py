"""SGLang deployments of different TP sizes share pages when they agree on head_group_size:
the blocks two TP=2 ranks (a head each) store are what one TP=1 backend loads, and the
reverse. SGLang's real host pools and factory, a real node agent."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

from kvstore.bench.sglang import backend_for, host_pool
from tests.node.agents import running_agent

LAYERS, HEADS, HEAD_DIM, PAGE, PAGES = 3, 2, 16, 4, 3
KEYS = [f"{i:064x}" for i in range(1, PAGES + 1)]
INDICES = torch.arange(PAGE, (PAGES + 1) * PAGE)  # pages 1..PAGES
AGENT = {"host_capacity_bytes": 4 << 20, "page_size_bytes": 64 << 10}


def pool(heads: int):
    return host_pool("page_first_direct", PAGES + 1, LAYERS, heads, HEAD_DIM, PAGE)


def heads_of(p) -> torch.Tensor:
    """Pages 1..PAGES of a page_first_direct pool: [2, pages, layers, tokens, heads, dim]."""
    return p.kv_buffer[:, 1 : PAGES + 1]


def ranks(socket_path, tp_size: int):
    pools = [pool(HEADS // tp_size) for _ in range(tp_size)]
    backends = [
        backend_for(socket_path, p, tp_rank=r, tp_size=tp_size, head_group_size=1)
        for r, p in enumerate(pools)
    ]
    return pools, backends


@pytest.mark.parametrize(("writer_tp", "reader_tp"), [(2, 1), (1, 2)])
def test_pages_written_at_one_tp_size_load_at_another(tmp_path, writer_tp, reader_tp):
    generator = torch.Generator().manual_seed(5)
    kv = torch.randn(2, PAGES, LAYERS, PAGE, HEADS, HEAD_DIM, generator=generator)
    with running_agent(tmp_path, **AGENT) as agent:
        writers, backends = ranks(agent.config.socket_path, writer_tp)
        share = HEADS // writer_tp
        for rank, (p, backend) in enumerate(zip(writers, backends, strict=True)):
            heads_of(p).copy_(kv[..., rank * share : (rank + 1) * share, :].to(p.dtype))
            assert backend.batch_set_v1(KEYS, INDICES) == [True] * PAGES
        readers, backends = ranks(agent.config.socket_path, reader_tp)
        share = HEADS // reader_tp
        for rank, (p, backend) in enumerate(zip(readers, backends, strict=True)):
            assert backend.batch_exists(KEYS) == PAGES
            assert backend.batch_get_v1(KEYS, INDICES) == [True] * PAGES
            want = kv[..., rank * share : (rank + 1) * share, :].to(p.dtype)
            assert torch.equal(heads_of(p), want)


def test_without_a_fleet_head_group_size_tp_sizes_do_not_share(tmp_path):
    with running_agent(tmp_path, **AGENT) as agent:
        tp1 = backend_for(agent.config.socket_path, pool(HEADS))
        assert tp1.batch_set_v1(KEYS, INDICES) == [True] * PAGES
        half = backend_for(agent.config.socket_path, pool(1), tp_rank=0, tp_size=2)
        assert half.batch_exists(KEYS) == 0, "a 1-head group is another namespace than 2 heads"
