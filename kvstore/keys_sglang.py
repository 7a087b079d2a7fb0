"""Keys that mean the same in every engine and TP size: SGLang's chained page hashes,
reproduced, and the kvstore key of each kv-head group's block of a page under a namespace.

Pure functions, used by both connectors (vLLM's scheduler and workers, SGLang's backend).
SGLang's `get_hash_str`: hash_i = SHA-256(digest_{i-1} || page i's token ids as little-endian
uint32); a page holding an id above 2**32-1 hashes a 0xff tag and uint64 ids instead.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvstore.errors import ConfigError
from kvstore.keys import KEY_BYTES, BlockKey, Namespace
from kvstore.layout import KVLayout

_GROUP_PERSON = b"kvstore-group1"
_UINT32_MAX = 2**32 - 1
_WIDE_TAG = b"\xff"


def sglang_page_hashes(
    token_ids: Sequence[int] | np.ndarray, page_tokens: int, prior_hash: str | None = None
) -> list[str]:
    """SGLang's hex page hashes of every full page of `token_ids` (a trailing partial page has
    none), chained from `prior_hash` (SGLang's hash of the page before, or its namespace
    seed for salted requests; None for a prompt's first page)."""
    if page_tokens <= 0:
        raise ConfigError(f"page_tokens must be positive, got {page_tokens}")
    tokens = np.asarray(token_ids)
    if tokens.ndim != 1 or (tokens.size and not np.issubdtype(tokens.dtype, np.integer)):
        raise ConfigError("token ids must be a one-dimensional sequence of integers")
    if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(np.int64).max):
        raise ConfigError("token ids must be non-negative int64 values (as SGLang hashes them)")
    digest = bytes.fromhex(prior_hash) if prior_hash else b""
    hashes = []
    for start in range(0, len(tokens) - page_tokens + 1, page_tokens):
        page = tokens[start : start + page_tokens]
        sha = hashlib.sha256(digest)
        if page.max() > _UINT32_MAX:
            sha.update(_WIDE_TAG + np.ascontiguousarray(page, "<u8").tobytes())
        else:
            sha.update(np.ascontiguousarray(page, "<u4").tobytes())
        digest = sha.digest()
        hashes.append(digest.hex())
    return hashes


def sglang_chain_seed(extra_key: str | None, cache_salt: str | None) -> str | None:
    """The `prior_hash` SGLang starts a request's chain with (`storage_namespace_seed`): None
    for a plain request, else a hash of its extra key (e.g. a LoRA id) and cache salt."""
    if extra_key is None and cache_salt is None:
        return None
    digest = hashlib.sha256(b"sglang-cache-namespace-v1")
    for part in (extra_key, cache_salt):  # presence and length keep the parts apart
        if part is None:
            digest.update(b"\x00")
            continue
        encoded = part.encode()
        digest.update(b"\x01" + len(encoded).to_bytes(8, "little") + encoded)
    return digest.hexdigest()


def group_block_key(root: bytes, page_key: bytes, group: int) -> BlockKey:
    """The kvstore key of head group `group`'s block of the page named `page_key` (a chain key:
    SGLang's hex page hash as ASCII, or a kvstore chunk key) in the namespace of `root`.
    Keyed BLAKE2b: no tenant can forge another namespace's keys."""
    digest = hashlib.blake2b(page_key, digest_size=KEY_BYTES, key=root, person=_GROUP_PERSON)
    digest.update(group.to_bytes(4, "little"))
    return BlockKey(digest.digest())


@dataclass(frozen=True)
class HeadGroups:
    """The kv-head groups one TP rank owns: groups [first, first + count) of `group_heads`
    heads each; local group i is heads [i * group_heads, (i+1) * group_heads) of the rank.
    MLA (no head axis): one group of `group_heads` = 0."""

    total_heads: int
    group_heads: int
    first: int
    count: int

    def local_heads(self, index: int) -> slice:
        return slice(index * self.group_heads, (index + 1) * self.group_heads)

    def keys(self, root: bytes, page_key: bytes) -> list[BlockKey]:
        """This rank's block keys of one page, in group order."""
        return [group_block_key(root, page_key, self.first + i) for i in range(self.count)]


def head_groups(total_heads: int, tp_size: int, tp_rank: int, head_group_size: int) -> HeadGroups:
    """Rank `tp_rank` owns heads [rank*H/tp, (rank+1)*H/tp) (one shared head when tp > H);
    `head_group_size` (fleet-wide; 0: this rank's heads, shared only with the same TP size)
    must divide them. ConfigError saying what to set otherwise."""
    if total_heads <= 0 or tp_size <= 0 or not 0 <= tp_rank < tp_size:
        raise ConfigError(f"bad head split: {total_heads} kv heads, tp rank {tp_rank}/{tp_size}")
    if tp_size <= total_heads:
        if total_heads % tp_size:
            raise ConfigError(
                f"tp size {tp_size} does not divide the model's {total_heads} kv heads"
            )
        rank_heads, first_head = total_heads // tp_size, tp_rank * (total_heads // tp_size)
    else:  # vLLM replicates: each rank holds one head, shared with tp / H - 1 other ranks
        if tp_size % total_heads:
            raise ConfigError(f"tp size {tp_size} is not a multiple of {total_heads} kv heads")
        rank_heads, first_head = 1, tp_rank * total_heads // tp_size
    group = head_group_size or rank_heads
    if group < 0 or rank_heads % group:
        raise ConfigError(
            f"head_group_size {head_group_size} must divide this rank's {rank_heads} kv heads "
            f"(of {total_heads}, tp {tp_size}); a fleet-wide value divides every TP size's "
            f"share: {total_heads} / the largest TP size, or 1"
        )
    return HeadGroups(total_heads, group, first_head // group, rank_heads // group)


def shared_namespace(
    fingerprint: str,
    block_layout: KVLayout,
    total_heads: int,
    layers: tuple[int, int],
    tenant: str,
    salt: str,
    engine_layout: str = "",
) -> Namespace:
    """The namespace of head-group blocks: the model, the block's layout (group heads, head dim,
    dtype, page tokens, codec), the model's kv heads and the layer range, tenant and salt;
    never the TP size or rank, nor the engine unless `engine_layout` names a layout only that
    engine can read."""
    layout_id = f"{block_layout.layout_id}|kv{total_heads}|layers{layers[0]}:{layers[1]}"
    if engine_layout:
        layout_id += f"|{engine_layout}"
    return Namespace(fingerprint, layout_id, tenant=tenant, salt=salt)
