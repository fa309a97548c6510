from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PutStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STORED: _ClassVar[PutStatus]
    ALREADY_PRESENT: _ClassVar[PutStatus]
STORED: PutStatus
ALREADY_PRESENT: PutStatus

class LookupRequest(_message.Message):
    __slots__ = ("keys", "write_check", "in_place")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    WRITE_CHECK_FIELD_NUMBER: _ClassVar[int]
    IN_PLACE_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    write_check: bool
    in_place: bool
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., write_check: _Optional[bool] = ..., in_place: _Optional[bool] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("prefix_len", "tiers", "evicted_from", "arena_offsets", "arena_lengths", "arena_token")
    PREFIX_LEN_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FROM_FIELD_NUMBER: _ClassVar[int]
    ARENA_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    ARENA_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    ARENA_TOKEN_FIELD_NUMBER: _ClassVar[int]
    prefix_len: int
    tiers: _containers.RepeatedScalarFieldContainer[str]
    evicted_from: _containers.RepeatedScalarFieldContainer[str]
    arena_offsets: _containers.RepeatedScalarFieldContainer[int]
    arena_lengths: _containers.RepeatedScalarFieldContainer[int]
    arena_token: bytes
    def __init__(self, prefix_len: _Optional[int] = ..., tiers: _Optional[_Iterable[str]] = ..., evicted_from: _Optional[_Iterable[str]] = ..., arena_offsets: _Optional[_Iterable[int]] = ..., arena_lengths: _Optional[_Iterable[int]] = ..., arena_token: _Optional[bytes] = ...) -> None: ...

class BlockSpec(_message.Message):
    __slots__ = ("key", "size", "dtype", "shape")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    size: int
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, key: _Optional[bytes] = ..., size: _Optional[int] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class PutBegin(_message.Message):
    __slots__ = ("blocks", "shm_session")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SHM_SESSION_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[BlockSpec]
    shm_session: str
    def __init__(self, blocks: _Optional[_Iterable[_Union[BlockSpec, _Mapping]]] = ..., shm_session: _Optional[str] = ...) -> None: ...

class PutChunk(_message.Message):
    __slots__ = ("index", "offset", "data")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    index: int
    offset: int
    data: bytes
    def __init__(self, index: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class ShmRef(_message.Message):
    __slots__ = ("index", "offset", "length")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    index: int
    offset: int
    length: int
    def __init__(self, index: _Optional[int] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class PutCommit(_message.Message):
    __slots__ = ("shm",)
    SHM_FIELD_NUMBER: _ClassVar[int]
    shm: _containers.RepeatedCompositeFieldContainer[ShmRef]
    def __init__(self, shm: _Optional[_Iterable[_Union[ShmRef, _Mapping]]] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("begin", "chunk", "commit")
    BEGIN_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    begin: PutBegin
    chunk: PutChunk
    commit: PutCommit
    def __init__(self, begin: _Optional[_Union[PutBegin, _Mapping]] = ..., chunk: _Optional[_Union[PutChunk, _Mapping]] = ..., commit: _Optional[_Union[PutCommit, _Mapping]] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("status",)
    STATUS_FIELD_NUMBER: _ClassVar[int]
    status: _containers.RepeatedScalarFieldContainer[PutStatus]
    def __init__(self, status: _Optional[_Iterable[_Union[PutStatus, str]]] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("keys", "shm_session", "shm_offset", "shm_length", "arena")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SHM_SESSION_FIELD_NUMBER: _ClassVar[int]
    SHM_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SHM_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ARENA_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    shm_session: str
    shm_offset: int
    shm_length: int
    arena: bool
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., shm_session: _Optional[str] = ..., shm_offset: _Optional[int] = ..., shm_length: _Optional[int] = ..., arena: _Optional[bool] = ...) -> None: ...

class ShmBlock(_message.Message):
    __slots__ = ("index", "found", "deferred", "offset", "length", "arena")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    DEFERRED_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    ARENA_FIELD_NUMBER: _ClassVar[int]
    index: int
    found: bool
    deferred: bool
    offset: int
    length: int
    arena: bool
    def __init__(self, index: _Optional[int] = ..., found: _Optional[bool] = ..., deferred: _Optional[bool] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., arena: _Optional[bool] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("index", "found", "total", "offset", "data", "shm", "lease")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    index: int
    found: bool
    total: int
    offset: int
    data: bytes
    shm: _containers.RepeatedCompositeFieldContainer[ShmBlock]
    lease: int
    def __init__(self, index: _Optional[int] = ..., found: _Optional[bool] = ..., total: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., shm: _Optional[_Iterable[_Union[ShmBlock, _Mapping]]] = ..., lease: _Optional[int] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    def __init__(self, deleted: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("name", "used_bytes", "capacity_bytes", "blocks", "available", "last_error", "hits", "misses", "evictions", "spills", "promotions", "dropped", "errors", "read_bytes", "write_bytes", "detaches", "attaches", "skipped_writes", "refused", "quota_spills", "replayed", "replay_dropped", "replay_skipped", "replay_parked")
    NAME_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    SPILLS_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    READ_BYTES_FIELD_NUMBER: _ClassVar[int]
    WRITE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DETACHES_FIELD_NUMBER: _ClassVar[int]
    ATTACHES_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_WRITES_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    QUOTA_SPILLS_FIELD_NUMBER: _ClassVar[int]
    REPLAYED_FIELD_NUMBER: _ClassVar[int]
    REPLAY_DROPPED_FIELD_NUMBER: _ClassVar[int]
    REPLAY_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    REPLAY_PARKED_FIELD_NUMBER: _ClassVar[int]
    name: str
    used_bytes: int
    capacity_bytes: int
    blocks: int
    available: bool
    last_error: str
    hits: int
    misses: int
    evictions: int
    spills: int
    promotions: int
    dropped: int
    errors: int
    read_bytes: int
    write_bytes: int
    detaches: int
    attaches: int
    skipped_writes: int
    refused: int
    quota_spills: int
    replayed: int
    replay_dropped: int
    replay_skipped: int
    replay_parked: int
    def __init__(self, name: _Optional[str] = ..., used_bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., blocks: _Optional[int] = ..., available: _Optional[bool] = ..., last_error: _Optional[str] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., spills: _Optional[int] = ..., promotions: _Optional[int] = ..., dropped: _Optional[int] = ..., errors: _Optional[int] = ..., read_bytes: _Optional[int] = ..., write_bytes: _Optional[int] = ..., detaches: _Optional[int] = ..., attaches: _Optional[int] = ..., skipped_writes: _Optional[int] = ..., refused: _Optional[int] = ..., quota_spills: _Optional[int] = ..., replayed: _Optional[int] = ..., replay_dropped: _Optional[int] = ..., replay_skipped: _Optional[int] = ..., replay_parked: _Optional[int] = ...) -> None: ...

class TenantStats(_message.Message):
    __slots__ = ("tier", "tenant", "used_bytes", "blocks", "quota_spills")
    TIER_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    QUOTA_SPILLS_FIELD_NUMBER: _ClassVar[int]
    tier: str
    tenant: str
    used_bytes: int
    blocks: int
    quota_spills: int
    def __init__(self, tier: _Optional[str] = ..., tenant: _Optional[str] = ..., used_bytes: _Optional[int] = ..., blocks: _Optional[int] = ..., quota_spills: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("tiers", "pending_blocks", "pending_bytes", "tenants", "parked_blocks", "parked_bytes")
    TIERS_FIELD_NUMBER: _ClassVar[int]
    PENDING_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PENDING_BYTES_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    PARKED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PARKED_BYTES_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    pending_blocks: int
    pending_bytes: int
    tenants: _containers.RepeatedCompositeFieldContainer[TenantStats]
    parked_blocks: int
    parked_bytes: int
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., pending_blocks: _Optional[int] = ..., pending_bytes: _Optional[int] = ..., tenants: _Optional[_Iterable[_Union[TenantStats, _Mapping]]] = ..., parked_blocks: _Optional[int] = ..., parked_bytes: _Optional[int] = ...) -> None: ...

class AttachShmRequest(_message.Message):
    __slots__ = ("size", "arena", "by_fd")
    SIZE_FIELD_NUMBER: _ClassVar[int]
    ARENA_FIELD_NUMBER: _ClassVar[int]
    BY_FD_FIELD_NUMBER: _ClassVar[int]
    size: int
    arena: bool
    by_fd: bool
    def __init__(self, size: _Optional[int] = ..., arena: _Optional[bool] = ..., by_fd: _Optional[bool] = ...) -> None: ...

class AttachShmResponse(_message.Message):
    __slots__ = ("ok", "reason", "ticket", "socket")
    OK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    SOCKET_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    reason: str
    ticket: bytes
    socket: str
    def __init__(self, ok: _Optional[bool] = ..., reason: _Optional[str] = ..., ticket: _Optional[bytes] = ..., socket: _Optional[str] = ...) -> None: ...

class ShmHello(_message.Message):
    __slots__ = ("ticket", "size")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    ticket: bytes
    size: int
    def __init__(self, ticket: _Optional[bytes] = ..., size: _Optional[int] = ...) -> None: ...

class ShmWelcome(_message.Message):
    __slots__ = ("ok", "session", "reason", "arena_size", "arena_token")
    OK_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ARENA_SIZE_FIELD_NUMBER: _ClassVar[int]
    ARENA_TOKEN_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    session: str
    reason: str
    arena_size: int
    arena_token: bytes
    def __init__(self, ok: _Optional[bool] = ..., session: _Optional[str] = ..., reason: _Optional[str] = ..., arena_size: _Optional[int] = ..., arena_token: _Optional[bytes] = ...) -> None: ...

class ReleaseLeaseRequest(_message.Message):
    __slots__ = ("session", "leases")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    session: str
    leases: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session: _Optional[str] = ..., leases: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseLeaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DetachShmRequest(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: str
    def __init__(self, session: _Optional[str] = ...) -> None: ...

class DetachShmResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class OpenStreamRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class OpenStreamResponse(_message.Message):
    __slots__ = ("ok", "port", "token", "reason")
    OK_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    port: int
    token: bytes
    reason: str
    def __init__(self, ok: _Optional[bool] = ..., port: _Optional[int] = ..., token: _Optional[bytes] = ..., reason: _Optional[str] = ...) -> None: ...

class TraceStartRequest(_message.Message):
    __slots__ = ("out", "max_records")
    OUT_FIELD_NUMBER: _ClassVar[int]
    MAX_RECORDS_FIELD_NUMBER: _ClassVar[int]
    out: str
    max_records: int
    def __init__(self, out: _Optional[str] = ..., max_records: _Optional[int] = ...) -> None: ...

class TraceStartResponse(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class TraceStopRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TraceStopResponse(_message.Message):
    __slots__ = ("path", "records", "overwritten")
    PATH_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    OVERWRITTEN_FIELD_NUMBER: _ClassVar[int]
    path: str
    records: int
    overwritten: int
    def __init__(self, path: _Optional[str] = ..., records: _Optional[int] = ..., overwritten: _Optional[int] = ...) -> None: ...
