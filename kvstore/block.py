"""Block format: a 128-byte header, then the payload, in one page.

Pure functions, used by whichever process writes or verifies a block (worker, node agent).
The header binds the payload to its key, parent and tenant and carries an xxh3-64 checksum of
the payload; any mismatch raises ChecksumError, which every caller turns into a miss. The tenant
lets a restarted node agent re-publish its disk blocks under the right tenant.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch
import xxhash

from kvstore.errors import ChecksumError, ConfigError
from kvstore.keys import KEY_BYTES, BlockKey

MAGIC = b"KVSB"
FORMAT_VERSION = 1
HEADER_BYTES = 128
MAX_TENANT_BYTES = 64
_NO_PARENT = bytes(KEY_BYTES)
# magic, version, codec id, key, parent, layout hash, payload length, payload checksum, tenant
_HEADER = struct.Struct(f"<4sHH{KEY_BYTES}s{KEY_BYTES}sQQQ{MAX_TENANT_BYTES}s")
assert _HEADER.size == HEADER_BYTES


@dataclass(frozen=True)
class BlockHeader:
    key: BlockKey
    parent: BlockKey | None
    payload_bytes: int
    checksum: int
    layout_hash: int = 0
    codec_id: int = 0
    tenant: str = "default"

    @property
    def block_bytes(self) -> int:
        return HEADER_BYTES + self.payload_bytes


def as_buffer(data: torch.Tensor | memoryview | bytes) -> memoryview:
    """A byte memoryview over a CPU tensor or any buffer, without copying."""
    if isinstance(data, torch.Tensor):
        if data.device.type != "cpu":
            raise ConfigError(f"checksums need host memory; got a tensor on {data.device}")
        return memoryview(data.numpy()).cast("B")
    return memoryview(data).cast("B")


def payload_checksum(payload: torch.Tensor | memoryview | bytes) -> int:
    return xxhash.xxh3_64_intdigest(as_buffer(payload))


def pack_header(header: BlockHeader) -> bytes:
    parent = header.parent if header.parent is not None else _NO_PARENT
    return _HEADER.pack(
        MAGIC,
        FORMAT_VERSION,
        header.codec_id,
        header.key,
        parent,
        header.layout_hash,
        header.payload_bytes,
        header.checksum,
        encode_tenant(header.tenant),
    )


def encode_tenant(tenant: str) -> bytes:
    raw = tenant.encode()
    if not raw or len(raw) > MAX_TENANT_BYTES or b"\0" in raw:
        raise ConfigError(f"tenant {tenant!r} must be 1-{MAX_TENANT_BYTES} bytes without NUL")
    return raw


def unpack_header(data: torch.Tensor | memoryview | bytes) -> BlockHeader:
    """Parse a header; raise ChecksumError when the bytes are not a kvstore block header."""
    raw = as_buffer(data)[:HEADER_BYTES]
    if len(raw) < HEADER_BYTES:
        raise ChecksumError(f"block shorter than its {HEADER_BYTES}-byte header")
    magic, version, codec_id, key, parent, layout_hash, length, checksum, tenant = _HEADER.unpack(
        raw
    )
    if magic != MAGIC or version != FORMAT_VERSION:
        raise ChecksumError(f"not a v{FORMAT_VERSION} kvstore block (magic {magic!r} v{version})")
    return BlockHeader(
        key=BlockKey(key),
        parent=None if parent == _NO_PARENT else BlockKey(parent),
        payload_bytes=length,
        checksum=checksum,
        layout_hash=layout_hash,
        codec_id=codec_id,
        tenant=tenant.rstrip(b"\0").decode(errors="replace"),
    )


def verify(
    block: torch.Tensor | memoryview | bytes, key: BlockKey, checksum: int | None = None
) -> BlockHeader:
    """Check that `block` is a whole, uncorrupted block stored under `key`. `checksum`, if
    given, is the xxh3-64 of all of `block` past its header, taken as those bytes were written
    (nothing writes them since): it is compared instead of hashing the payload again, and
    `block` must then end where its payload does.

    Raises ChecksumError on a wrong magic/version, another key, a short payload or a bad checksum.
    """
    header = unpack_header(block)
    if header.key != key:
        raise ChecksumError(f"block holds {header.key!r}, expected {key!r}")
    buffer = as_buffer(block)
    if len(buffer) < header.block_bytes:
        raise ChecksumError(f"block truncated: {len(buffer)} < {header.block_bytes} bytes")
    if checksum is None:
        checksum = payload_checksum(buffer[HEADER_BYTES : header.block_bytes])
    elif len(buffer) != header.block_bytes:
        raise ChecksumError(f"{len(buffer)} bytes for a block of {header.block_bytes}")
    if checksum != header.checksum:
        raise ChecksumError(f"payload checksum mismatch for {key!r}")
    return header
