"""A request that loads several chunks: `load_layers` copies one layer of all of them, and where
the streams stage loads (CUDA; here HostStreams(in_place=False), every line CUDA runs but its
streams) the pages of consecutive chunks that lie at one stride in the arena go up in one
upload (one DMA on a device), counted on the streams. Each chunk's digest is still of its own
bytes: a corrupted page fails its own chunk and no other."""

import pytest
import torch
import xxhash

from kvstore.kvcopy import batches
from kvstore.kvcopy.engine import ChunkCopier, LayerLoad
from kvstore.kvcopy.streams import HostStreams
from kvstore.kvcopy.verified import Hasher
from kvstore.layout import KVLayout

BLOCK, HEADS, DIM, LAYERS, CHUNK_BLOCKS = 16, 2, 64, 3, 2
LAYOUT = KVLayout(LAYERS, HEADS, DIM, "bfloat16", chunk_tokens=CHUNK_BLOCKS * BLOCK)
HEADER_BYTES = 128  # an arena page holds a header before its payload
PAGE_BYTES = HEADER_BYTES + LAYOUT.payload_bytes


def paged(num_blocks: int, seed: int | None) -> list[torch.Tensor]:
    """Per-layer caches in vLLM's logical view, physically LBNHC-like (strided)."""
    physical = torch.zeros(LAYERS, num_blocks, BLOCK, HEADS, 2 * DIM, dtype=torch.bfloat16)
    if seed is not None:
        physical.copy_(torch.randn(physical.shape, generator=torch.Generator().manual_seed(seed)))
    return list(physical.transpose(2, 3))


class Arena:
    """Pages side by side in one buffer, as the agent's arena lays them out."""

    def __init__(self, num_pages: int) -> None:
        self.flat = torch.zeros(num_pages * PAGE_BYTES, dtype=torch.uint8)

    def payload(self, page: int, layout: KVLayout = LAYOUT) -> torch.Tensor:
        start = page * PAGE_BYTES + HEADER_BYTES
        return self.flat[start : start + layout.payload_bytes]


def saved(arena: Arena, pages: list[int], source: list[torch.Tensor]) -> None:
    """Chunk c of `source` (its blocks c*2, c*2+1) saved into arena page `pages[c]`."""
    copier = ChunkCopier(LAYOUT, BLOCK, "cpu")
    for chunk, page in enumerate(pages):
        index = copier.block_index(chunk_blocks(chunk))
        for layer, view in enumerate(source):
            start, stop = LAYOUT.layer_range(layer)
            copier.save_layer(view, index, arena.payload(page)[start:stop], None)


def chunk_blocks(chunk: int) -> list[int]:
    return list(range(chunk * CHUNK_BLOCKS, (chunk + 1) * CHUNK_BLOCKS))


def loaded(copier: ChunkCopier, arena: Arena, pages: list[int], target) -> list[int]:
    """Every layer of the chunks in `pages` loaded, a layer of all of them per call (into the
    same engine blocks they came from); each chunk's digest."""
    indexes = [copier.block_index(chunk_blocks(chunk)) for chunk in range(len(pages))]
    hashers = [Hasher() for _ in pages]
    for layer, view in enumerate(target):
        start, stop = LAYOUT.layer_range(layer)
        copier.load_layers(
            [
                LayerLoad(arena.payload(page)[start:stop], hasher, view, index)
                for page, hasher, index in zip(pages, hashers, indexes, strict=True)
            ]
        )
    return [hasher.intdigest() for hasher in hashers]


def staged_copier(**options) -> ChunkCopier:
    copier = ChunkCopier(LAYOUT, BLOCK, "cpu", **options)
    copier.streams = HostStreams(in_place=False)
    return copier


def checksums(arena: Arena, pages: list[int]) -> list[int]:
    return [xxhash.xxh3_64_intdigest(arena.payload(page).numpy()) for page in pages]


@pytest.mark.parametrize(
    ("pages", "uploads_per_layer"),
    [
        ([0, 1, 2, 3], 1),  # side by side: one upload of four rows
        ([1, 3, 5, 7], 1),  # one stride of two pages: still one strided upload
        ([0, 1, 2, 6, 7], 2),  # two runs
        ([3, 2, 1, 0], 4),  # each page before the last: nothing lines up
        ([0, 2, 3, 5], 2),  # strides 2, 1, 2: [0, 2] then [3, 5]
    ],
    ids=["adjacent", "strided", "two-runs", "descending", "uneven"],
)
def test_chunks_side_by_side_go_up_in_one_upload_per_layer(pages, uploads_per_layer):
    arena, source = Arena(8), paged(2 * len(pages), seed=1)
    saved(arena, pages, source)
    target = paged(2 * len(pages), seed=None)
    copier = staged_copier()
    digests = loaded(copier, arena, pages, target)
    assert copier.streams.uploads == uploads_per_layer * LAYERS
    assert digests == checksums(arena, pages)
    assert all(torch.equal(before, after) for before, after in zip(source, target, strict=True))


def test_an_upload_takes_no_more_rows_than_its_buffer_holds():
    arena, source = Arena(4), paged(8, seed=2)
    saved(arena, [0, 1, 2, 3], source)
    copier = staged_copier(upload_batch_bytes=2 * LAYOUT.layer_bytes)
    target = paged(8, seed=None)
    assert loaded(copier, arena, [0, 1, 2, 3], target) == checksums(arena, [0, 1, 2, 3])
    assert copier.streams.uploads == 2 * LAYERS
    assert all(torch.equal(before, after) for before, after in zip(source, target, strict=True))


@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "staged"])
def test_a_corrupted_page_fails_its_own_chunk_and_no_other(in_place):
    """The chunks' pages go up in one upload, but each digest is fed with its own chunk's
    bytes as copied: the corrupted third page fails the third chunk alone."""
    pages = [0, 1, 2, 3]
    arena = Arena(4)
    saved(arena, pages, paged(8, seed=3))
    expected = checksums(arena, pages)
    arena.payload(2)[LAYOUT.layer_range(1)[0] + 5] ^= 0xFF  # layer 1 of the third chunk
    copier = ChunkCopier(LAYOUT, BLOCK, "cpu")
    copier.streams = HostStreams(in_place=in_place)
    digests = loaded(copier, arena, pages, paged(8, seed=None))
    assert [d == e for d, e in zip(digests, expected, strict=True)] == [True, True, False, True]


def test_a_tail_beside_whole_chunks_goes_up_alone():
    """A prompt's tail has a layer of fewer bytes: it never joins the whole chunks' rows."""
    tail = LAYOUT.with_tokens(BLOCK)
    arena, source = Arena(3), paged(5, seed=4)
    saved(arena, [0, 1], source)
    copier = staged_copier()
    for layer, view in enumerate(source):
        start, stop = tail.layer_range(layer)
        index = copier.block_index([4])
        copier.save_layer(view, index, arena.payload(2, tail)[start:stop], None, tail)
    target = paged(5, seed=None)
    indexes = [copier.block_index(chunk_blocks(c)) for c in range(2)] + [copier.block_index([4])]
    hashers = [Hasher() for _ in range(3)]
    for layer, view in enumerate(target):
        loads = []
        for page, layout in enumerate([LAYOUT, LAYOUT, tail]):
            start, stop = layout.layer_range(layer)
            payload = arena.payload(page, layout)[start:stop]
            loads.append(LayerLoad(payload, hashers[page], view, indexes[page], layout))
        copier.load_layers(loads)
    assert copier.streams.uploads == 2 * LAYERS
    assert hashers[2].intdigest() == xxhash.xxh3_64_intdigest(arena.payload(2, tail).numpy())
    assert all(torch.equal(before, after) for before, after in zip(source, target, strict=True))


def test_pages_further_apart_than_a_dma_can_stride_go_up_one_by_one(monkeypatch):
    monkeypatch.setattr(batches, "MAX_STRIDE_BYTES", PAGE_BYTES)  # a 2D DMA's pitch limit
    arena, source = Arena(8), paged(8, seed=5)
    saved(arena, [1, 3, 5, 7], source)
    copier = staged_copier()
    target = paged(8, seed=None)
    assert loaded(copier, arena, [1, 3, 5, 7], target) == checksums(arena, [1, 3, 5, 7])
    assert copier.streams.uploads == 4 * LAYERS
    assert all(torch.equal(before, after) for before, after in zip(source, target, strict=True))
