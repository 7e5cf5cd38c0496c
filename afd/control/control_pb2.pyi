from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StoreRequest(_message.Message):
    __slots__ = ("keys", "value", "expected", "amount", "timeout_seconds")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    AMOUNT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    value: bytes
    expected: bytes
    amount: int
    timeout_seconds: float
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., value: _Optional[bytes] = ..., expected: _Optional[bytes] = ..., amount: _Optional[int] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class StoreReply(_message.Message):
    __slots__ = ("found", "value", "amount")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    AMOUNT_FIELD_NUMBER: _ClassVar[int]
    found: bool
    value: bytes
    amount: int
    def __init__(self, found: _Optional[bool] = ..., value: _Optional[bytes] = ..., amount: _Optional[int] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("name", "role", "address", "model_fingerprint", "version", "instance_id", "again", "ready")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    AGAIN_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    name: str
    role: str
    address: str
    model_fingerprint: str
    version: str
    instance_id: str
    again: bool
    ready: bool
    def __init__(self, name: _Optional[str] = ..., role: _Optional[str] = ..., address: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., version: _Optional[str] = ..., instance_id: _Optional[str] = ..., again: _Optional[bool] = ..., ready: _Optional[bool] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("rank", "world_size", "peer_ranks", "cluster_name")
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    PEER_RANKS_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_NAME_FIELD_NUMBER: _ClassVar[int]
    rank: int
    world_size: int
    peer_ranks: _containers.RepeatedScalarFieldContainer[int]
    cluster_name: str
    def __init__(self, rank: _Optional[int] = ..., world_size: _Optional[int] = ..., peer_ranks: _Optional[_Iterable[int]] = ..., cluster_name: _Optional[str] = ...) -> None: ...

class NodeRef(_message.Message):
    __slots__ = ("name", "instance_id", "paused")
    NAME_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    name: str
    instance_id: str
    paused: str
    def __init__(self, name: _Optional[str] = ..., instance_id: _Optional[str] = ..., paused: _Optional[str] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("timeout_seconds", "node")
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    timeout_seconds: float
    node: str
    def __init__(self, timeout_seconds: _Optional[float] = ..., node: _Optional[str] = ...) -> None: ...

class ShutdownRequest(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClusterStatus(_message.Message):
    __slots__ = ("state", "missing", "registered", "ready", "lost", "message", "draining", "restarting", "late")
    class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STARTING: _ClassVar[ClusterStatus.State]
        READY: _ClassVar[ClusterStatus.State]
        DEGRADED: _ClassVar[ClusterStatus.State]
        DRAINING: _ClassVar[ClusterStatus.State]
        SHUTDOWN: _ClassVar[ClusterStatus.State]
        FAILED: _ClassVar[ClusterStatus.State]
    STARTING: ClusterStatus.State
    READY: ClusterStatus.State
    DEGRADED: ClusterStatus.State
    DRAINING: ClusterStatus.State
    SHUTDOWN: ClusterStatus.State
    FAILED: ClusterStatus.State
    STATE_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    RESTARTING_FIELD_NUMBER: _ClassVar[int]
    LATE_FIELD_NUMBER: _ClassVar[int]
    state: ClusterStatus.State
    missing: _containers.RepeatedScalarFieldContainer[str]
    registered: _containers.RepeatedScalarFieldContainer[str]
    ready: _containers.RepeatedScalarFieldContainer[str]
    lost: _containers.RepeatedScalarFieldContainer[str]
    message: str
    draining: _containers.RepeatedScalarFieldContainer[str]
    restarting: _containers.RepeatedScalarFieldContainer[str]
    late: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, state: _Optional[_Union[ClusterStatus.State, str]] = ..., missing: _Optional[_Iterable[str]] = ..., registered: _Optional[_Iterable[str]] = ..., ready: _Optional[_Iterable[str]] = ..., lost: _Optional[_Iterable[str]] = ..., message: _Optional[str] = ..., draining: _Optional[_Iterable[str]] = ..., restarting: _Optional[_Iterable[str]] = ..., late: _Optional[_Iterable[str]] = ...) -> None: ...

class PairRequest(_message.Message):
    __slots__ = ("name", "instance_id", "rank", "key", "timeout_seconds")
    NAME_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    name: str
    instance_id: str
    rank: int
    key: str
    timeout_seconds: float
    def __init__(self, name: _Optional[str] = ..., instance_id: _Optional[str] = ..., rank: _Optional[int] = ..., key: _Optional[str] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class PairReply(_message.Message):
    __slots__ = ("rank", "experts")
    RANK_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    experts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, rank: _Optional[int] = ..., experts: _Optional[_Iterable[int]] = ...) -> None: ...
