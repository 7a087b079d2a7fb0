"""Each tenant's share of a TieredStore's top tier: the limits (ArenaLimits), reserved and
pinned pages counted per tenant and refused past a tenant's share, reservations that expire
unless their writer claims them, and pages kept free of saves for promotions from disk.

A mixin of TieredStore (kvstore/store.py), whose lock, slots, pending writes and per-tenant
counters it uses; runs in the node agent's worker threads (their saves and loads) and at each
metrics scrape.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass

from kvstore.errors import CapacityError, ConfigError, QuotaExceededError
from kvstore.store_received import PendingWrite

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ArenaLimits:
    """How tenants share the top tier's pages (the defaults bound nothing).

    `tenant_share`: the fraction of the pages one tenant's reservations and pins may hold
    while another tenant has blocks, reservations or pins there. `promotion_reserve_pages`:
    pages no save may reserve, so that a block below can always be promoted to be read.
    `reservation_ttl_s`: a worker's save not claimed for commit by then is released (0: never).
    """

    tenant_share: float = 1.0
    promotion_reserve_pages: int = 0
    reservation_ttl_s: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.tenant_share <= 1 or self.promotion_reserve_pages < 0:
            raise ConfigError("tenant_share must be in (0, 1], promotion_reserve_pages >= 0")
        if self.reservation_ttl_s < 0:
            raise ConfigError("reservation_ttl_s must be >= 0 (0: reservations never expire)")


class ArenaShares:
    """Tenants' shares, reservation expiry and the promotion reserve of TieredStore."""

    def _within_share(self, tenant: str, raise_if_not: bool) -> bool:
        """Under the lock: whether `tenant` may hold one more top-tier page reserved or pinned
        (always while no other tenant uses the tier). Past its share, False, or with
        `raise_if_not` QuotaExceededError; counted either way."""
        top = self.slots[0].tier
        limit = max(1, int(self.limits.tenant_share * top.capacity_pages))
        held = self._reserved[tenant] + self._pinned[tenant]
        if held >= limit and self.expire_reservations():
            held = self._reserved[tenant] + self._pinned[tenant]
        if held < limit or not self._others_use_top(tenant):
            return True
        self.share_refusals += 1
        if raise_if_not:
            raise QuotaExceededError(
                f"tenant {tenant!r} holds {held} of this node's {top.capacity_pages} "
                f"{top.kind} pages reserved or pinned, its share while other tenants use them "
                "(--tenant-share): commit saves or release loads first"
            )
        return False

    def _others_use_top(self, tenant: str) -> bool:
        kind = self.slots[0].tier.kind
        users = (*self._reserved, *self._pinned)
        return any(other != tenant for other in users) or any(
            other != tenant and where == kind for other, where in self._stored
        )

    def tenant_pages(self) -> dict[str, dict[str, int]]:
        """Per tenant: pages its saves reserved, blocks pinned, and blocks stored per tier
        (as "stored_host", "stored_disk")."""
        self.expire_reservations()
        with self._lock:
            pages: dict[str, dict[str, int]] = {}
            for tenant, reserved in self._reserved.items():
                pages.setdefault(tenant, {})["reserved"] = reserved
            for tenant, pinned in self._pinned.items():
                pages.setdefault(tenant, {})["pinned"] = pinned
            for (tenant, kind), stored in self._stored.items():
                pages.setdefault(tenant, {})[f"stored_{kind}"] = stored
            return pages

    def _check_room_for_saves(self) -> None:
        """Under the lock: CapacityError when a save's page would leave fewer evictable pages
        than the promotion reserve (a pinned block on disk could then not be read)."""
        top = self.slots[0].tier
        kept = self.limits.promotion_reserve_pages
        if not kept or self._unevictable() < top.capacity_pages - kept:
            return
        if self.expire_reservations() and self._unevictable() < top.capacity_pages - kept:
            return
        raise CapacityError(
            f"{top.kind} tier: {self._unevictable()} of {top.capacity_pages} pages are reserved "
            f"or pinned; the last {kept} are kept for promotions"
        )

    def _unevictable(self) -> int:
        """Top-tier pages reserved or pinned (a pin below the top tier counts too: rare, and
        erring on the side of room for promotions)."""
        return len(self._pending) + len(self._pins)

    def claim(self, key: bytes, writer: object) -> bool:
        """Whether `writer`'s reservation of `key` is still there; if so it no longer expires
        (its writer is about to commit or abort it). Call before copying into its page."""
        with self._lock:
            pending = self._pending.get(key)
            if pending is None or pending.writer is not writer:
                return False
            pending.claimed = True
            return True

    def expire_reservations(self) -> int:
        """Release worker reservations older than the reservation TTL and not claimed; returns
        how many (counted in expired_reservations). Runs whenever pages are wanted and none
        is free (a save, a promotion, a tenant at its share) and at each metrics scrape."""
        ttl_s = self.limits.reservation_ttl_s
        if not ttl_s:
            return 0
        now = time.monotonic()
        with self._lock:
            stale = [
                key
                for key, pending in self._pending.items()
                if pending.writer is not None
                and not pending.claimed
                and now - pending.reserved_at > ttl_s
            ]
            for key in stale:
                self.slots[self._drop_pending(key).slot].tier.release(key)
            self.expired_reservations += len(stale)
        if stale:
            logger.warning(
                "released %d reservations not committed within %.0f s", len(stale), ttl_s
            )
        return len(stale)

    def _drop_pending(self, key: bytes) -> PendingWrite:
        """Under the lock: forget `key`'s reservation (its page stays the caller's to free or
        commit) and what it counted against its tenant."""
        pending = self._pending.pop(key)
        if pending.arrived is None:  # a save's page (reserve), not a block from a peer
            count_change(self._reserved, pending.header.tenant, -1)
        return pending


def count_change(counter: Counter, name: object, change: int) -> None:
    """Add `change` to `counter[name]`, dropping names that reach zero (so a counter's keys
    are exactly who holds something)."""
    left = counter[name] + change
    if left > 0:
        counter[name] = left
    else:
        counter.pop(name, None)
