"""Small builders shared by the eviction tests."""

import hashlib

from kvstore.eviction import EvictionPolicy
from kvstore.keys import BlockKey


def key(name: object) -> BlockKey:
    return BlockKey(hashlib.blake2b(str(name).encode(), digest_size=16).digest())


def everything(_: BlockKey) -> bool:
    return True


def evict_one(policy: EvictionPolicy) -> BlockKey:
    """What a store does when full: ask for a victim, drop it, tell the policy."""
    victim = policy.victim(everything)
    assert victim is not None
    policy.remove(victim)
    return victim


def admit(policy: EvictionPolicy, capacity: int, new: BlockKey, parent: BlockKey | None = None):
    """Insert `new` into a cache of `capacity` keys, evicting first if it is full."""
    if len(policy) >= capacity:
        evict_one(policy)
    policy.insert(new, parent)
