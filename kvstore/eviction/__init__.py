"""Eviction policies for the tiers of a node-local store; importing registers every policy."""

from kvstore.eviction import (  # noqa: F401
    arc,
    belady,
    lru,
    prefix_arc,
    prefix_lru,
    prefix_reuse,
    reuse_interval,
    s3fifo,
)
from kvstore.eviction.base import EvictionPolicy, make_policy, policy_names, register_policy

__all__ = ["EvictionPolicy", "make_policy", "policy_names", "register_policy"]
