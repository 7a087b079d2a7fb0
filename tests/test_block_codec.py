"""Layout sizes, the raw and fp8 codecs, and the block header's checksum."""

import pytest
import torch

from kvstore import block
from kvstore.codec import decode_block, encode_block, encode_layer
from kvstore.errors import ChecksumError, ConfigError
from kvstore.keys import BlockKey
from kvstore.layout import KVLayout

KEY = BlockKey(bytes(range(16)))


def _layers(layout, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(layout.layer_shape, generator=generator) * (index + 1)).to(layout.torch_dtype)
        for index in range(layout.num_layers)
    ]


def test_layer_slices_are_contiguous_and_cover_the_payload():
    layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype="bfloat16", chunk_tokens=4)
    assert layout.layer_bytes == 2 * 4 * 2 * 8 * 2
    assert [layout.layer_range(i) for i in range(3)] == [(0, 256), (256, 512), (512, 768)]
    assert layout.payload_bytes == 768


def test_fp8_is_half_the_bytes_of_bf16_plus_scales():
    bf16 = KVLayout(32, 8, 128, "bfloat16", 256)
    fp8 = KVLayout(32, 8, 128, "bfloat16", 256, codec="fp8")
    assert fp8.payload_bytes == bf16.payload_bytes // 2 + 32 * fp8.fp8_scale_bytes
    assert bf16.layout_id != fp8.layout_id and bf16.layout_hash != fp8.layout_hash


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_raw_codec_round_trips_exactly(dtype):
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=dtype, chunk_tokens=4)
    layers = _layers(layout)
    payload = torch.empty(layout.payload_bytes, dtype=torch.uint8)
    encode_block(layout, layers, payload)
    assert all(
        torch.equal(a, b) for a, b in zip(layers, decode_block(layout, payload), strict=True)
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_round_trip_error_is_bounded_relative_to_scale(dtype, record_property):
    layout = KVLayout(4, 4, 64, dtype, 32, codec="fp8")
    layers = _layers(layout, seed=1)
    payload = torch.empty(layout.payload_bytes, dtype=torch.uint8)
    encode_block(layout, layers, payload)
    decoded = decode_block(layout, payload)
    worst, means = 0.0, []
    for original, restored in zip(layers, decoded, strict=True):
        scale = original.float().abs().amax(dim=(1, 3), keepdim=True)  # per (K/V, head)
        relative = (original.float() - restored.float()).abs() / scale
        worst = max(worst, relative.max().item())
        means.append(relative.mean().item())
    mean = sum(means) / len(means)
    record_property("fp8_max_abs_error_rel_to_amax", worst)
    record_property("fp8_mean_abs_error_rel_to_amax", mean)
    print(f"fp8 {dtype}: max rel error {worst:.4f}, mean rel error {mean:.5f}")
    # e4m3 has 3 mantissa bits: relative rounding error <= 2^-4 of a value, far less of amax.
    assert worst <= 2**-4
    assert mean < 0.01


def test_fp8_keeps_zeros_and_handles_an_all_zero_layer():
    layout = KVLayout(1, 2, 8, "float32", 4, codec="fp8")
    zeros = [torch.zeros(layout.layer_shape)]
    payload = torch.empty(layout.payload_bytes, dtype=torch.uint8)
    encode_block(layout, zeros, payload)
    assert torch.equal(decode_block(layout, payload)[0], zeros[0])


@pytest.mark.parametrize(
    ("tensor", "message"),
    [
        (torch.zeros(2, 4, 2, 8, dtype=torch.float16), "dtype"),
        (torch.zeros(2, 4, 2, 9, dtype=torch.float32), "shape"),
    ],
)
def test_codec_rejects_wrong_dtype_or_shape(tensor, message):
    layout = KVLayout(1, 2, 8, "float32", 4)
    with pytest.raises(ConfigError, match=message):
        encode_layer(layout, tensor, torch.empty(layout.layer_bytes, dtype=torch.uint8))


def test_layout_rejects_bad_settings():
    with pytest.raises(ConfigError, match="dtype"):
        KVLayout(1, 1, 1, dtype="int8")
    with pytest.raises(ConfigError, match="codec"):
        KVLayout(1, 1, 1, codec="zstd")
    with pytest.raises(ConfigError, match="num_layers"):
        KVLayout(0, 1, 1)


def _sealed_block(payload: bytes, parent=None) -> bytearray:
    header = block.BlockHeader(KEY, parent, len(payload), block.payload_checksum(payload))
    return bytearray(block.pack_header(header) + payload)


def test_header_round_trips_key_parent_and_length():
    parent = BlockKey(bytes(16 * [7]))
    header = block.verify(_sealed_block(b"abc" * 100, parent), KEY)
    assert (header.key, header.parent, header.payload_bytes) == (KEY, parent, 300)


@pytest.mark.parametrize("offset", [0, 5, block.HEADER_BYTES, block.HEADER_BYTES + 299])
def test_any_flipped_byte_is_detected(offset):
    data = _sealed_block(b"abc" * 100)
    data[offset] ^= 0x01
    with pytest.raises(ChecksumError):
        block.verify(data, KEY)


def test_a_block_under_another_key_or_truncated_is_rejected():
    data = _sealed_block(b"abc" * 100)
    with pytest.raises(ChecksumError, match="holds"):
        block.verify(data, BlockKey(bytes(16)))
    with pytest.raises(ChecksumError, match="truncated"):
        block.verify(data[:-1], KEY)
