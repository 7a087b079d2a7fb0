"""The copy engine on a real CUDA device (marker `cuda`: deselected where torch sees none, by
tests/conftest.py). Every physical layout vLLM has and both codecs round-trip through pinned
payloads bit-equal with the CPU's copies; checksums are the payloads' xxh3; and the streams
order the copies against the compute stream: a save reads what the forward wrote, a layer's
attention sees what its load wrote, and a step's StepDone completes only with its copies and
hashes. Run by deploy/device-check.sh."""

import pytest
import torch
import xxhash

from kvstore.bench.gpu import LAYOUTS, paged_layers
from kvstore.kvcopy.engine import ChunkCopier, LayerLoad
from kvstore.kvcopy.verified import Hasher
from kvstore.layout import KVLayout

pytestmark = pytest.mark.cuda

BLOCK, NUM_BLOCKS = 16, 48
CUDA = torch.device("cuda")
SLEEP_CYCLES = 200_000_000  # ~0.1 s of a GPU's clock: long enough to lose any race


def layout_of(codec: str, chunk_tokens: int = 256) -> KVLayout:
    return KVLayout(4, 4, 128, "bfloat16", chunk_tokens=chunk_tokens, codec=codec)


def filled(layout: KVLayout, order, device, seed: int | None) -> list[torch.Tensor]:
    """Per-layer paged views in physical `order`, holding the same values on every device."""
    layers = paged_layers(layout, BLOCK, NUM_BLOCKS, order, device)
    generator = torch.Generator().manual_seed(seed or 0)
    for layer in layers:
        values = torch.randn(layer.shape, generator=generator) if seed is not None else 0
        layer.copy_(torch.as_tensor(values).to(layer.dtype))
    return layers


def save(copier: ChunkCopier, layers, blocks) -> tuple[torch.Tensor, int]:
    layout = copier.layout
    payload = torch.zeros(layout.payload_bytes, dtype=torch.uint8, pin_memory=True)
    index, hasher = copier.block_index(blocks), Hasher()
    copier.after_compute()
    for layer, paged in enumerate(layers):
        start, stop = layout.layer_range(layer)
        copier.save_layer(paged, index, payload[start:stop], hasher)
    copier.synchronize()
    return payload, hasher.intdigest()


def load(copier: ChunkCopier, payload: torch.Tensor, layers, blocks) -> int:
    layout = copier.layout
    index, hasher = copier.block_index(blocks), Hasher()
    copier.after_compute()
    for layer, paged in enumerate(layers):
        start, stop = layout.layer_range(layer)
        copier.load_layer(payload[start:stop], hasher, paged, index)
        copier.record(layer)
    copier.synchronize()
    return hasher.intdigest()


SAVED_FROM = list(range(5, 5 + 16))[::-1]  # 16 blocks, out of order
LOADED_INTO = list(range(30, 46))


@pytest.mark.parametrize("codec", ["raw", "fp8"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_chunk_round_trips_on_the_device_as_on_the_cpu(name, codec):
    layout = layout_of(codec)
    on_cpu = filled(layout, LAYOUTS[name], "cpu", seed=1)
    on_gpu = filled(layout, LAYOUTS[name], CUDA, seed=1)
    cpu_payload, _ = save(ChunkCopier(layout, BLOCK, "cpu"), on_cpu, SAVED_FROM)
    gpu_copier = ChunkCopier(layout, BLOCK, CUDA)
    gpu_payload, saved_digest = save(gpu_copier, on_gpu, SAVED_FROM)
    assert saved_digest == xxhash.xxh3_64_intdigest(gpu_payload.numpy())
    if codec == "raw":
        assert torch.equal(gpu_payload, cpu_payload)
    targets = {device: filled(layout, LAYOUTS[name], device, None) for device in ("cpu", CUDA)}
    cpu_digest = load(ChunkCopier(layout, BLOCK, "cpu"), cpu_payload, targets["cpu"], LOADED_INTO)
    gpu_digest = load(gpu_copier, cpu_payload, targets[CUDA], LOADED_INTO)
    assert gpu_digest == cpu_digest == xxhash.xxh3_64_intdigest(cpu_payload.numpy())
    for cpu_layer, gpu_layer, source in zip(targets["cpu"], targets[CUDA], on_cpu, strict=True):
        assert torch.equal(gpu_layer.cpu(), cpu_layer), "the device decodes as the CPU does"
        if codec == "raw":
            assert torch.equal(cpu_layer[LOADED_INTO], source[SAVED_FROM])
        untouched = [b for b in range(NUM_BLOCKS) if b not in LOADED_INTO]
        assert not gpu_layer[untouched].any(), "no other block is written"


def test_a_save_reads_what_the_forward_wrote():
    """The forward's write is queued behind a long sleep on the compute stream: a save that
    did not wait for the compute stream would copy the zeros from before it."""
    layout = layout_of("raw")
    layers = filled(layout, LAYOUTS["LBHNC"], CUDA, seed=None)
    copier = ChunkCopier(layout, BLOCK, CUDA)
    torch.cuda._sleep(SLEEP_CYCLES)
    for layer in layers:
        layer.fill_(1.0)
    payload, _ = save(copier, layers, SAVED_FROM)
    assert torch.equal(payload.view(torch.bfloat16), torch.ones_like(payload.view(torch.bfloat16)))


def test_a_layer_waits_for_its_own_load_and_no_longer():
    """The copy stream sleeps before layer 0's load: the compute stream, made to wait on layer
    0's event only, still reads the loaded KV, without a host synchronize between."""
    layout = layout_of("raw")
    source = filled(layout, LAYOUTS["BLNHC"], "cpu", seed=3)
    payload, _ = save(ChunkCopier(layout, BLOCK, "cpu"), source, SAVED_FROM)
    pinned = payload.pin_memory()
    target = filled(layout, LAYOUTS["BLNHC"], CUDA, seed=None)
    copier = ChunkCopier(layout, BLOCK, CUDA)
    index, hasher = copier.block_index(LOADED_INTO), Hasher()
    copier.after_compute()  # the index is copied to the device on the compute stream
    with torch.cuda.stream(copier.streams.stream):
        torch.cuda._sleep(SLEEP_CYCLES)
    start, stop = layout.layer_range(0)
    copier.load_layer(pinned[start:stop], hasher, target[0], index)
    copier.record(0)
    copier.wait(0)  # what the connector's wait_for_layer does, on the compute stream
    seen = target[0][LOADED_INTO].clone()  # queued on the compute stream
    torch.cuda.current_stream().synchronize()
    assert torch.equal(seen.cpu(), source[0][SAVED_FROM])
    copier.synchronize()


def test_a_steps_marker_completes_with_its_copies_and_hashes():
    layout = layout_of("raw")
    layers = filled(layout, LAYOUTS["LHBNC"], CUDA, seed=4)
    copier = ChunkCopier(layout, BLOCK, CUDA)
    payload = torch.zeros(layout.payload_bytes, dtype=torch.uint8, pin_memory=True)
    index, hasher = copier.block_index(SAVED_FROM), Hasher()
    copier.after_compute()
    with torch.cuda.stream(copier.streams.stream):
        torch.cuda._sleep(SLEEP_CYCLES)
    for layer, paged in enumerate(layers):
        start, stop = layout.layer_range(layer)
        copier.save_layer(paged, index, payload[start:stop], hasher)
    done = copier.streams.step_done()
    assert not done.query(), "the step's copies are still queued behind the sleep"
    done.synchronize()
    assert done.query()
    assert hasher.intdigest() == xxhash.xxh3_64_intdigest(payload.numpy())


def test_the_copies_of_a_chunk_layer_do_not_grow_with_its_blocks():
    """On the device too: the kernels one chunk layer launches, counted by the profiler, are
    the same for 1 and 64 blocks per chunk."""
    from torch.profiler import ProfilerActivity, profile

    def kernels(blocks_per_chunk: int) -> int:
        layout = KVLayout(1, 4, 128, "bfloat16", chunk_tokens=BLOCK * blocks_per_chunk)
        layers = paged_layers(layout, BLOCK, blocks_per_chunk, LAYOUTS["LBHNC"], CUDA)
        copier = ChunkCopier(layout, BLOCK, CUDA)
        payload = torch.zeros(layout.payload_bytes, dtype=torch.uint8, pin_memory=True)
        index = copier.block_index(list(range(blocks_per_chunk)))
        copier.after_compute()
        with profile(activities=[ProfilerActivity.CUDA]) as profiled:
            copier.save_layer(layers[0], index, payload, Hasher())
            copier.load_layer(payload, Hasher(), layers[0], index)
            copier.synchronize()
        return sum(1 for event in profiled.events() if event.device_type.name == "CUDA")

    assert kernels(1) == kernels(64)


CHUNK_TOKENS = 4 * BLOCK  # the side-by-side tests: four chunks of four blocks


def saved_side_by_side(layout: KVLayout, chunks: int, source) -> tuple[torch.Tensor, list[int]]:
    """`chunks` chunks of `source` saved on the CPU into pinned pages side by side (an arena,
    a 4 KiB header before each payload), and each payload's checksum."""
    page_bytes = 4096 + layout.payload_bytes
    arena = torch.zeros(chunks * page_bytes, dtype=torch.uint8).pin_memory()
    copier = ChunkCopier(layout, BLOCK, "cpu")
    sums = []
    for chunk in range(chunks):
        payload = arena[chunk * page_bytes + 4096 : (chunk + 1) * page_bytes]
        index = copier.block_index(SAVED_FROM[chunk * 4 : chunk * 4 + 4])
        for layer, paged in enumerate(source):
            start, stop = layout.layer_range(layer)
            copier.save_layer(paged, index, payload[start:stop], None)
        sums.append(xxhash.xxh3_64_intdigest(payload.numpy()))
    return arena.view(chunks, page_bytes)[:, 4096:], sums


def load_side_by_side(copier: ChunkCopier, payloads, order: list[int], layers) -> list[int]:
    """A layer of the chunks in `order` per call, into LOADED_INTO; each chunk's digest."""
    layout = copier.layout
    indexes = [copier.block_index(LOADED_INTO[chunk * 4 : chunk * 4 + 4]) for chunk in order]
    hashers = [Hasher() for _ in order]
    copier.after_compute()
    for layer, paged in enumerate(layers):
        start, stop = layout.layer_range(layer)
        loads = [
            LayerLoad(payloads[chunk][start:stop], hasher, paged, index)
            for chunk, hasher, index in zip(order, hashers, indexes, strict=True)
        ]
        copier.load_layers(loads)
        copier.record(layer)
    copier.synchronize()
    return [hasher.intdigest() for hasher in hashers]


@pytest.mark.parametrize("codec", ["raw", "fp8"])
@pytest.mark.parametrize(("order", "uploads"), [([0, 1, 2, 3], 1), ([3, 2, 1, 0], 4)])
def test_chunks_side_by_side_load_in_one_dma_per_layer(codec, order, uploads):
    """Four chunks' pages side by side go up in one strided DMA per layer (in the reverse
    order, one each), land where the CPU's copies put them, and each digest is its own
    page's checksum."""
    layout = layout_of(codec, CHUNK_TOKENS)
    on_cpu = filled(layout, LAYOUTS["BLNHC"], "cpu", seed=5)
    payloads, sums = saved_side_by_side(layout, 4, on_cpu)
    targets = {device: filled(layout, LAYOUTS["BLNHC"], device, None) for device in ("cpu", CUDA)}
    cpu_digests = load_side_by_side(
        ChunkCopier(layout, BLOCK, "cpu"), payloads, order, targets["cpu"]
    )
    copier = ChunkCopier(layout, BLOCK, CUDA)
    digests = load_side_by_side(copier, payloads, order, targets[CUDA])
    assert copier.streams.uploads == uploads * layout.num_layers
    assert digests == cpu_digests == [sums[chunk] for chunk in order]
    for cpu_layer, gpu_layer in zip(targets["cpu"], targets[CUDA], strict=True):
        assert torch.equal(gpu_layer.cpu(), cpu_layer)


def test_a_corrupted_page_in_a_batched_dma_fails_its_own_chunk():
    layout = layout_of("raw", CHUNK_TOKENS)
    payloads, sums = saved_side_by_side(layout, 4, filled(layout, LAYOUTS["LBHNC"], "cpu", 6))
    payloads[1][layout.layer_range(2)[0] + 7] ^= 0xFF
    copier = ChunkCopier(layout, BLOCK, CUDA)
    target = filled(layout, LAYOUTS["LBHNC"], CUDA, None)
    digests = load_side_by_side(copier, payloads, [0, 1, 2, 3], target)
    assert copier.streams.uploads == layout.num_layers
    assert [d == s for d, s in zip(digests, sums, strict=True)] == [True, False, True, True]


def test_a_batched_dma_is_fewer_host_to_device_copies():
    """Counted by the profiler: the copies from host to device of four chunks' layers, side by
    side (one per layer) and in the reverse order (four per layer)."""
    from torch.profiler import ProfilerActivity, profile

    layout = layout_of("raw", CHUNK_TOKENS)
    payloads, _ = saved_side_by_side(layout, 4, filled(layout, LAYOUTS["LBHNC"], "cpu", 7))
    target = filled(layout, LAYOUTS["LBHNC"], CUDA, None)

    def host_to_device(order: list[int]) -> int:
        copier = ChunkCopier(layout, BLOCK, CUDA)
        load_side_by_side(copier, payloads, order, target)  # warm: indexes, buffers
        with profile(activities=[ProfilerActivity.CUDA]) as profiled:
            load_side_by_side(copier, payloads, order, target)
        names = [event.name for event in profiled.events() if event.device_type.name == "CUDA"]
        return sum(1 for name in names if "HtoD" in name)

    assert host_to_device([0, 1, 2, 3]) < host_to_device([3, 2, 1, 0])
