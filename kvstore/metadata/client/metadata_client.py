"""A typed client of the metadata service, used by node agents, routers and the CLI.

Runs in the caller's process; thread-safe (one gRPC channel). gRPC status codes come back as
the kvstore exceptions they were mapped from, so callers handle one error tree.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from kvstore import errors
from kvstore.metadata import wire
from kvstore.metadata.client.lookup_calls import LookupCalls
from kvstore.metadata.client.lookup_sockets import LookupSockets
from kvstore.metadata.client.token_file import TokenFile
from kvstore.metadata.records import BlockEntry, Holding, NodeRecord
from kvstore.metadata.status import error_for
from kvstore.v1 import metadata_pb2 as pb
from kvstore.v1 import metadata_pb2_grpc as pb_grpc


def error_from_rpc(exc: grpc.RpcError) -> errors.KVStoreError:
    return error_for(exc.code(), exc.details())


@dataclass(frozen=True)
class LookupResult:
    prefix_length: int
    holders: list[list[Holding]]  # per key of the prefix, ranked for the caller
    addresses: dict[str, tuple[str, str]]  # node id -> (tcp address, ucx address)


@dataclass(frozen=True)
class SnapshotPage:
    last_seq: int
    tenant: str
    keys: list[bytes]
    holders: LookupResult  # holders[i] hold keys[i]
    truncated: bool  # the service's copy was cut at max_keys
    incarnation: int  # of the index it was copied from (see StatsResponse)


class EventStream:
    """An open WatchEventBatches call: iterate its events; `cancel` (any thread) ends the
    iteration. A service that predates that call is read through WatchEvents instead."""

    def __init__(self, open_batches: Callable, open_events: Callable) -> None:
        self._open_events = open_events
        self._call = open_batches()
        self._batched = True

    def __iter__(self) -> Iterator[pb.Event]:
        try:
            if self._batched:
                yield from self._batch_events()
            if not self._batched:
                yield from self._call
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                raise error_from_rpc(exc) from None

    def _batch_events(self) -> Iterator[pb.Event]:
        try:
            for batch in self._call:
                yield from batch.events
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
            self._batched = False
            self._call = self._open_events()

    def cancel(self) -> None:
        self._call.cancel()


def lookup_result(response: pb.LookupResponse) -> LookupResult:
    """Unflatten a LookupResponse's parallel arrays: one Holding per distinct (node, tier),
    most repeat; each pass in C where every key has one holder, the common case."""
    nodes = response.nodes
    addresses = {n.node_id: (n.tcp_address, n.ucx_address) for n in nodes}
    counts = list(response.holder_counts)  # each container read once, in C
    holder_nodes, holder_tiers = list(response.holder_nodes), list(response.holder_tiers)
    if not len(holder_nodes) == len(holder_tiers) == sum(counts):
        raise errors.KVStoreError("malformed LookupResponse: its holder arrays disagree")
    if len(set(holder_nodes)) == 1 == len(set(holder_tiers)):  # one node and tier hold it all
        node, tier = holder_nodes[0], holder_tiers[0]
        flat = [Holding(nodes[node].node_id, wire.PROTO_TO_TIER[tier])] * len(holder_nodes)
    else:
        pairs = list(zip(holder_nodes, holder_tiers, strict=False))  # lengths checked above
        made = {
            pair: Holding(nodes[pair[0]].node_id, wire.PROTO_TO_TIER[pair[1]])
            for pair in set(pairs)
        }
        flat = list(map(made.__getitem__, pairs))
    if counts.count(1) == len(counts) == len(flat):  # one holder a key
        holders = [[holding] for holding in flat]
    else:
        holders, start = [], 0
        for count in counts:
            holders.append(flat[start : start + count])
            start += count
    return LookupResult(response.prefix_length, holders, addresses)


def call_metadata(token: str | TokenFile | None) -> Callable[[], tuple]:
    """The metadata of each call: a fixed token's, or a token file's current token's."""
    if isinstance(token, TokenFile):
        return lambda: (("authorization", f"Bearer {token.current()}"),)
    fixed = (("authorization", f"Bearer {token}"),) if token else ()
    return lambda: fixed


def _entries_request(
    message: type[pb.PublishRequest | pb.UnpublishRequest],
    node_id: str,
    lease_id: int,
    tenant: str,
    entries: Sequence[BlockEntry],
) -> pb.PublishRequest | pb.UnpublishRequest:
    """A PublishRequest or an UnpublishRequest: the two carry the same fields."""
    proto_entries = wire.entries_to_proto(entries)
    return message(node_id=node_id, lease_id=lease_id, tenant=tenant, entries=proto_entries)


class MetadataClient:
    def __init__(
        self,
        address: str,
        token: str | TokenFile | None = None,
        tls_ca: Path | None = None,
        timeout_s: float = 5.0,
        max_message_bytes: int = 16 << 20,
        lookup_streams: bool = True,
        lookup_port: bool = True,
    ) -> None:
        """`token`: fixed, or a TokenFile (read again as it is replaced: new calls present the
        new token); `lookup_port`: look up on the service's lookup port where it has one;
        `lookup_streams`: else on open LookupStream calls (False for both: unary Lookups)."""
        options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            # A restarted service is found again within a second or two, not gRPC's 2 minutes.
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 2000),
            # Own subchannels: another channel's backoff to the same address must not fail ours.
            ("grpc.use_local_subchannel_pool", 1),
        ]
        if tls_ca:
            creds = grpc.ssl_channel_credentials(root_certificates=tls_ca.read_bytes())
            self._channel = grpc.secure_channel(address, creds, options=options)
        else:
            self._channel = grpc.insecure_channel(address, options=options)
        self._stub = pb_grpc.MetadataStub(self._channel)
        self._metadata = call_metadata(token)
        self._lookup_calls = LookupCalls(self._stub, self._metadata, enabled=lookup_streams)
        self._lookup_sockets = LookupSockets(
            self._stub, self._metadata, address, tls_ca, max_message_bytes, lookup_port
        )
        self.timeout_s = timeout_s

    def wait_ready(self, timeout_s: float) -> None:
        """Block until the channel is connected; UnavailableError after `timeout_s`."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            raise errors.UnavailableError(f"no connection within {timeout_s} s") from None

    def _call(self, method: str, request, timeout_s: float | None = None):
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        try:
            return getattr(self._stub, method)(
                request, timeout=timeout_s, metadata=self._metadata()
            )
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None

    def register_node(self, node: NodeRecord, lease_ttl_ms: int = 0) -> tuple[int, int]:
        """Returns (lease id, lease ttl in ms)."""
        request = pb.RegisterNodeRequest(node=wire.node_to_proto(node), lease_ttl_ms=lease_ttl_ms)
        response = self._call("RegisterNode", request)
        return response.lease_id, response.lease_ttl_ms

    def heartbeat(self, node_id: str, lease_id: int, timeout_s: float | None = None) -> int:
        request = pb.HeartbeatRequest(node_id=node_id, lease_id=lease_id)
        return self._call("Heartbeat", request, timeout_s)

    def deregister_node(self, node_id: str, lease_id: int) -> int:
        request = pb.DeregisterNodeRequest(node_id=node_id, lease_id=lease_id)
        return self._call("DeregisterNode", request).removed_blocks

    def publish(
        self, node_id: str, lease_id: int, tenant: str, entries: Sequence[BlockEntry]
    ) -> int:
        request = _entries_request(pb.PublishRequest, node_id, lease_id, tenant, entries)
        return self._call("Publish", request).accepted

    def unpublish(
        self, node_id: str, lease_id: int, tenant: str, entries: Sequence[BlockEntry]
    ) -> int:
        request = _entries_request(pb.UnpublishRequest, node_id, lease_id, tenant, entries)
        return self._call("Unpublish", request).removed

    def lookup(
        self,
        tenant: str,
        keys: Sequence[bytes],
        caller_node_id: str = "",
        chunk_tokens: int = 0,
        timeout_s: float | None = None,
        anchor: bytes | None = None,
    ) -> LookupResult:
        """On the lookup port; else on an open LookupStream call; else a unary Lookup (see
        lookup_sockets and lookup_calls: each says when it passes the lookup on). `anchor`:
        the chain's depth-1 key where `keys` do not start at the prompt's first key."""
        request = pb.LookupRequest(
            tenant=tenant,
            keys=keys,
            caller_node_id=caller_node_id,
            chunk_tokens=chunk_tokens,
            anchor=anchor,
        )
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        response = self._lookup_sockets.lookup(request, deadline)
        if response is None:
            response = self._lookup_calls.lookup(request, deadline)
        if response is None:
            response = self._call("Lookup", request, max(0.0, deadline - time.monotonic()))
        return lookup_result(response)

    def route(
        self, tenant: str, keys: Sequence[bytes], candidates: Sequence[str] = ()
    ) -> tuple[str, int]:
        """(best node id or "", its prefix length)."""
        request = pb.RouteRequest(tenant=tenant, keys=keys, candidate_node_ids=candidates)
        response = self._call("Route", request)
        return response.node_id, response.prefix_length

    def stats(self) -> pb.StatsResponse:
        return self._call("Stats", pb.StatsRequest())

    def watch_events(self, from_seq: int = 0, tenant: str = "") -> Iterator[pb.Event]:
        """Stream events from `from_seq` (0: only new). A KIND_GAP event means events up to its
        seq were lost: resync, then keep reading. Cancel by closing the iterator."""
        stream = self.open_events(from_seq, tenant)
        try:
            yield from stream
        finally:
            stream.cancel()

    def open_events(self, from_seq: int = 0, tenant: str = "") -> EventStream:
        """As watch_events, as an object another thread can `cancel`."""
        request = pb.WatchEventsRequest(from_seq=from_seq, tenant=tenant)
        return EventStream(
            lambda: self._stub.WatchEventBatches(request, metadata=self._metadata()),
            lambda: self._stub.WatchEvents(request, metadata=self._metadata()),
        )

    def snapshot(self, tenant: str = "", max_keys: int = 0) -> Iterator[SnapshotPage]:
        """The index's keys of `tenant` ("" every tenant) with their live holders, in pages;
        apply the events after `last_seq` to it to follow the index (see node/view.py)."""
        request = pb.SnapshotRequest(tenant=tenant, max_keys=max_keys)
        stream = self._stub.Snapshot(request, metadata=self._metadata())
        try:
            for page in stream:
                yield SnapshotPage(
                    page.last_seq,
                    page.tenant,
                    list(page.keys),
                    lookup_result(page.holders),
                    page.truncated,
                    page.incarnation,
                )
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None
        finally:
            stream.cancel()

    def close(self) -> None:
        self._lookup_sockets.close()
        self._lookup_calls.close()
        self._channel.close()

    def __enter__(self) -> MetadataClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
