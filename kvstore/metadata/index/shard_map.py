"""Which shard of a sharded index holds a key: each key anchored to its chain.

`shard(key_i) = H(key_min(i, 1)) mod S`: a prompt's keys from depth 1 on share one shard (so a
lookup of a prompt reads one shard); depth-0 keys are kept on every shard (their home shard,
H(key_0), counts and events them). Pure functions, used by redis_shards.py in the service.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from kvstore.errors import ConfigError

ROOT = b""  # an entry's anchor when the key is its chain's first (depth 0)


def shard_of(anchor: bytes, shards: int) -> int:
    """The shard of a chain anchored at `anchor` (and the home shard of a key hashed alone)."""
    digest = hashlib.blake2b(anchor, digest_size=8).digest()
    return int.from_bytes(digest, "big") % shards


def lookup_shard(keys: Sequence[bytes], shards: int) -> int:
    """The one shard a lookup reads: `keys` are a prompt's chained keys from depth 0, so its
    anchor is keys[1] (a one-key prompt: its key's home, which holds every depth-0 key)."""
    return shard_of(keys[1] if len(keys) > 1 else keys[0], shards)


def shard_tags(prefix: str, shards: int, cluster: bool) -> list[bytes]:
    """One hash tag per shard, `{prefix:S:i}` plus the first suffix that puts shard i's slot
    in the i-th of S equal slot ranges: the shards spread over the masters as the slots do
    (a cluster's masters own contiguous ranges). Deterministic: every replica derives the same
    tags from (prefix, S); another S is another set of tags (a layout of its own)."""
    if shards < 1:
        raise ConfigError(f"redis shards must be 1 or more, not {shards}")
    return [_tag(prefix, shard, shards, cluster) for shard in range(shards)]


def _tag(prefix: str, shard: int, shards: int, cluster: bool) -> bytes:
    low = shard * REDIS_CLUSTER_HASH_SLOTS // shards
    high = max((shard + 1) * REDIS_CLUSTER_HASH_SLOTS // shards, low + 1)
    for suffix in range(1 << 20):
        name = f"{prefix}:{shards}:{shard}" + (f".{suffix}" if suffix else "")
        tag = b"{" + name.encode() + b"}"
        if low <= key_slot(tag) < high:
            return tag if cluster else name.encode()
    raise ConfigError(f"no hash tag for shard {shard} of {shards}")  # pragma: no cover


def default_shards(masters: int) -> int:
    """The shard count a cluster of `masters` gets by default: 4 per master, so masters added
    later take whole shards by slot migration (`redis-cli --cluster reshard`) without
    changing S. A standalone server gets 1 (the single-tag index)."""
    return 1 if masters <= 1 else 4 * masters
