"""kvstore._copyhash: the one-pass copy + xxh3-64 every verified copy goes through. Its digest
must equal python-xxhash's xxh3_64 of the same bytes however they arrive (any split, any
strides, copied or only hashed), on every copy loop this CPU runs; it must be the digest of
what the destination received; and bad arguments are clear errors that leave the state as it
was."""

import itertools
import os
import subprocess
import sys
import sysconfig
import threading
from pathlib import Path

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

import kvstore
from kvstore._copyhash import Hasher, best_isa, plain_copy

ISAS = ["portable"] + (["avx2"] if best_isa() == "avx2" else [])


def reference(data) -> int:
    return xxhash.xxh3_64_intdigest(np.ascontiguousarray(data))


@pytest.mark.parametrize("isa", ISAS)
def test_every_length_up_to_past_two_blocks_hashes_as_xxh3(isa):
    """Lengths around every boundary the algorithm has: short inputs (≤ 240), the 256-byte
    buffer, stripes (64) and blocks (1024), in one piece, copied and hashed."""
    data = np.random.default_rng(0).integers(0, 256, 2200, dtype=np.uint8)
    for length in range(2200):
        copier, hasher = Hasher(isa=isa), Hasher(isa=isa)
        copied = np.zeros(length, np.uint8)
        copier.copy(copied, data[:length])
        hasher.update(data[:length])
        want = reference(data[:length])
        assert copier.intdigest() == hasher.intdigest() == want, length
        assert np.array_equal(copied, data[:length])


@settings(max_examples=300, deadline=None)
@given(
    length=st.integers(0, 9000),
    cuts=st.lists(st.integers(0, 9000), max_size=8),
    copy_flags=st.lists(st.booleans(), min_size=9, max_size=9),
    isa=st.sampled_from(ISAS),
)
def test_any_split_into_copies_and_updates_gives_the_whole_digest(length, cuts, copy_flags, isa):
    data = np.frombuffer(np.random.default_rng(length).bytes(length), np.uint8)
    bounds = sorted({0, length, *(min(cut, length) for cut in cuts)})
    hasher, copied = Hasher(isa=isa), np.zeros(length, np.uint8)
    for (start, stop), copy in zip(itertools.pairwise(bounds), copy_flags, strict=False):
        if copy:
            hasher.copy(copied[start:stop], data[start:stop])
        else:
            hasher.update(data[start:stop])
            copied[start:stop] = data[start:stop]
    assert hasher.intdigest() == reference(data)
    assert np.array_equal(copied, data)


@pytest.mark.parametrize("isa", ISAS)
def test_pieces_that_end_on_stripe_boundaries_give_the_whole_digest(isa):
    """The runs of a strided copy are often whole stripes (a token's row of 2 KiB): the last
    stripe of each is consumed at once and taken back by the digest if nothing follows."""
    data = np.random.default_rng(1).integers(0, 256, 64 * 70, dtype=np.uint8)
    for piece in (64, 128, 1024, 2048, 64 * 17):
        for total in range(piece, len(data) + 1, piece):
            hasher = Hasher(isa=isa)
            for start in range(0, total, piece):
                hasher.copy(np.empty(piece, np.uint8), data[start : start + piece])
            assert hasher.intdigest() == reference(data[:total]), (piece, total)


@settings(max_examples=300, deadline=None)
@given(
    shape=st.lists(st.integers(1, 7), min_size=1, max_size=4),
    row_bytes=st.one_of(st.integers(1, 300), st.sampled_from([64, 128, 256, 2048])),
    before=st.sampled_from([0, 0, 1, 63, 64, 200, 256, 300, 320, 1024]),
    seed=st.integers(0, 2**32 - 1),
    isa=st.sampled_from(ISAS),
)
def test_strided_copies_hash_the_bytes_in_c_order(shape, row_bytes, before, seed, isa):
    """Both sides strided (transposed, reversed), after `before` bytes already hashed: bytes
    move and are hashed in the logical C order of the shapes, as payload order requires
    whatever the engine's layout. Runs of whole stripes take the loop that keeps the
    accumulators in registers from run to run."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, 256, before, dtype=np.uint8)
    base = rng.integers(0, 256, (*shape, row_bytes), dtype=np.uint8)
    order = [*rng.permutation(len(shape)), len(shape)]
    source = base.transpose(order)[::-1] if len(shape) > 1 else base
    inner = [*rng.permutation(len(shape)), len(shape)]  # the row stays innermost
    destination = np.zeros([source.shape[i] for i in inner], np.uint8).transpose(np.argsort(inner))
    hasher = Hasher(isa=isa)
    hasher.update(prefix)
    hasher.copy(destination, source)
    assert np.array_equal(destination, source)
    whole = np.concatenate([prefix, np.ascontiguousarray(source).ravel()])
    assert hasher.intdigest() == reference(whole)
    hasher.update(prefix)  # more after a copy that ended on a stripe boundary
    assert hasher.intdigest() == reference(np.concatenate([whole, prefix]))


@settings(max_examples=300, deadline=None)
@given(
    outer=st.integers(1, 3),
    rows=st.integers(1, 20),
    inner=st.lists(st.integers(1, 17), min_size=1, max_size=2),
    itemsize=st.sampled_from([1, 2, 4, 8]),
    before=st.sampled_from([0, 1, 64, 300]),
    seed=st.integers(0, 2**32 - 1),
    isa=st.sampled_from(ISAS),
)
def test_a_destination_whose_rows_are_its_smallest_stride_is_copied_through_a_tile(
    outer, rows, inner, itemsize, before, seed, isa
):
    """vLLM's CPU kernels keep K as [head][dim][token]; a payload holds [token][head][dim].
    Such a destination (an axis before the last at a stride of one item) is copied through a
    private tile and transposed out of it, 8 x 8 items at a time where it can: the same bytes
    arrive, and the digest is of the source's bytes in C order, whatever the row count, item
    size or hash state before it."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype(f"u{itemsize}")
    prefix = rng.integers(0, 256, before, dtype=np.uint8)
    source = rng.integers(0, np.iinfo(dtype).max, (outer, rows, *inner), dtype=dtype)
    physical = np.zeros((outer, *inner, rows), dtype)  # rows innermost, as the engine keeps K
    destination = np.moveaxis(physical, -1, 1)
    hasher = Hasher(isa=isa)
    hasher.update(prefix)
    hasher.copy(destination, source)
    assert np.array_equal(destination, source)
    whole = np.concatenate([prefix, source.view(np.uint8).ravel()])
    assert hasher.intdigest() == reference(whole)


def test_a_transposed_k_block_of_vllms_cpu_layout_moves_in_vectors():
    """A K block as vLLM's CPU cache holds it (128 tokens, 8 heads of 64 float32): the 8 x 8
    register path, checked against the item-by-item one and xxh3."""
    rng = np.random.default_rng(7)
    source = rng.integers(0, 2**32 - 1, (128, 8, 64), dtype=np.uint32)
    digests = []
    for isa in ISAS:
        physical = np.zeros((8, 64, 128), np.uint32)
        hasher = Hasher(isa=isa)
        hasher.copy(physical.transpose(2, 0, 1), source)
        assert np.array_equal(physical.transpose(2, 0, 1), source)
        digests.append(hasher.intdigest())
    assert set(digests) == {reference(source)}


def _aligned(shape, dtype, misalign: int) -> np.ndarray:
    """Zeros of `shape` starting `misalign` bytes past a 64-byte boundary."""
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.zeros(size + 128, np.uint8)
    start = -raw.ctypes.data % 64 + misalign
    return raw[start : start + size].view(dtype).reshape(shape)


@pytest.mark.parametrize("misalign", [0, 16])
@pytest.mark.parametrize("before", [0, 1024])
@pytest.mark.parametrize("stream", [False, True])
def test_long_strided_copies_of_kv_rows_arrive_and_hash_whole_both_ways(misalign, before, stream):
    """A chunk layer's K of a head-major engine layer (512 KiB of 256-byte rows a head's block
    apart), into a payload and back out: past STREAM_MIN_BYTES, asked to `stream`, the avx2
    loop writes with streaming stores where the destination's rows are 32-byte aligned
    (misalign 0) and through the cache elsewhere (16); the same bytes arrive and the digest
    is xxh3's."""
    rng = np.random.default_rng(misalign + before)
    prefix = rng.integers(0, 256, before, dtype=np.uint8)
    engine = _aligned((16, 8, 16, 2, 128), np.int16, misalign)  # [block][head][token][K|V]
    engine[...] = rng.integers(-(2**15), 2**15, engine.shape, dtype=np.int16)
    key = engine[:, :, :, 0].transpose(0, 2, 1, 3)  # [block][token][head][dim]
    for isa in ISAS:
        payload = _aligned(key.shape, np.int16, misalign)
        saver = Hasher(isa=isa)
        saver.update(prefix)
        saver.copy(payload, key, stream)
        assert np.array_equal(payload, key)
        whole = np.concatenate([prefix, payload.view(np.uint8).ravel()])
        assert saver.intdigest() == reference(whole)
        target = _aligned(engine.shape, np.int16, misalign)
        loader = Hasher(isa=isa)
        loader.update(prefix)
        loader.copy(target[:, :, :, 0].transpose(0, 2, 1, 3), payload, stream)
        assert np.array_equal(target[:, :, :, 0], engine[:, :, :, 0])
        assert not target[:, :, :, 1].any()  # V's rows, between K's, untouched
        assert loader.intdigest() == reference(whole)


def test_a_page_first_host_page_copies_into_a_layer_major_payload():
    """SGLang's page_first pool keeps a page token-major ([components, tokens, layers, row]);
    the payload is layer-major ([layers, components, tokens, row])."""
    rng = np.random.default_rng(2)
    pool = rng.integers(0, 256, (2, 4 * 16, 6, 2048), dtype=np.uint8)  # 4 pages of 16 tokens
    page = pool[:, 16:32].transpose(2, 0, 1, 3)  # page 1, in payload order
    payload = np.zeros((6, 2, 16, 2048), np.uint8)
    hasher = Hasher()
    hasher.copy(payload, page)
    assert hasher.intdigest() == xxhash.xxh3_64_intdigest(payload)
    assert np.array_equal(payload, page)


def test_bad_arguments_are_clear_errors_and_leave_the_state_unchanged():
    data = np.arange(1000, dtype=np.uint32).view(np.uint8)
    hasher = Hasher()
    hasher.update(data[:500])
    with pytest.raises(ValueError, match="differ in shape"):
        hasher.copy(np.zeros(10, np.uint8), np.zeros(11, np.uint8))
    with pytest.raises(ValueError, match="differ in shape"):
        hasher.copy(np.zeros((2, 5), np.uint8), np.zeros((5, 2), np.uint8))
    with pytest.raises(BufferError):
        hasher.copy(bytes(10), np.zeros(10, np.uint8))  # read-only destination
    with pytest.raises((BufferError, ValueError), match="contiguous"):
        hasher.update(np.zeros((4, 4), np.uint8)[:, 0])  # update hashes contiguous bytes only
    with pytest.raises(TypeError):
        hasher.copy(np.zeros(3, np.uint8))
    hasher.update(data[500:])
    assert hasher.intdigest() == xxhash.xxh3_64_intdigest(data)
    with pytest.raises(ValueError, match="isa sse9"):
        Hasher(isa="sse9")
    with pytest.raises(ValueError, match="plain_copy"):
        plain_copy(np.zeros(3, np.uint8), np.zeros(4, np.uint8))


@pytest.mark.parametrize("call", ["update", "intdigest", "__init__", "reset"])
def test_one_hasher_used_by_two_threads_at_once_is_refused(call):
    """A copy releases the GIL; any other call on the same hasher meanwhile is a RuntimeError,
    not a torn state (a re-__init__ during a copy let a second update overflow the buffer and
    crash; an intdigest read half-updated state). 2 Mi one-byte runs keep the copy going long
    enough to be caught; its digest is then still the copy's."""
    source = np.random.default_rng(3).integers(0, 256, (1 << 21, 2), dtype=np.uint8)[:, :1]
    destination = np.zeros((1 << 21, 1), np.uint8)
    hasher = Hasher()
    started = threading.Event()
    calls = {
        "update": lambda: hasher.update(b"x"),
        "intdigest": hasher.intdigest,
        "__init__": hasher.__init__,
        "reset": hasher.reset,
    }

    def copy():
        started.set()
        hasher.copy(destination, source)

    copier = threading.Thread(target=copy)
    refused = accepted = 0
    copier.start()
    started.wait()
    while copier.is_alive():
        try:
            calls[call]()
            accepted += 1
        except RuntimeError as error:
            assert "two threads" in str(error)
            refused += 1
    copier.join()
    assert refused > 0
    assert np.array_equal(destination, source)
    if accepted == 0 or call == "intdigest":  # every other call was refused: the copy's digest
        assert hasher.intdigest() == reference(source)


def test_a_hasher_made_without_init_hashes_as_xxh3():
    data = np.arange(1000, dtype=np.uint16).view(np.uint8)
    hasher = Hasher.__new__(Hasher)
    hasher.update(data)
    assert hasher.intdigest() == reference(data)


def test_overlapping_buffers_are_refused():
    """memcpy over overlapping bytes is undefined, and a destination that repeats bytes would
    not hold what was hashed: both are refused before a byte moves."""
    data = np.arange(4096, dtype=np.uint8)
    before = data.copy()
    hasher = Hasher()
    with pytest.raises(ValueError, match="overlap"):
        hasher.copy(data[7:], data[:-7])
    with pytest.raises(ValueError, match="overlap"):
        hasher.copy(data[::2][:1000], data[1::2][:1000])  # interleaved extents
    repeated = np.lib.stride_tricks.as_strided(np.zeros(1, np.uint8), (100,), (0,), writeable=True)
    with pytest.raises(ValueError, match="repeats bytes"):
        hasher.copy(repeated, data[:100])
    rows = np.zeros(64, np.uint8)
    sliding = np.lib.stride_tricks.as_strided(rows, (4, 32), (8, 1), writeable=True)
    with pytest.raises(ValueError, match="repeats bytes"):  # rows 8 bytes apart, 32 wide
        hasher.copy(sliding, data[:128].reshape(4, 32))
    with pytest.raises(ValueError, match="overlap"):
        plain_copy(data[1:], data[:-1])
    assert np.array_equal(data, before)
    assert hasher.intdigest() == xxhash.xxh3_64_intdigest(b"")


def test_a_build_with_avx2_vector_code_does_not_assume_an_aligned_object(tmp_path):
    """Built with -mavx2, xxhash.h's own accumulators take aligned 32-byte moves; a Python
    object is only 16-byte aligned (with the system malloc, 16 mod 32 half the time): it
    crashed there. A child process with PYTHONMALLOC=malloc hashes many fresh hashers."""
    native = Path(kvstore.__file__).parent / "native"
    built = tmp_path / f"_copyhash{sysconfig.get_config_var('EXT_SUFFIX')}"
    subprocess.run(
        [
            "gcc",
            "-shared",
            "-fPIC",
            "-O2",
            "-mavx2",
            f"-I{native}",
            f"-I{sysconfig.get_paths()['include']}",
            str(native / "copyhash.c"),
            "-o",
            str(built),
        ],
        check=True,
    )
    child = (
        "import importlib.util, numpy, xxhash\n"
        f"spec = importlib.util.spec_from_file_location('kvstore._copyhash', {str(built)!r})\n"
        "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n"
        "Hasher, best_isa = module.Hasher, module.best_isa\n"
        "keep = []\n"
        "for isa in {'portable', best_isa()}:\n"
        "    for size in (100, 300, 1000, 5000):\n"
        "        data = numpy.arange(size, dtype=numpy.uint16).view(numpy.uint8)\n"
        "        for _ in range(16):\n"
        "            h = Hasher(isa=isa); keep.append(h); h.update(data)\n"
        "            assert h.intdigest() == xxhash.xxh3_64_intdigest(data)\n"
    )
    env = {**os.environ, "PYTHONMALLOC": "malloc"}
    result = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True)
    assert result.returncode == 0, result.stderr.decode()[-2000:]


def test_plain_copy_copies():
    source = np.random.default_rng(4).integers(0, 256, 100_003, dtype=np.uint8)
    destination = np.zeros_like(source)
    plain_copy(destination, source)
    assert np.array_equal(destination, source)
