"""The metadata service's server-streaming RPCs: WatchEvents, WatchEventBatches and Snapshot.

Runs in the metadata service process, on the gRPC asyncio loop (WatchEvents' pages are read in
watch.py's readers, Snapshot's copies in a pool of its own). The servicer (service.py) holds
one StreamRpcs; each open stream holds a slot of its caller's scope (the events' "watch" slots).
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc

from kvstore import errors
from kvstore.metadata import wire
from kvstore.metadata.index.base import MetadataIndex
from kvstore.metadata.server.auth import TokenAuth
from kvstore.metadata.server.metrics import MetadataMetrics
from kvstore.metadata.server.watch import EventStreams
from kvstore.metadata.status import status_for
from kvstore.v1 import metadata_pb2 as pb

SNAPSHOT_THREADS = 2  # copies of the index at once; more Snapshot streams wait their turn


def _snapshot_pool() -> Executor:
    return ThreadPoolExecutor(SNAPSHOT_THREADS, thread_name_prefix="snapshot")


@dataclass
class StreamRpcs:
    """WatchEvents and Snapshot handlers (async generators of responses): each authorises its
    call, checks its request and takes a slot before its first response, and gives the slot
    back however the call ends. `stop` ends the snapshot copies."""

    auth: TokenAuth
    index: MetadataIndex
    events: EventStreams  # their slots are these calls' slots
    metrics: MetadataMetrics
    max_batch: int  # keys per Snapshot page, at most
    # copies of the index (O(keys), a whole SCAN on Redis) run apart from the unary pool,
    # so that however many Snapshot streams are open, heartbeats keep their threads
    snapshot_pool: Executor = field(default_factory=_snapshot_pool)

    def stop(self) -> None:
        self.snapshot_pool.shutdown(wait=False, cancel_futures=True)

    async def _open(self, request_cls, payload: bytes, context, every_tenant: str):
        """(scope, request) of a streaming call whose `tenant` ("" for every tenant, which
        needs an all-tenant token: `every_tenant` says what for) the caller may read."""
        scope = await self.auth.authorize(context)
        request = wire.parse(request_cls, payload)
        if request.tenant:
            scope.check_tenant(request.tenant)
        else:
            scope.require_all_tenants(every_tenant)
        return scope, request

    async def _admit(self, request_cls, payload: bytes, context, every_tenant: str, count):
        """(scope, request) once the call holds a slot; a refusal ends it (StreamSlots.admit)."""
        opened = functools.partial(self._open, request_cls, payload, context, every_tenant)
        return await self.events.slots.admit(context, opened, count)

    async def WatchEvents(self, payload: bytes, context: grpc.aio.ServicerContext):
        """Runs on the loop: the slot check is cheap, authorisation never blocks it (an agent
        token's review, where one is needed, is awaited). One event a message."""
        async for event in self._watch("WatchEvents", payload, context, self.events.stream):
            yield event

    async def WatchEventBatches(self, payload: bytes, context: grpc.aio.ServicerContext):
        """As WatchEvents, many events a message, each encoded once for every stream: yields
        encoded EventBatch messages (its handler has no serializer)."""
        batches = self.events.stream_batches
        async for batch in self._watch("WatchEventBatches", payload, context, batches):
            yield batch

    async def _watch(self, name: str, payload: bytes, context, stream):
        """What `stream` (an EventStreams method) yields, once the call holds a watch slot."""
        count = self.metrics.count_calls(name)
        scope, request = await self._admit(
            pb.WatchEventsRequest, payload, context, "watch every tenant's events", count
        )
        count(grpc.StatusCode.OK)
        try:
            async for item in stream(request):
                yield item
        finally:
            self.events.slots.release(scope.tenant)

    async def Snapshot(self, payload: bytes, context: grpc.aio.ServicerContext):
        """A copy of the index in pages, for node agents' views; copied and paged in the
        snapshot pool (a big tenant's copy must not stall the loop). Each open one holds a
        stream slot of the caller's scope, as WatchEvents does (each holds a whole copy)."""
        count = self.metrics.count_calls("Snapshot")
        scope, request = await self._admit(
            pb.SnapshotRequest, payload, context, "copy every tenant's index", count
        )
        try:
            loop = asyncio.get_running_loop()
            pool = self.snapshot_pool
            try:
                pages = await loop.run_in_executor(
                    pool, _snapshot_pages, self.index, request, self.max_batch
                )
            except errors.KVStoreError as exc:
                count(status_for(exc))
                await context.abort(status_for(exc), str(exc))
            count(grpc.StatusCode.OK)
            while (page := await loop.run_in_executor(pool, next, pages, None)) is not None:
                yield page
        finally:
            self.events.slots.release(scope.tenant)


def _snapshot_pages(index: MetadataIndex, request: pb.SnapshotRequest, max_batch: int):
    """The pages of a copy of the index, its incarnation read first: a copy of a newer
    incarnation than it says is one the agent's next Stats check resyncs (the Redis index's
    is a round trip)."""
    incarnation = index.incarnation
    copy = index.snapshot(request.tenant)
    page_keys = min(request.page_keys or 1024, max_batch)
    return wire.snapshot_pages(copy, request.max_keys, page_keys, incarnation)
