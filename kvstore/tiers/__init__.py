"""Where block bytes live: a shared host arena or an LMDB disk tier. The GPU tier is the
engine's own paged KV (docs/concepts.md); no kvstore process keeps blocks on a device."""

from kvstore.tiers.base import Tier
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.host import HostTier

__all__ = ["DiskTier", "HostTier", "Tier"]
