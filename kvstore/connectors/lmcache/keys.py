"""kvstore keys of LMCache objects. An `ObjectKey` names a chunk by LMCache's chained chunk
hash within its model, KV rank, object group and cache salt; its kvstore key is that hash
under BLAKE2b-128 keyed by the root of a kvstore namespace holding every other field (and the
adapter's tenant and salt), so keys of other models, ranks, groups or salts never collide.

Pure functions; run in the `lmcache server` process.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from functools import lru_cache

from lmcache.v1.distributed.api import ObjectKey

from kvstore.keys import KEY_BYTES, BlockKey, Namespace

_OBJECT_PERSON = b"kvstore-lmc1"
Scope = tuple[str, int, int, str]  # an ObjectKey's model, kv rank, object group, cache salt


def scope(key: ObjectKey) -> Scope:
    """What an ObjectKey says besides its chunk hash."""
    return key.model_name, key.kv_rank, key.object_group_id, key.cache_salt


def object_namespace(of: Scope, tenant: str, salt: str) -> Namespace:
    """The kvstore namespace of one scope under the adapter's tenant and salt."""
    model, kv_rank, group, cache_salt = of
    return Namespace(
        model_fingerprint=f"lmcache-model:{model}",
        layout_id=f"lmcache-object|kv_rank={kv_rank}|group={group}",
        tenant=tenant,
        salt=json.dumps([salt, cache_salt]),  # both, unambiguously
    )


@lru_cache(maxsize=4096)
def _root(of: Scope, tenant: str, salt: str) -> bytes:
    return object_namespace(of, tenant, salt).root_key()


def block_key(key: ObjectKey, tenant: str, salt: str) -> BlockKey:
    """The kvstore key of one LMCache object: deterministic across processes and hosts."""
    root = _root(scope(key), tenant, salt)
    digest = hashlib.blake2b(key.chunk_hash, digest_size=KEY_BYTES, key=root, person=_OBJECT_PERSON)
    return BlockKey(digest.digest())


def scope_runs(keys: Sequence[ObjectKey]) -> list[range]:
    """The maximal runs of consecutive keys of one scope, as index ranges: LMCache lists an
    object group's chunks of a prompt in order, so each run is one prefix chain."""
    runs: list[range] = []
    start = 0
    for index in range(1, len(keys) + 1):
        if index == len(keys) or scope(keys[index - 1]) != scope(keys[index]):
            runs.append(range(start, index))
            start = index
    return runs
