from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_DEVICE: _ClassVar[Tier]
    TIER_HOST: _ClassVar[Tier]
    TIER_DISK: _ClassVar[Tier]
TIER_UNSPECIFIED: Tier
TIER_DEVICE: Tier
TIER_HOST: Tier
TIER_DISK: Tier

class NodeInfo(_message.Message):
    __slots__ = ("node_id", "tcp_address", "ucx_address", "tier_capacity_bytes")
    class TierCapacityBytesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    TCP_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    UCX_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TIER_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    tcp_address: str
    ucx_address: str
    tier_capacity_bytes: _containers.ScalarMap[str, int]
    def __init__(self, node_id: _Optional[str] = ..., tcp_address: _Optional[str] = ..., ucx_address: _Optional[str] = ..., tier_capacity_bytes: _Optional[_Mapping[str, int]] = ...) -> None: ...

class RegisterNodeRequest(_message.Message):
    __slots__ = ("node", "lease_ttl_ms")
    NODE_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    node: NodeInfo
    lease_ttl_ms: int
    def __init__(self, node: _Optional[_Union[NodeInfo, _Mapping]] = ..., lease_ttl_ms: _Optional[int] = ...) -> None: ...

class RegisterNodeResponse(_message.Message):
    __slots__ = ("lease_id", "lease_ttl_ms")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    lease_ttl_ms: int
    def __init__(self, lease_id: _Optional[int] = ..., lease_ttl_ms: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("node_id", "lease_id")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    lease_id: int
    def __init__(self, node_id: _Optional[str] = ..., lease_id: _Optional[int] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("lease_ttl_ms",)
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    lease_ttl_ms: int
    def __init__(self, lease_ttl_ms: _Optional[int] = ...) -> None: ...

class DeregisterNodeRequest(_message.Message):
    __slots__ = ("node_id", "lease_id")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    lease_id: int
    def __init__(self, node_id: _Optional[str] = ..., lease_id: _Optional[int] = ...) -> None: ...

class DeregisterNodeResponse(_message.Message):
    __slots__ = ("removed_blocks",)
    REMOVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    removed_blocks: int
    def __init__(self, removed_blocks: _Optional[int] = ...) -> None: ...

class BlockEntry(_message.Message):
    __slots__ = ("key", "tier", "size_bytes", "checksum", "anchor")
    KEY_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    tier: Tier
    size_bytes: int
    checksum: int
    anchor: bytes
    def __init__(self, key: _Optional[bytes] = ..., tier: _Optional[_Union[Tier, str]] = ..., size_bytes: _Optional[int] = ..., checksum: _Optional[int] = ..., anchor: _Optional[bytes] = ...) -> None: ...

class PublishRequest(_message.Message):
    __slots__ = ("node_id", "lease_id", "tenant", "entries")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    lease_id: int
    tenant: str
    entries: _containers.RepeatedCompositeFieldContainer[BlockEntry]
    def __init__(self, node_id: _Optional[str] = ..., lease_id: _Optional[int] = ..., tenant: _Optional[str] = ..., entries: _Optional[_Iterable[_Union[BlockEntry, _Mapping]]] = ...) -> None: ...

class PublishResponse(_message.Message):
    __slots__ = ("accepted",)
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    def __init__(self, accepted: _Optional[int] = ...) -> None: ...

class UnpublishRequest(_message.Message):
    __slots__ = ("node_id", "lease_id", "tenant", "entries")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    lease_id: int
    tenant: str
    entries: _containers.RepeatedCompositeFieldContainer[BlockEntry]
    def __init__(self, node_id: _Optional[str] = ..., lease_id: _Optional[int] = ..., tenant: _Optional[str] = ..., entries: _Optional[_Iterable[_Union[BlockEntry, _Mapping]]] = ...) -> None: ...

class UnpublishResponse(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: int
    def __init__(self, removed: _Optional[int] = ...) -> None: ...

class NodeAddress(_message.Message):
    __slots__ = ("node_id", "tcp_address", "ucx_address")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    TCP_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    UCX_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    tcp_address: str
    ucx_address: str
    def __init__(self, node_id: _Optional[str] = ..., tcp_address: _Optional[str] = ..., ucx_address: _Optional[str] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("tenant", "keys", "caller_node_id", "chunk_tokens", "anchor")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    CALLER_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    caller_node_id: str
    chunk_tokens: int
    anchor: bytes
    def __init__(self, tenant: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., caller_node_id: _Optional[str] = ..., chunk_tokens: _Optional[int] = ..., anchor: _Optional[bytes] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("prefix_length", "nodes", "holder_counts", "holder_nodes", "holder_tiers")
    PREFIX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    HOLDER_COUNTS_FIELD_NUMBER: _ClassVar[int]
    HOLDER_NODES_FIELD_NUMBER: _ClassVar[int]
    HOLDER_TIERS_FIELD_NUMBER: _ClassVar[int]
    prefix_length: int
    nodes: _containers.RepeatedCompositeFieldContainer[NodeAddress]
    holder_counts: _containers.RepeatedScalarFieldContainer[int]
    holder_nodes: _containers.RepeatedScalarFieldContainer[int]
    holder_tiers: _containers.RepeatedScalarFieldContainer[Tier]
    def __init__(self, prefix_length: _Optional[int] = ..., nodes: _Optional[_Iterable[_Union[NodeAddress, _Mapping]]] = ..., holder_counts: _Optional[_Iterable[int]] = ..., holder_nodes: _Optional[_Iterable[int]] = ..., holder_tiers: _Optional[_Iterable[_Union[Tier, str]]] = ...) -> None: ...

class LookupStreamResponse(_message.Message):
    __slots__ = ("response", "status_code", "status_message")
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    STATUS_CODE_FIELD_NUMBER: _ClassVar[int]
    STATUS_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    response: LookupResponse
    status_code: int
    status_message: str
    def __init__(self, response: _Optional[_Union[LookupResponse, _Mapping]] = ..., status_code: _Optional[int] = ..., status_message: _Optional[str] = ...) -> None: ...

class LookupHello(_message.Message):
    __slots__ = ("token", "version", "instance")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    token: str
    version: int
    instance: bytes
    def __init__(self, token: _Optional[str] = ..., version: _Optional[int] = ..., instance: _Optional[bytes] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("lookup_port", "instance")
    LOOKUP_PORT_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    lookup_port: int
    instance: bytes
    def __init__(self, lookup_port: _Optional[int] = ..., instance: _Optional[bytes] = ...) -> None: ...

class RouteRequest(_message.Message):
    __slots__ = ("tenant", "keys", "candidate_node_ids")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_NODE_IDS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    candidate_node_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tenant: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., candidate_node_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class RouteResponse(_message.Message):
    __slots__ = ("node_id", "prefix_length")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    prefix_length: int
    def __init__(self, node_id: _Optional[str] = ..., prefix_length: _Optional[int] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("from_seq", "tenant")
    FROM_SEQ_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    from_seq: int
    tenant: str
    def __init__(self, from_seq: _Optional[int] = ..., tenant: _Optional[str] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("seq", "kind", "key", "tier", "node_id", "tenant")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[Event.Kind]
        KIND_STORED: _ClassVar[Event.Kind]
        KIND_REMOVED: _ClassVar[Event.Kind]
        KIND_GAP: _ClassVar[Event.Kind]
    KIND_UNSPECIFIED: Event.Kind
    KIND_STORED: Event.Kind
    KIND_REMOVED: Event.Kind
    KIND_GAP: Event.Kind
    SEQ_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    seq: int
    kind: Event.Kind
    key: bytes
    tier: Tier
    node_id: str
    tenant: str
    def __init__(self, seq: _Optional[int] = ..., kind: _Optional[_Union[Event.Kind, str]] = ..., key: _Optional[bytes] = ..., tier: _Optional[_Union[Tier, str]] = ..., node_id: _Optional[str] = ..., tenant: _Optional[str] = ...) -> None: ...

class EventBatch(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[Event]
    def __init__(self, events: _Optional[_Iterable[_Union[Event, _Mapping]]] = ...) -> None: ...

class SnapshotRequest(_message.Message):
    __slots__ = ("tenant", "max_keys", "page_keys")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    MAX_KEYS_FIELD_NUMBER: _ClassVar[int]
    PAGE_KEYS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    max_keys: int
    page_keys: int
    def __init__(self, tenant: _Optional[str] = ..., max_keys: _Optional[int] = ..., page_keys: _Optional[int] = ...) -> None: ...

class SnapshotPage(_message.Message):
    __slots__ = ("last_seq", "tenant", "keys", "holders", "truncated", "incarnation")
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    last_seq: int
    tenant: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    holders: LookupResponse
    truncated: bool
    incarnation: int
    def __init__(self, last_seq: _Optional[int] = ..., tenant: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., holders: _Optional[_Union[LookupResponse, _Mapping]] = ..., truncated: _Optional[bool] = ..., incarnation: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeStats(_message.Message):
    __slots__ = ("node", "blocks", "blocks_per_tier", "lease_expires_in_ms")
    class BlocksPerTierEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NODE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_PER_TIER_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_IN_MS_FIELD_NUMBER: _ClassVar[int]
    node: NodeInfo
    blocks: int
    blocks_per_tier: _containers.ScalarMap[str, int]
    lease_expires_in_ms: int
    def __init__(self, node: _Optional[_Union[NodeInfo, _Mapping]] = ..., blocks: _Optional[int] = ..., blocks_per_tier: _Optional[_Mapping[str, int]] = ..., lease_expires_in_ms: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("nodes", "blocks", "blocks_per_tier", "last_event_seq", "backend", "incarnation")
    class BlocksPerTierEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NODES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_PER_TIER_FIELD_NUMBER: _ClassVar[int]
    LAST_EVENT_SEQ_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeStats]
    blocks: int
    blocks_per_tier: _containers.ScalarMap[str, int]
    last_event_seq: int
    backend: str
    incarnation: int
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodeStats, _Mapping]]] = ..., blocks: _Optional[int] = ..., blocks_per_tier: _Optional[_Mapping[str, int]] = ..., last_event_seq: _Optional[int] = ..., backend: _Optional[str] = ..., incarnation: _Optional[int] = ...) -> None: ...
