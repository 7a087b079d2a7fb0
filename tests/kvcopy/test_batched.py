"""The copy engine moves a chunk layer in a constant number of device operations, whatever
the number of engine blocks per chunk: the aten operations a load and a save dispatch are
counted (TorchDispatchMode) for 1, 16 and 64 blocks per chunk, on raw and fp8 payloads, and
the copies scattered over shuffled block ids come back bit-equal."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvstore.kvcopy.engine import ChunkCopier
from kvstore.kvcopy.streams import HostStreams
from kvstore.kvcopy.verified import Hasher
from kvstore.layout import KVLayout

BLOCK, HEADS, DIM = 16, 2, 64


class CountedOps(TorchDispatchMode):
    """Counts every aten operation dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def paged_layer(num_blocks: int, seed: int | None) -> torch.Tensor:
    """One layer in vLLM's logical view [blocks, heads, block, 2 * dim], physically block-minor
    (LHBNC-like strides), so no view of it is contiguous."""
    physical = torch.zeros(HEADS, num_blocks, BLOCK, 2 * DIM, dtype=torch.bfloat16)
    if seed is not None:
        generator = torch.Generator().manual_seed(seed)
        physical.copy_(torch.randn(physical.shape, generator=generator))
    return physical.transpose(0, 1)


def ops_of_one_layer(blocks_per_chunk: int, codec: str) -> tuple[list[str], list[str]]:
    layout = KVLayout(1, HEADS, DIM, "bfloat16", BLOCK * blocks_per_chunk, codec)
    source = paged_layer(2 * blocks_per_chunk, seed=1)
    target = paged_layer(2 * blocks_per_chunk, seed=None)
    copier = ChunkCopier(layout, BLOCK, "cpu")
    copier.streams = HostStreams(in_place=False)  # the staged path, as on every device
    blocks = torch.randperm(2 * blocks_per_chunk)[:blocks_per_chunk].tolist()
    index = copier.block_index(blocks)
    payload = torch.zeros(layout.payload_bytes, dtype=torch.uint8)
    with CountedOps() as saved:
        copier.save_layer(source, index, payload, Hasher())
    with CountedOps() as loaded:
        copier.load_layer(payload, Hasher(), target, index)
    if codec == "raw":
        assert torch.equal(target[blocks], source[blocks])
    return saved.ops, loaded.ops


@pytest.mark.parametrize("codec", ["raw", "fp8"])
def test_a_chunk_layer_takes_the_same_operations_whatever_its_blocks(codec):
    counts = {blocks: ops_of_one_layer(blocks, codec) for blocks in (1, 16, 64)}
    saves = {blocks: len(saved) for blocks, (saved, _) in counts.items()}
    loads = {blocks: len(loaded) for blocks, (_, loaded) in counts.items()}
    assert len(set(saves.values())) == 1, f"operations per save grow with the blocks: {saves}"
    assert len(set(loads.values())) == 1, f"operations per load grow with the blocks: {loads}"
    copies = [op for op in counts[64][1] if "copy" in op or "index" in op]
    assert len(copies) <= 4, f"a raw load's copies: {copies}"


def test_a_load_fills_only_the_positions_it_keeps():
    layout = KVLayout(1, HEADS, DIM, "bfloat16", BLOCK * 4)
    source, target = paged_layer(8, seed=2), paged_layer(8, seed=None)
    copier = ChunkCopier(layout, BLOCK, "cpu")
    payload = torch.zeros(layout.payload_bytes, dtype=torch.uint8)
    copier.save_layer(source, copier.block_index([7, 0, 5, 2]), payload, None)
    copier.load_layer(payload, Hasher(), target, copier.block_index([1, 3, 4, 6], range(1, 3)))
    assert torch.equal(target[3], source[0]) and torch.equal(target[4], source[5])
    assert not target[[0, 1, 2, 5, 6, 7]].any()


def test_an_index_that_is_not_a_run_of_positions_is_refused():
    copier = ChunkCopier(KVLayout(1, HEADS, DIM, "bfloat16", BLOCK * 4), BLOCK, "cpu")
    with pytest.raises(ValueError, match="not a run"):
        copier.block_index([1, 2, 3, 4], range(0, 4, 2))
    with pytest.raises(ValueError, match="every position"):
        index = copier.block_index([1, 2, 3, 4], range(1, 4))
        copier.save_layer(paged_layer(8, 0), index, torch.zeros(1 << 20, dtype=torch.uint8), None)


def test_an_engine_that_owns_its_threads_is_left_alone(monkeypatch):
    """vLLM's CPU worker binds its threads to cores and replaces torch.set_num_threads with a
    warning: the copies must not call it (they ran on one thread by calling it, and logged
    that warning twice per chunk layer), and still copy right."""
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    layout = KVLayout(1, HEADS, DIM, "bfloat16", BLOCK * 2)
    source, target = paged_layer(4, seed=5), paged_layer(4, seed=None)
    copier = ChunkCopier(layout, BLOCK, "cpu")
    payload = torch.zeros(layout.payload_bytes, dtype=torch.uint8)
    copier.save_layer(source, copier.block_index([3, 1]), payload, None)
    copier.load_layer(payload, Hasher(), target, copier.block_index([0, 2]))
    assert calls == []
    assert torch.equal(target[[0, 2]], source[[3, 1]])
