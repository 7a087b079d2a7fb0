"""Content addressing: namespaces and the chained BLAKE2b-128 keys of token chunks.

Pure functions, used by every process (connectors, node agents, the metadata service, replay).
key_i = H(key_{i-1} || token ids of chunk i as little-endian int32), key_-1 = H(namespace).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from kvstore.errors import ConfigError

KEY_BYTES = 16
DEFAULT_CHUNK_TOKENS = 256
_NAMESPACE_PERSON = b"kvstore-ns-v1"
_CHUNK_PERSON = b"kvstore-chunk1"
_TAIL_PERSON = b"kvstore-tail1"
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


class BlockKey(bytes):
    """A 16-byte chained content hash naming one block. Compares and hashes as bytes."""

    def __new__(cls, digest: bytes) -> BlockKey:
        if len(digest) != KEY_BYTES:
            raise ConfigError(f"a block key is {KEY_BYTES} bytes, got {len(digest)}")
        return super().__new__(cls, digest)

    @classmethod
    def from_hex(cls, text: str) -> BlockKey:
        try:
            return cls(bytes.fromhex(text))
        except ValueError as exc:
            raise ConfigError(f"a block key is {2 * KEY_BYTES} hex digits, got {text!r}") from exc

    def __repr__(self) -> str:
        return f"BlockKey({self.hex()[:12]}…)"


@dataclass(frozen=True)
class Namespace:
    """Everything that must match for two blocks with the same tokens to be interchangeable.

    `model_fingerprint` names the weights (a revision or a hash of config and weights), not the
    model's name; `layout_id` names the KV layout and codec (see `KVLayout.layout_id`). No TP
    size or rank: a worker keys each kv-head group it holds, so engines of any TP size share
    blocks (keys_sglang.py and connectors/vllm/config.py split the heads into groups).
    `tenant` and `salt` isolate users: different values never share a key.
    """

    model_fingerprint: str
    layout_id: str
    tenant: str = "default"
    salt: str = ""

    def __post_init__(self) -> None:
        if not self.model_fingerprint:
            raise ConfigError("namespace needs a model_fingerprint (a hash of weights/config)")
        if not self.layout_id:
            raise ConfigError("namespace needs a layout_id (KVLayout.layout_id)")
        if not self.tenant:
            raise ConfigError("namespace needs a non-empty tenant")

    def root_key(self) -> BlockKey:
        """The chain's root: a hash of every field, canonically encoded."""
        canonical = json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()
        digest = hashlib.blake2b(canonical, digest_size=KEY_BYTES, person=_NAMESPACE_PERSON)
        return BlockKey(digest.digest())


def chunk_key(parent: bytes, chunk_token_ids: np.ndarray) -> BlockKey:
    """The key of one chunk given its parent's key and its token ids (int32 little-endian)."""
    digest = hashlib.blake2b(parent, digest_size=KEY_BYTES, person=_CHUNK_PERSON)
    digest.update(memoryview(chunk_token_ids))
    return BlockKey(digest.digest())


def tail_key(parent: bytes, tail_token_ids: Sequence[int] | np.ndarray) -> BlockKey:
    """The key of a prompt's tail: the tokens after its last full chunk (fewer than a chunk),
    given the parent's key (the last full chunk's, or the root). Hashed with its own person,
    so a tail never names a full chunk's block, and with its tokens, so tails of different
    lengths never share a key: a longer prompt finds a shorter one's tail only by asking for
    exactly those tokens."""
    digest = hashlib.blake2b(parent, digest_size=KEY_BYTES, person=_TAIL_PERSON)
    digest.update(memoryview(token_array(tail_token_ids)))
    return BlockKey(digest.digest())


def token_array(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Token ids as a contiguous little-endian int32 array; rejects ids outside int32."""
    array = np.asarray(token_ids)
    if array.ndim != 1:
        raise ConfigError(f"token ids must be one-dimensional, got shape {array.shape}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise ConfigError(f"token ids must be integers, got dtype {array.dtype}")
    if array.size and (array.min() < _INT32_MIN or array.max() > _INT32_MAX):
        raise ConfigError("token ids must fit in int32")
    return np.ascontiguousarray(array, dtype="<i4")


def chunk_keys(
    namespace: Namespace, token_ids: Sequence[int] | np.ndarray, chunk_tokens: int
) -> list[BlockKey]:
    """Keys of every full chunk of a prompt, in order. A trailing partial chunk has no key."""
    return chained_keys(namespace.root_key(), token_ids, chunk_tokens)


def chained_keys(
    root: bytes, token_ids: Sequence[int] | np.ndarray, chunk_tokens: int
) -> list[BlockKey]:
    """Keys of every full chunk, chained from `root` (a namespace's, or a request's own)."""
    if chunk_tokens <= 0:
        raise ConfigError(f"chunk_tokens must be positive, got {chunk_tokens}")
    tokens = token_array(token_ids)
    keys: list[BlockKey] = []
    parent: bytes = root
    for start in range(0, len(tokens) - chunk_tokens + 1, chunk_tokens):
        parent = chunk_key(parent, tokens[start : start + chunk_tokens])
        keys.append(parent)
    return keys
