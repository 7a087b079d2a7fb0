"""Where block bytes live: device memory, a shared host arena, or an LMDB disk tier."""

from kvstore.tiers.base import Tier
from kvstore.tiers.device import DeviceTier
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.host import HostTier

__all__ = ["DeviceTier", "DiskTier", "HostTier", "Tier"]
