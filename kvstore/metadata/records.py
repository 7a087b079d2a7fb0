"""The metadata service's records: nodes with leases, block holdings and entries, index
events, lease ids. Shared by the service, its index backends, its clients and the node agents
(plain frozen dataclasses, no I/O).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from kvstore.tier import STORED_NAMES


def new_lease_id() -> int:
    """A node's lease id, which gates its heartbeats, publishes and deregistration: 63
    random bits, never 0, so no other caller guesses it (counters were guessable)."""
    return secrets.randbits(63) | 1


TIERS = STORED_NAMES  # fastest first; the proto's Tier enum in the same order


@dataclass(frozen=True)
class NodeRecord:
    node_id: str
    tcp_address: str = ""
    ucx_address: str = ""
    tier_capacity_bytes: dict[str, int] = field(default_factory=dict)
    lease_id: int = 0
    lease_ttl_ms: int = 0
    expires_at: float = 0.0  # wall-clock seconds; a node is alive while now < expires_at


@dataclass(frozen=True)
class Holding:
    node_id: str
    tier: str
    size_bytes: int = 0
    checksum: int = 0


@dataclass(frozen=True)
class BlockEntry:
    """One block a node publishes or unpublishes. `anchor`: where a sharded index keeps it,
    the key at depth 1 of its chain (b"": the key is its chain's first, kept on every shard;
    None: unknown, kept on the key's own shard, and a lookup reads it at a second round trip).
    Unpublish names the anchor it published with."""

    key: bytes
    tier: str
    size_bytes: int = 0
    checksum: int = 0
    anchor: bytes | None = None


@dataclass(frozen=True)
class IndexEvent:
    seq: int
    kind: str  # "stored" | "removed"
    tenant: str
    key: bytes
    node_id: str
    tier: str


@dataclass(frozen=True)
class EventPage:
    events: list[IndexEvent]
    gap: bool  # events between the requested seq and events[0] (or last_seq) were dropped
    last_seq: int  # the newest seq the index has issued
