"""The metadata service's server-streaming RPCs: WatchEvents and Snapshot.

Runs in the metadata service process, on the gRPC asyncio loop (WatchEvents' pages are read in
watch.py's readers, Snapshot's copies in the servicer's snapshot pool). A mixin of
MetadataServicer (service.py), whose state it uses: auth, streams, metrics, index, limits,
snapshot_pool. Each open stream holds a slot of its caller's scope.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable

import grpc

from kvstore import errors
from kvstore.metadata import wire
from kvstore.metadata.index.base import MetadataIndex
from kvstore.metadata.status import status_for
from kvstore.v1 import metadata_pb2 as pb


class StreamingRpcs:
    def count_stream(self, method: str) -> Callable[[grpc.StatusCode], None]:
        """Counts a stream call of `method` by the status it opened (or failed) with."""
        return lambda code: self.metrics.rpcs.labels(method, code.name).inc()

    async def _stream_request(self, request_cls, payload: bytes, context, every_tenant: str):
        """(scope, request) of a streaming call whose `tenant` ("" for every tenant, which
        needs an all-tenant token: `every_tenant` says what for) the caller may read."""
        scope = await self.auth.authorize(context)
        request = wire.parse(request_cls, payload)
        if request.tenant:
            self._tenant(request.tenant, scope)
        else:
            scope.require_all_tenants(every_tenant)
        return scope, request

    async def WatchEvents(self, payload: bytes, context: grpc.aio.ServicerContext):
        """Runs on the loop: the slot check is cheap, authorisation never blocks it (an agent
        token's review, where one is needed, is awaited)."""
        scope, request = await self.streams.slots.admit(
            context,
            functools.partial(
                self._stream_request,
                pb.WatchEventsRequest,
                payload,
                context,
                "watch every tenant's events",
            ),
            self.count_stream("WatchEvents"),
        )
        self.count_stream("WatchEvents")(grpc.StatusCode.OK)
        try:
            async for event in self.streams.stream(request):
                yield event
        finally:
            self.streams.slots.release(scope.tenant)

    async def Snapshot(self, payload: bytes, context: grpc.aio.ServicerContext):
        """A copy of the index in pages, for node agents' views; copied and paged in the
        unary pool (a big tenant's copy must not stall the loop). Each open one holds a
        stream slot of the caller's scope, as WatchEvents does (each holds a whole copy)."""
        scope, request = await self.streams.slots.admit(
            context,
            functools.partial(
                self._stream_request,
                pb.SnapshotRequest,
                payload,
                context,
                "copy every tenant's index",
            ),
            self.count_stream("Snapshot"),
        )
        try:
            loop = asyncio.get_running_loop()
            pool = self.snapshot_pool
            try:
                pages = await loop.run_in_executor(
                    pool, _snapshot_pages, self.index, request, self.limits.max_batch
                )
            except errors.KVStoreError as exc:
                self.count_stream("Snapshot")(status_for(exc))
                await context.abort(status_for(exc), str(exc))
            self.count_stream("Snapshot")(grpc.StatusCode.OK)
            while (page := await loop.run_in_executor(pool, next, pages, None)) is not None:
                yield page
        finally:
            self.streams.slots.release(scope.tenant)


def _snapshot_pages(index: MetadataIndex, request: pb.SnapshotRequest, max_batch: int):
    """The pages of a copy of the index, its incarnation read first: a copy of a newer
    incarnation than it says is one the agent's next Stats check resyncs (the Redis index's
    is a round trip)."""
    incarnation = index.incarnation
    copy = index.snapshot(request.tenant)
    page_keys = min(request.page_keys or 1024, max_batch)
    return wire.snapshot_pages(copy, request.max_keys, page_keys, incarnation)
