"""Eviction policies for the tiers of a node-local store; importing registers every policy."""

from kvstore.eviction import arc, belady, lru, prefix_lru, prefix_reuse, s3fifo  # noqa: F401
from kvstore.eviction.base import EvictionPolicy, make_policy, policy_names, register_policy

__all__ = ["EvictionPolicy", "make_policy", "policy_names", "register_policy"]
