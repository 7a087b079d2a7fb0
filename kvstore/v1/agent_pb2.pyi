from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AgentRequest(_message.Message):
    __slots__ = ("request_id", "hello", "lookup", "load", "release", "save", "commit", "abort", "stats")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    HELLO_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    SAVE_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    hello: HelloRequest
    lookup: LookupKeysRequest
    load: LoadRequest
    release: ReleaseRequest
    save: SaveRequest
    commit: CommitRequest
    abort: AbortRequest
    stats: AgentStatsRequest
    def __init__(self, request_id: _Optional[int] = ..., hello: _Optional[_Union[HelloRequest, _Mapping]] = ..., lookup: _Optional[_Union[LookupKeysRequest, _Mapping]] = ..., load: _Optional[_Union[LoadRequest, _Mapping]] = ..., release: _Optional[_Union[ReleaseRequest, _Mapping]] = ..., save: _Optional[_Union[SaveRequest, _Mapping]] = ..., commit: _Optional[_Union[CommitRequest, _Mapping]] = ..., abort: _Optional[_Union[AbortRequest, _Mapping]] = ..., stats: _Optional[_Union[AgentStatsRequest, _Mapping]] = ...) -> None: ...

class AgentError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class AgentResponse(_message.Message):
    __slots__ = ("request_id", "error", "hello", "lookup", "load", "release", "save", "commit", "abort", "stats")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    HELLO_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    SAVE_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    error: AgentError
    hello: HelloResponse
    lookup: LookupKeysResponse
    load: LoadResponse
    release: ReleaseResponse
    save: SaveResponse
    commit: CommitResponse
    abort: AbortResponse
    stats: AgentStatsResponse
    def __init__(self, request_id: _Optional[int] = ..., error: _Optional[_Union[AgentError, _Mapping]] = ..., hello: _Optional[_Union[HelloResponse, _Mapping]] = ..., lookup: _Optional[_Union[LookupKeysResponse, _Mapping]] = ..., load: _Optional[_Union[LoadResponse, _Mapping]] = ..., release: _Optional[_Union[ReleaseResponse, _Mapping]] = ..., save: _Optional[_Union[SaveResponse, _Mapping]] = ..., commit: _Optional[_Union[CommitResponse, _Mapping]] = ..., abort: _Optional[_Union[AbortResponse, _Mapping]] = ..., stats: _Optional[_Union[AgentStatsResponse, _Mapping]] = ...) -> None: ...

class HelloRequest(_message.Message):
    __slots__ = ("worker", "credential")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    worker: str
    credential: str
    def __init__(self, worker: _Optional[str] = ..., credential: _Optional[str] = ...) -> None: ...

class HelloResponse(_message.Message):
    __slots__ = ("node_id", "arena_name", "num_pages", "page_size_bytes", "header_bytes", "tenants", "access", "mapping_bytes")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ARENA_NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    HEADER_BYTES_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    ACCESS_FIELD_NUMBER: _ClassVar[int]
    MAPPING_BYTES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    arena_name: str
    num_pages: int
    page_size_bytes: int
    header_bytes: int
    tenants: _containers.RepeatedScalarFieldContainer[str]
    access: str
    mapping_bytes: int
    def __init__(self, node_id: _Optional[str] = ..., arena_name: _Optional[str] = ..., num_pages: _Optional[int] = ..., page_size_bytes: _Optional[int] = ..., header_bytes: _Optional[int] = ..., tenants: _Optional[_Iterable[str]] = ..., access: _Optional[str] = ..., mapping_bytes: _Optional[int] = ...) -> None: ...

class LookupKeysRequest(_message.Message):
    __slots__ = ("tenant", "keys", "local_only", "chunk_tokens")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_ONLY_FIELD_NUMBER: _ClassVar[int]
    CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    local_only: bool
    chunk_tokens: int
    def __init__(self, tenant: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., local_only: _Optional[bool] = ..., chunk_tokens: _Optional[int] = ...) -> None: ...

class LookupKeysResponse(_message.Message):
    __slots__ = ("local_hits", "remote_hits", "tiers")
    LOCAL_HITS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_HITS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    local_hits: int
    remote_hits: int
    tiers: bytes
    def __init__(self, local_hits: _Optional[int] = ..., remote_hits: _Optional[int] = ..., tiers: _Optional[bytes] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ("tenant", "keys", "timeout_ms")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    timeout_ms: int
    def __init__(self, tenant: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class LoadResponse(_message.Message):
    __slots__ = ("load_id", "payload_bytes", "checksums", "local_blocks", "remote_blocks", "offsets")
    LOAD_ID_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    load_id: int
    payload_bytes: _containers.RepeatedScalarFieldContainer[int]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    local_blocks: int
    remote_blocks: int
    offsets: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, load_id: _Optional[int] = ..., payload_bytes: _Optional[_Iterable[int]] = ..., checksums: _Optional[_Iterable[int]] = ..., local_blocks: _Optional[int] = ..., remote_blocks: _Optional[int] = ..., offsets: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("load_id", "suspect")
    LOAD_ID_FIELD_NUMBER: _ClassVar[int]
    SUSPECT_FIELD_NUMBER: _ClassVar[int]
    load_id: int
    suspect: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, load_id: _Optional[int] = ..., suspect: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SaveRequest(_message.Message):
    __slots__ = ("tenant", "keys", "first_parent", "payload_bytes", "layout_hash", "codec_id")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    FIRST_PARENT_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_HASH_FIELD_NUMBER: _ClassVar[int]
    CODEC_ID_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    first_parent: bytes
    payload_bytes: int
    layout_hash: int
    codec_id: int
    def __init__(self, tenant: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., first_parent: _Optional[bytes] = ..., payload_bytes: _Optional[int] = ..., layout_hash: _Optional[int] = ..., codec_id: _Optional[int] = ...) -> None: ...

class SaveResponse(_message.Message):
    __slots__ = ("save_id", "reserved", "offsets")
    SAVE_ID_FIELD_NUMBER: _ClassVar[int]
    RESERVED_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    save_id: int
    reserved: _containers.RepeatedScalarFieldContainer[bool]
    offsets: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, save_id: _Optional[int] = ..., reserved: _Optional[_Iterable[bool]] = ..., offsets: _Optional[_Iterable[int]] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("save_id", "keys", "checksums")
    SAVE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    save_id: int
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, save_id: _Optional[int] = ..., keys: _Optional[_Iterable[bytes]] = ..., checksums: _Optional[_Iterable[int]] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("committed",)
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    committed: int
    def __init__(self, committed: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("save_id",)
    SAVE_ID_FIELD_NUMBER: _ClassVar[int]
    save_id: int
    def __init__(self, save_id: _Optional[int] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AgentStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AgentStatsResponse(_message.Message):
    __slots__ = ("json",)
    JSON_FIELD_NUMBER: _ClassVar[int]
    json: str
    def __init__(self, json: _Optional[str] = ...) -> None: ...
