"""The gRPC servicer of the metadata service: checks, authorisation, metrics, error mapping.

Runs in the metadata service process, on the gRPC asyncio loop: writes (and every unary call to
an index whose reads block, Redis) run in the `pool` of unary threads, non-blocking reads inline,
streams on the loop itself, in the collaborators the servicer holds (WatchEvents and Snapshot:
StreamRpcs, streams.py; LookupStream: LookupStreams, lookup_stream.py), so streams never take
the threads heartbeats need. The lookups of LookupStream calls and the lookup port are awaited
on the loop from the index's LoopLookups where its reads block (Redis: redis_lookups.py), or
answered at once where those keep what they need (`answer_lookup_now`). Every
unary RPC is wrapped by `_unary`, which authenticates, times it, and maps kvstore errors to
status codes through STATUS_FOR (status.py), the one table of that mapping. Heartbeats run in
a pool of their own (`lease_pool`): however many publishes queue for the unary pool, no lease
waits behind them.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass

import grpc
from google.protobuf.message import Message

from kvstore import errors
from kvstore.metadata import wire
from kvstore.metadata.index.base import LoopLookups, MetadataIndex
from kvstore.metadata.server.auth import TenantScope, TokenAuth
from kvstore.metadata.server.lookup_access import LookupAccess
from kvstore.metadata.server.lookup_stream import LookupStreams
from kvstore.metadata.server.metrics import MetadataMetrics
from kvstore.metadata.server.slots import StreamSlots
from kvstore.metadata.server.streams import StreamRpcs
from kvstore.metadata.server.watch import EventStreams
from kvstore.metadata.status import status_for
from kvstore.v1 import metadata_pb2 as pb

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Metadata"].full_name


@dataclass(frozen=True)
class ServiceLimits:
    max_batch: int = 4096  # keys per Lookup/Route, entries per Publish/Unpublish, candidates
    default_lease_ttl_ms: int = 10_000
    min_lease_ttl_ms: int = 500
    max_lease_ttl_ms: int = 600_000
    event_batch: int = 1024
    watch_poll_s: float = 0.5
    lookup_stream_idle_s: float = 60.0  # a LookupStream with no request for this long is ended


def _unary(
    request_cls: type[Message], read: bool = False, lease: bool = False
) -> Callable[[Callable], Callable]:
    """`read`: the method only reads the index; it runs inline on the loop when the index says
    its reads never block (in memory: no I/O, a short lock), else in the unary pool. `lease`:
    it keeps a lease alive, in the lease pool."""
    return functools.partial(_wrap_unary, request_cls, read, lease)


def _wrap_unary(request_cls: type[Message], read: bool, lease: bool, method: Callable) -> Callable:
    name = method.__name__

    @functools.wraps(method)
    async def handler(self: MetadataServicer, payload: bytes, context: grpc.aio.ServicerContext):
        started = time.perf_counter()
        code = grpc.StatusCode.OK
        try:
            scope = await self.auth.authorize(context)
            request = wire.parse(request_cls, payload)
            if read and self.index.nonblocking_reads:
                return method(self, request, scope)
            loop = asyncio.get_running_loop()
            pool = self.lease_pool if lease else self.pool
            return await loop.run_in_executor(pool, method, self, request, scope)
        except errors.KVStoreError as exc:
            code = status_for(exc)
            await context.abort(code, str(exc))
        except Exception:
            code = grpc.StatusCode.INTERNAL
            logger.exception("%s failed", name)
            await context.abort(code, f"internal error in {name}; see the service log")
        finally:
            rpcs, latency = self._children(name, code)
            rpcs.inc()
            latency.observe(time.perf_counter() - started)

    return handler


class MetadataServicer:
    """The unary RPCs, and the answer to one lookup of a stream or the lookup port; holds the
    streaming RPCs' handlers (`stream_rpcs`, `lookup_streams`) and starts and stops them."""

    def __init__(
        self,
        index: MetadataIndex,
        auth: TokenAuth,
        metrics: MetadataMetrics,
        events: EventStreams,
        pool: Executor,
        limits: ServiceLimits,
        lookup_slots: StreamSlots,
        lease_pool: Executor,
    ) -> None:
        self.index = index
        self.auth = auth
        self.metrics = metrics
        self.pool = pool
        self.lease_pool = lease_pool  # heartbeats only: never behind the writes in `pool`
        self.limits = limits
        self._metric_children: dict[tuple[str, grpc.StatusCode], tuple] = {}
        self.lookup_port = 0  # where the server's lookup port listens (lookup_port.py); 0: none
        self.lookup_instance = b""  # the id its hellos must carry
        self.loop_lookups: LoopLookups | None = None  # the index's, on the loop (server.py)
        self.stream_rpcs = StreamRpcs(auth, index, events, metrics, limits.max_batch)
        # LookupStream calls share it with the lookup port's connections (server.py)
        self.lookup_access = LookupAccess(
            auth,
            lookup_slots,
            self.answer_lookup,
            limits.lookup_stream_idle_s,
            None if index.nonblocking_reads else self.answer_lookup_later,
            None if index.nonblocking_reads else self.answer_lookup_now,
        )
        self.lookup_streams = LookupStreams(self.lookup_access, metrics.count_calls("LookupStream"))

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Starts the streams' housekeeping on the server's loop (LookupStream's idle sweep)."""
        self.lookup_streams.start(loop)

    def stop(self) -> None:
        self.lookup_streams.stop()
        self.stream_rpcs.stop()

    def _children(self, name: str, code: grpc.StatusCode) -> tuple:
        """The (rpcs, latency) series of one method and status: `labels` costs microseconds
        per call, a dictionary hit far less (every lookup pays it)."""
        children = self._metric_children.get((name, code))
        if children is None:
            children = self.metrics.rpcs.labels(name, code.name), self.metrics.latency.labels(name)
            self._metric_children[(name, code)] = children
        return children

    # ---- membership -----------------------------------------------------------------------
    @_unary(pb.RegisterNodeRequest)
    def RegisterNode(self, request: pb.RegisterNodeRequest, scope: TenantScope):
        scope.require_all_tenants("register a node")
        if not request.HasField("node"):
            raise errors.ConfigError("node is required")
        ttl_ms = self._lease_ttl(request.lease_ttl_ms)
        node = wire.node_from_proto(request.node)
        scope.require_node(node.node_id, "register")
        record = self.index.register_node(node, ttl_ms)
        logger.info(
            "node %s registered (lease %d, ttl %d ms)", record.node_id, record.lease_id, ttl_ms
        )
        return pb.RegisterNodeResponse(lease_id=record.lease_id, lease_ttl_ms=ttl_ms)

    def _lease_ttl(self, requested_ms: int) -> int:
        if requested_ms == 0:
            return self.limits.default_lease_ttl_ms
        low, high = self.limits.min_lease_ttl_ms, self.limits.max_lease_ttl_ms
        if not low <= requested_ms <= high:
            raise errors.ConfigError(f"lease_ttl_ms {requested_ms} outside [{low}, {high}]")
        return requested_ms

    @_unary(pb.HeartbeatRequest, lease=True)
    def Heartbeat(self, request: pb.HeartbeatRequest, scope: TenantScope):
        scope.require_all_tenants("heartbeat")
        record = self.index.heartbeat(
            self._node_id(request.node_id, scope, "heartbeat"), request.lease_id
        )
        return pb.HeartbeatResponse(lease_ttl_ms=record.lease_ttl_ms)

    @_unary(pb.DeregisterNodeRequest)
    def DeregisterNode(self, request: pb.DeregisterNodeRequest, scope: TenantScope):
        scope.require_all_tenants("deregister a node")
        node_id = self._node_id(request.node_id, scope, "deregister")
        removed = self.index.deregister_node(node_id, request.lease_id)
        self.metrics.events.labels("removed").inc(removed)
        return pb.DeregisterNodeResponse(removed_blocks=removed)

    # ---- holdings -------------------------------------------------------------------------
    @_unary(pb.PublishRequest)
    def Publish(self, request: pb.PublishRequest, scope: TenantScope):
        accepted = self._change_holdings(request, scope, "publish", self.index.publish)
        self.metrics.events.labels("stored").inc(accepted)
        return pb.PublishResponse(accepted=accepted)

    @_unary(pb.UnpublishRequest)
    def Unpublish(self, request: pb.UnpublishRequest, scope: TenantScope):
        removed = self._change_holdings(request, scope, "unpublish", self.index.unpublish)
        self.metrics.events.labels("removed").inc(removed)
        self.metrics.evictions.inc(removed)
        return pb.UnpublishResponse(removed=removed)

    def _change_holdings(
        self,
        request: pb.PublishRequest | pb.UnpublishRequest,
        scope: TenantScope,
        action: str,
        change: Callable[..., int],
    ) -> int:
        """`change` (the index's publish or unpublish) of a checked Publish or Unpublish
        request's entries; returns how many blocks it changed."""
        scope.require_all_tenants(f"{action} blocks: node agents do, with a node token")
        tenant = scope.check_tenant(request.tenant)
        entries = wire.entries_from_proto(request.entries, self.limits.max_batch)
        node_id = self._node_id(request.node_id, scope, action)
        return change(node_id, request.lease_id, tenant, entries)

    @staticmethod
    def _node_id(node_id: str, scope: TenantScope, action: str) -> str:
        wire.check_name(node_id, "node_id")
        scope.require_node(node_id, action)
        return node_id

    # ---- queries --------------------------------------------------------------------------
    @_unary(pb.LookupRequest, read=True)
    def Lookup(self, request: pb.LookupRequest, scope: TenantScope):
        return self._lookup(request, scope)

    def answer_lookup(self, payload: bytes, scope: TenantScope) -> pb.LookupStreamResponse:
        """One request of a LookupStream (lookup_stream.py) or the lookup port, a failure
        inside the answer; timed and counted as a `Lookup` (the call itself counts as
        `LookupStream`), so the lookup series cover both ways of asking."""
        started = time.perf_counter()
        try:
            request = wire.parse(pb.LookupRequest, payload)
            return self._answered(self._lookup(request, scope), started)
        except Exception as exc:
            return self._refused(exc, started)

    def answer_lookup_now(
        self, payload: bytes, scope: TenantScope
    ) -> pb.LookupStreamResponse | None:
        """`answer_lookup_later`'s answer where it needs no I/O: a refused request, or a
        lookup its LoopLookups answer from what they keep (`lookup_now`); None: await it."""
        if self.loop_lookups is None or not self.loop_lookups.keeps:
            return None
        started = time.perf_counter()
        try:
            request = wire.parse(pb.LookupRequest, payload)
            tenant, keys, anchor = self._lookup_args(request, scope)
            found = self.loop_lookups.lookup_now(tenant, keys, anchor)
            if found is None:
                return None
            return self._answered(self._lookup_response(request, keys, *found), started)
        except Exception as exc:
            return self._refused(exc, started)

    async def answer_lookup_later(
        self, payload: bytes, scope: TenantScope
    ) -> pb.LookupStreamResponse:
        """`answer_lookup` where the index's reads block: on the loop from its LoopLookups,
        the same checks and answer; off it, in the unary pool, where it has none or they
        cannot answer now (a Redis failover: the index follows it, and they find it after)."""
        started = time.perf_counter()
        try:
            request = wire.parse(pb.LookupRequest, payload)
            tenant, keys, anchor = self._lookup_args(request, scope)
            found = None
            if self.loop_lookups is not None:
                found = await self.loop_lookups.lookup(tenant, keys, anchor)
            if found is not None:
                return self._answered(self._lookup_response(request, keys, *found), started)
        except Exception as exc:
            return self._refused(exc, started)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, self._answer_off_loop, payload, scope)

    def _answer_off_loop(self, payload: bytes, scope: TenantScope) -> pb.LookupStreamResponse:
        answer = self.answer_lookup(payload, scope)
        if self.loop_lookups is not None:
            self.loop_lookups.refresh()
        return answer

    def _answered(self, response: pb.LookupResponse, started: float) -> pb.LookupStreamResponse:
        self._count("Lookup", grpc.StatusCode.OK, started)
        return pb.LookupStreamResponse(response=response)

    def _refused(self, exc: Exception, started: float) -> pb.LookupStreamResponse:
        """A lookup's failure as its answer's status (INTERNAL, logged, where unexpected)."""
        if isinstance(exc, errors.KVStoreError):
            code, message = status_for(exc), str(exc)
        else:
            code = grpc.StatusCode.INTERNAL
            logger.error("a LookupStream request failed", exc_info=exc)
            message = "internal error in LookupStream; see the service log"
        self._count("Lookup", code, started)
        return pb.LookupStreamResponse(status_code=code.value[0], status_message=message)

    def _count(self, name: str, code: grpc.StatusCode, started: float) -> None:
        rpcs, latency = self._children(name, code)
        rpcs.inc()
        latency.observe(time.perf_counter() - started)

    def _lookup(self, request: pb.LookupRequest, scope: TenantScope) -> pb.LookupResponse:
        tenant, keys, anchor = self._lookup_args(request, scope)
        found = self.index.lookup(tenant, keys, anchor)
        nodes = self.index.live_addresses() if found else {}
        return self._lookup_response(request, keys, found, nodes)

    def _lookup_args(
        self, request: pb.LookupRequest, scope: TenantScope
    ) -> tuple[str, list[bytes], bytes | None]:
        """The request's tenant (the scope's to ask for), keys and anchor, checked."""
        tenant = scope.check_tenant(request.tenant)
        keys = wire.check_keys(request.keys, self.limits.max_batch)
        anchor = (
            wire.check_keys([request.anchor], 1, "anchor")[0]
            if request.HasField("anchor")
            else None
        )
        return tenant, keys, anchor

    def _lookup_response(
        self, request: pb.LookupRequest, keys: list[bytes], found: list, nodes: dict
    ) -> pb.LookupResponse:
        response = wire.lookup_response(found, nodes, request.caller_node_id)
        self.metrics.observe_lookup(len(keys), len(found), request.chunk_tokens)
        return response

    @_unary(pb.RouteRequest, read=True)
    def Route(self, request: pb.RouteRequest, scope: TenantScope):
        tenant = scope.check_tenant(request.tenant)
        keys = wire.check_keys(request.keys, self.limits.max_batch)
        candidates = self._route_candidates(list(request.candidate_node_ids))
        found = self.index.lookup(tenant, keys)
        depth = dict.fromkeys(candidates, 0)
        for position, holders in enumerate(found):
            for holding in holders:
                if holding.node_id in depth and depth[holding.node_id] == position:
                    depth[holding.node_id] = position + 1
        best = max(candidates, key=lambda n: depth[n], default="")  # first of equals wins
        if not best or depth[best] == 0:
            return pb.RouteResponse(node_id="", prefix_length=0)
        return pb.RouteResponse(node_id=best, prefix_length=depth[best])

    def _route_candidates(self, requested: list[str]) -> list[str]:
        live = self.index.live_nodes()
        if not requested:
            return sorted(live)
        if len(requested) > self.limits.max_batch:
            raise errors.ConfigError(
                f"candidate_node_ids has {len(requested)} entries; the limit is "
                f"{self.limits.max_batch} per call"
            )
        unknown = [n for n in requested if n not in live]
        if unknown:
            raise errors.NotFoundError(f"unknown or expired candidate nodes: {unknown[:5]}")
        return requested

    @_unary(pb.DescribeRequest, read=True)
    def Describe(self, request: pb.DescribeRequest, scope: TenantScope):
        return pb.DescribeResponse(lookup_port=self.lookup_port, instance=self.lookup_instance)

    @_unary(pb.StatsRequest)  # in the pool: the index's stats take its writer lock
    def Stats(self, request: pb.StatsRequest, scope: TenantScope):
        scope.require_all_tenants("read cluster stats")
        stats = self.index.stats()
        now = time.time()
        response = pb.StatsResponse(
            blocks=stats["blocks"],
            blocks_per_tier=stats["blocks_per_tier"],
            last_event_seq=stats["last_event_seq"],
            backend=self.index.backend,
            incarnation=self.index.incarnation,
        )
        for node_id, record in sorted(self.index.live_nodes().items()):
            per_tier = stats["blocks_per_node"].get(node_id, {})
            response.nodes.add(
                node=wire.node_to_proto(record),
                blocks=sum(per_tier.values()),
                blocks_per_tier=per_tier,
                lease_expires_in_ms=max(0, int((record.expires_at - now) * 1000)),
            )
        return response


_UNARY_METHODS = (
    "RegisterNode",
    "Heartbeat",
    "DeregisterNode",
    "Publish",
    "Unpublish",
    "Lookup",
    "Route",
    "Stats",
    "Describe",
)


def rpc_handlers(servicer: MetadataServicer) -> grpc.GenericRpcHandler:
    """The service's handlers, taking raw request bytes (decoded by `_parse`)."""

    def serialize(message: Message) -> bytes:
        return message.SerializeToString()

    methods = {
        name: grpc.unary_unary_rpc_method_handler(
            getattr(servicer, name), response_serializer=serialize
        )
        for name in _UNARY_METHODS
    }
    for name in ("WatchEvents", "Snapshot"):
        methods[name] = grpc.unary_stream_rpc_method_handler(
            getattr(servicer.stream_rpcs, name), response_serializer=serialize
        )
    # already encoded (event_frames.py): gRPC sends the bytes as they are
    methods["WatchEventBatches"] = grpc.unary_stream_rpc_method_handler(
        servicer.stream_rpcs.WatchEventBatches
    )
    methods["LookupStream"] = grpc.stream_stream_rpc_method_handler(
        servicer.lookup_streams.serve, response_serializer=serialize
    )
    return grpc.method_handlers_generic_handler(SERVICE_NAME, methods)
