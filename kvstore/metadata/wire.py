"""Validation and conversion between protocol messages and the index's records; the lookup
port's framing.

Runs in the metadata service (requests in, responses out) and in its clients. Every check
raises ConfigError with a message saying which field is wrong and why: INVALID_ARGUMENT.
"""

from __future__ import annotations

import operator
import re
import struct
from collections.abc import Iterator, Sequence

from google.protobuf.message import DecodeError, Message

from kvstore.errors import ConfigError
from kvstore.keys import KEY_BYTES
from kvstore.metadata.records import TIERS, BlockEntry, Holding, NodeRecord
from kvstore.tier import STORED
from kvstore.v1 import metadata_pb2 as pb

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@/-]{0,127}$")
MAX_ADDRESS_CHARS = 256  # stored per node and returned in every lookup that names it
TIER_TO_PROTO = {stored.name: stored.proto for stored in STORED}
PROTO_TO_TIER = {stored.proto: stored.name for stored in STORED}
_NODE_ID, _TIER = operator.attrgetter("node_id"), operator.attrgetter("tier")

# The lookup port's framing (server/lookup_connection.py answers it, client/lookup_sockets.py
# asks through it): a 4-byte little-endian length, then the message.
LOOKUP_FRAMING_VERSION = 1  # LookupHello.version: of the framing and the messages framed
LENGTH = struct.Struct("<I")


def frame(message: Message) -> bytes:
    payload = message.SerializeToString()
    return LENGTH.pack(len(payload)) + payload


def status_frame(code: int, message: str = "") -> bytes:
    """A LookupStreamResponse carrying only a status (`code`: a grpc.StatusCode's number)."""
    return frame(pb.LookupStreamResponse(status_code=code, status_message=message))


def parse(request_cls: type[Message], payload: bytes) -> Message:
    """Decode here, not in gRPC, so a malformed message is INVALID_ARGUMENT, not INTERNAL."""
    try:
        return request_cls.FromString(payload)
    except DecodeError as exc:
        raise ConfigError(f"malformed {request_cls.__name__}: {exc}") from None


def check_name(value: str, field: str) -> str:
    """Node ids and tenants: 1-128 characters of letters, digits and ._:@/- ."""
    if not _NAME.match(value):
        raise ConfigError(f"{field} {value!r} is invalid: use 1-128 letters, digits or ._:@/-")
    return value


def check_keys(keys: Sequence[bytes], max_keys: int, field: str = "keys") -> list[bytes]:
    if not keys:
        raise ConfigError(f"{field} is empty: send at least one key")
    if len(keys) > max_keys:
        raise ConfigError(f"{field} has {len(keys)} entries; the limit is {max_keys} per call")
    keys = list(keys)  # one pass over a protobuf container; the check below runs on the list
    if set(map(len, keys)) != {KEY_BYTES}:  # in C: this runs on every lookup
        index, key = next((i, k) for i, k in enumerate(keys) if len(k) != KEY_BYTES)
        raise ConfigError(f"{field}[{index}] is {len(key)} bytes; keys are {KEY_BYTES} bytes")
    return keys


def tier_name(value: int, field: str = "tier") -> str:
    try:
        return PROTO_TO_TIER[value]
    except KeyError:
        raise ConfigError(f"{field} {value} is not one of DEVICE, HOST, DISK") from None


def entries_from_proto(entries: Sequence[pb.BlockEntry], max_entries: int) -> list[BlockEntry]:
    check_keys([e.key for e in entries], max_entries, "entries")
    anchors = [e.anchor for e in entries if e.anchor]
    if anchors:
        check_keys(anchors, max_entries, "entries' anchors")
    return [
        BlockEntry(
            e.key,
            tier_name(e.tier, f"entries[{i}].tier"),
            e.size_bytes,
            e.checksum,
            e.anchor if e.HasField("anchor") else None,
        )
        for i, e in enumerate(entries)
    ]


def entries_to_proto(entries: Sequence[BlockEntry]) -> list[pb.BlockEntry]:
    return [
        pb.BlockEntry(
            key=e.key,
            tier=TIER_TO_PROTO[e.tier],
            size_bytes=e.size_bytes,
            checksum=e.checksum,
            anchor=e.anchor,
        )
        for e in entries
    ]


def node_from_proto(node: pb.NodeInfo) -> NodeRecord:
    check_name(node.node_id, "node.node_id")
    for field in ("tcp_address", "ucx_address"):
        if len(getattr(node, field)) > MAX_ADDRESS_CHARS:
            raise ConfigError(
                f"node.{field} has {len(getattr(node, field))} characters; "
                f"the limit is {MAX_ADDRESS_CHARS}"
            )
    for tier in node.tier_capacity_bytes:
        if tier not in TIERS:
            raise ConfigError(f"node.tier_capacity_bytes has unknown tier {tier!r}; use {TIERS}")
    return NodeRecord(
        node_id=node.node_id,
        tcp_address=node.tcp_address,
        ucx_address=node.ucx_address,
        tier_capacity_bytes=dict(node.tier_capacity_bytes),
    )


def node_to_proto(node: NodeRecord) -> pb.NodeInfo:
    return pb.NodeInfo(
        node_id=node.node_id,
        tcp_address=node.tcp_address,
        ucx_address=node.ucx_address,
        tier_capacity_bytes=node.tier_capacity_bytes,
    )


def lookup_response(
    found: list[Sequence[Holding]], nodes: dict[str, NodeRecord], caller_node_id: str
) -> pb.LookupResponse:
    """Flatten the holders of each key into the response's parallel arrays (the hot path: a
    pass per array, each in C where the key has one holder, the common case; one repeated
    value where one node and tier hold the whole prefix, the most common)."""
    counts = list(map(len, found))
    if not found or max(counts) == 1:
        flat = [holders[0] for holders in found]
    else:
        flat = []
        for holders in found:
            flat.extend(rank_holders(holders, caller_node_id) if len(holders) > 1 else holders)
    node_ids = list(map(_NODE_ID, flat))
    distinct = list(dict.fromkeys(node_ids))
    addresses = [_address(node_id, nodes.get(node_id)) for node_id in distinct]
    tiers = list(map(_TIER, flat))
    if len(distinct) == 1 and tiers.count(tiers[0]) == len(tiers):
        holder_nodes, holder_tiers = [0] * len(flat), [TIER_TO_PROTO[tiers[0]]] * len(flat)
    else:
        node_index = {node_id: i for i, node_id in enumerate(distinct)}
        holder_nodes = list(map(node_index.__getitem__, node_ids))
        holder_tiers = list(map(TIER_TO_PROTO.__getitem__, tiers))
    return pb.LookupResponse(
        prefix_length=len(found),
        nodes=addresses,
        holder_counts=counts,
        holder_nodes=holder_nodes,
        holder_tiers=holder_tiers,
    )


def _address(node_id: str, node: NodeRecord | None) -> pb.NodeAddress:
    return pb.NodeAddress(
        node_id=node_id,
        tcp_address=node.tcp_address if node else "",
        ucx_address=node.ucx_address if node else "",
    )


def rank_holders(holders: Sequence[Holding], caller_node_id: str) -> list[Holding]:
    """The caller's own node first, then faster tiers first, then by node id (deterministic)."""
    return sorted(
        holders, key=lambda h: (h.node_id != caller_node_id, TIERS.index(h.tier), h.node_id)
    )


def snapshot_pages(
    copy: tuple[int, dict[str, NodeRecord], list],
    max_keys: int,
    page_keys: int,
    incarnation: int,
) -> Iterator[pb.SnapshotPage]:
    """Pages of an index snapshot (MetadataIndex.snapshot): keys held on live nodes only, at
    most `max_keys` of them (0: all); the last page says whether that cap cut it short."""
    for page in _pages(copy, max_keys, page_keys):
        page.incarnation = incarnation
        yield page


def _pages(copy, max_keys: int, page_keys: int) -> Iterator[pb.SnapshotPage]:
    last_seq, nodes, tenants = copy
    sent, page = 0, None
    for tenant, items in tenants:
        keys, found = [], []
        for key, holders in items:
            live = [h for h in holders if h.node_id in nodes]
            if not live:
                continue
            if max_keys and sent == max_keys:
                yield _page(last_seq, tenant, keys, found, nodes, truncated=True)
                return
            keys.append(key)
            found.append(live)
            sent += 1
            if len(keys) == page_keys:
                yield (page := _page(last_seq, tenant, keys, found, nodes))
                keys, found = [], []
        if keys:
            yield (page := _page(last_seq, tenant, keys, found, nodes))
    if page is None:  # nothing held: one empty page still carries last_seq
        yield pb.SnapshotPage(last_seq=last_seq)


def _page(last_seq, tenant, keys, found, nodes, truncated=False) -> pb.SnapshotPage:
    return pb.SnapshotPage(
        last_seq=last_seq,
        tenant=tenant,
        keys=keys,
        truncated=truncated,
        holders=lookup_response(found, nodes, ""),
    )
