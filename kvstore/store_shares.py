"""Each tenant's share of a node's top tier: the limits (ArenaLimits) and the per-tenant
accounting the store checks them against (TenantShares: reserved, pinned and stored pages).
No lock inside: StoreLedger (kvstore/store_ledger.py) calls it only under its own. Runs in the
node agent (its workers' saves and loads, each metrics scrape).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from kvstore.errors import ConfigError, QuotaExceededError
from kvstore.tiers.base import Tier


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


class TenantShares:
    """Per tenant: top-tier pages its saves reserved, blocks pinned, blocks stored per tier;
    and the refusals of pages past its share. Mutated only under its owner's lock."""

    def __init__(self, limits: ArenaLimits) -> None:
        self.limits = limits
        self.refusals = 0  # reserves and pins refused: the tenant held its share
        self._reserved: Counter[str] = Counter()  # tenant -> its saves' reserved pages
        self._pinned: Counter[str] = Counter()  # tenant -> its pinned blocks
        self._stored: Counter[tuple[str, str]] = Counter()  # (tenant, tier kind) -> blocks

    def count_reserved(self, tenant: str, change: int) -> None:
        count_change(self._reserved, tenant, change)

    def count_pinned(self, tenant: str, change: int) -> None:
        count_change(self._pinned, tenant, change)

    def count_stored(self, tenant: str, kind: str, change: int) -> None:
        count_change(self._stored, (tenant, kind), change)

    def at_share(self, tenant: str, top: Tier) -> bool:
        """Whether `tenant`'s reserved and pinned pages fill its share of `top`'s pages."""
        limit = max(1, int(self.limits.tenant_share * top.capacity_pages))
        return self._reserved[tenant] + self._pinned[tenant] >= limit

    def others_use(self, tenant: str, top: Tier) -> bool:
        """Whether a tenant other than `tenant` reserved, pinned or stored pages in `top`."""
        users = (*self._reserved, *self._pinned)
        return any(other != tenant for other in users) or any(
            other != tenant and where == top.kind for other, where in self._stored
        )

    def refuse(self, tenant: str, top: Tier, raise_if_not: bool) -> bool:
        """Count a refusal of one more page to `tenant` (at its share); False, or with
        `raise_if_not` QuotaExceededError saying what to do."""
        self.refusals += 1
        if raise_if_not:
            held = self._reserved[tenant] + self._pinned[tenant]
            raise QuotaExceededError(
                f"tenant {tenant!r} holds {held} of this node's {top.capacity_pages} "
                f"{top.kind} pages reserved or pinned, its share while other tenants use them "
                "(--tenant-share): commit saves or release loads first"
            )
        return False

    def pages(self) -> dict[str, dict[str, int]]:
        """Per tenant: "reserved", "pinned", and blocks stored per tier ("stored_host", ...)."""
        pages: dict[str, dict[str, int]] = {}
        for tenant, reserved in self._reserved.items():
            pages.setdefault(tenant, {})["reserved"] = reserved
        for tenant, pinned in self._pinned.items():
            pages.setdefault(tenant, {})["pinned"] = pinned
        for (tenant, kind), stored in self._stored.items():
            pages.setdefault(tenant, {})[f"stored_{kind}"] = stored
        return pages


def count_change(counter: Counter, name: object, change: int) -> None:
    """Add `change` to `counter[name]`, dropping names that reach zero (so a counter's keys
    are exactly who holds something)."""
    left = counter[name] + change
    if left > 0:
        counter[name] = left
    else:
        counter.pop(name, None)
