"""Slots of long-lived calls per caller scope, so no token holds unbounded streams open.

Runs in the metadata service process, on the gRPC loop thread only (no lock); every stream RPC
(WatchEvents, Snapshot, LookupStream) is admitted through `admit`. A scope is the
caller's token's tenant, or "*" for all-tenant tokens (node agents, operators; every caller when
authentication is off), which gets a limit of its own: every node agent holds its streams there.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Awaitable, Callable

import grpc

from kvstore.errors import CapacityError, KVStoreError
from kvstore.metadata.server.auth import ALL_TENANTS, TenantScope
from kvstore.metadata.status import REFUSED_A_SLOT, status_for

# the calls that hold each kind of slot, by kind: a kind's caps are the settings
# `max_<kind>_streams_per_tenant` and `max_<kind>_streams_all_tenants`
HELD_BY = {
    "watch": "WatchEvents, Snapshot",
    "lookup": "LookupStream calls and lookup-port connections",
}


class StreamSlots:
    def __init__(self, kind: str, max_per_tenant: int, max_all_tenants: int) -> None:
        """`kind`: "watch" or "lookup" (HELD_BY), named with its setting in a refusal."""
        self.calls = HELD_BY[kind]
        self.setting = f"max_{kind}_streams"
        self.max_per_tenant = max_per_tenant
        self.max_all_tenants = max_all_tenants
        self._open: Counter[str] = Counter()

    def acquire(self, scope_tenant: str) -> None:
        """Take a slot of the caller's scope; CapacityError at the cap."""
        every = scope_tenant == ALL_TENANTS
        limit = self.max_all_tenants if every else self.max_per_tenant
        if self._open[scope_tenant] >= limit:
            setting = f"{self.setting}_{'all_tenants' if every else 'per_tenant'}"
            raise CapacityError(
                f"{self._open[scope_tenant]} streams ({self.calls}) are open for tenant "
                f"{scope_tenant!r}: the limit is {limit} per tenant ({setting}); close one or "
                "reuse it"
            )
        self._open[scope_tenant] += 1

    async def admit(
        self,
        context: grpc.aio.ServicerContext,
        open_call: Callable[[], Awaitable[tuple[TenantScope, object]]],
        count: Callable[[grpc.StatusCode], None],
    ) -> tuple[TenantScope, object]:
        """(scope, request) from `open_call` (authorisation, the request's checks), and a slot
        of that scope; a failure is counted and ends the call with its status (a refused slot
        marked in the trailing metadata). The caller releases the slot when the call ends."""
        try:
            scope, request = await open_call()
            self.acquire(scope.tenant)
        except KVStoreError as exc:
            code = status_for(exc)
            count(code)
            refused = (REFUSED_A_SLOT,) if isinstance(exc, CapacityError) else ()
            await context.abort(code, str(exc), trailing_metadata=refused)
        return scope, request

    def release(self, scope_tenant: str) -> None:
        self._open[scope_tenant] -= 1
        if self._open[scope_tenant] <= 0:
            del self._open[scope_tenant]

    def open_count(self, scope_tenant: str) -> int:
        return self._open[scope_tenant]
