from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVTransferState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_TRANSFER_STATE_UNSPECIFIED: _ClassVar[KVTransferState]
    KV_TRANSFER_STATE_PENDING: _ClassVar[KVTransferState]
    KV_TRANSFER_STATE_TRANSFERRING: _ClassVar[KVTransferState]
    KV_TRANSFER_STATE_DONE: _ClassVar[KVTransferState]
    KV_TRANSFER_STATE_FAILED: _ClassVar[KVTransferState]
    KV_TRANSFER_STATE_EXPIRED: _ClassVar[KVTransferState]
    KV_TRANSFER_STATE_CANCELLED: _ClassVar[KVTransferState]

class KVDType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_DTYPE_UNSPECIFIED: _ClassVar[KVDType]
    KV_DTYPE_FLOAT32: _ClassVar[KVDType]
    KV_DTYPE_FLOAT16: _ClassVar[KVDType]
    KV_DTYPE_BFLOAT16: _ClassVar[KVDType]
KV_TRANSFER_STATE_UNSPECIFIED: KVTransferState
KV_TRANSFER_STATE_PENDING: KVTransferState
KV_TRANSFER_STATE_TRANSFERRING: KVTransferState
KV_TRANSFER_STATE_DONE: KVTransferState
KV_TRANSFER_STATE_FAILED: KVTransferState
KV_TRANSFER_STATE_EXPIRED: KVTransferState
KV_TRANSFER_STATE_CANCELLED: KVTransferState
KV_DTYPE_UNSPECIFIED: KVDType
KV_DTYPE_FLOAT32: KVDType
KV_DTYPE_FLOAT16: KVDType
KV_DTYPE_BFLOAT16: KVDType

class KVLayout(_message.Message):
    __slots__ = ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim", "dtype", "num_tokens")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: KVDType
    num_tokens: int
    def __init__(self, num_layers: _Optional[int] = ..., num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[_Union[KVDType, str]] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class KVHandle(_message.Message):
    __slots__ = ("transfer_id", "request_id", "sender_address", "backends", "host_key", "sender_id", "layout", "checksum_algo", "checksum", "block_checksums", "streamed")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SENDER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BACKENDS_FIELD_NUMBER: _ClassVar[int]
    HOST_KEY_FIELD_NUMBER: _ClassVar[int]
    SENDER_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_ALGO_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    STREAMED_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    request_id: str
    sender_address: str
    backends: _containers.RepeatedScalarFieldContainer[str]
    host_key: str
    sender_id: str
    layout: KVLayout
    checksum_algo: str
    checksum: int
    block_checksums: _containers.RepeatedScalarFieldContainer[int]
    streamed: bool
    def __init__(self, transfer_id: _Optional[str] = ..., request_id: _Optional[str] = ..., sender_address: _Optional[str] = ..., backends: _Optional[_Iterable[str]] = ..., host_key: _Optional[str] = ..., sender_id: _Optional[str] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., checksum_algo: _Optional[str] = ..., checksum: _Optional[int] = ..., block_checksums: _Optional[_Iterable[int]] = ..., streamed: _Optional[bool] = ...) -> None: ...

class TransferCapability(_message.Message):
    __slots__ = ("receiver_id", "expires_unix_ms", "mac")
    RECEIVER_ID_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    receiver_id: str
    expires_unix_ms: int
    mac: str
    def __init__(self, receiver_id: _Optional[str] = ..., expires_unix_ms: _Optional[int] = ..., mac: _Optional[str] = ...) -> None: ...

class StartTransferRequest(_message.Message):
    __slots__ = ("transfer_id", "request_id", "backend", "receiver_host_key", "lease_ms", "traceparent", "capability")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_HOST_KEY_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    request_id: str
    backend: str
    receiver_host_key: str
    lease_ms: int
    traceparent: str
    capability: TransferCapability
    def __init__(self, transfer_id: _Optional[str] = ..., request_id: _Optional[str] = ..., backend: _Optional[str] = ..., receiver_host_key: _Optional[str] = ..., lease_ms: _Optional[int] = ..., traceparent: _Optional[str] = ..., capability: _Optional[_Union[TransferCapability, _Mapping]] = ...) -> None: ...

class StartTransferReply(_message.Message):
    __slots__ = ("state", "params", "lease_remaining_ms")
    class ParamsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    STATE_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    LEASE_REMAINING_MS_FIELD_NUMBER: _ClassVar[int]
    state: KVTransferState
    params: _containers.ScalarMap[str, str]
    lease_remaining_ms: int
    def __init__(self, state: _Optional[_Union[KVTransferState, str]] = ..., params: _Optional[_Mapping[str, str]] = ..., lease_remaining_ms: _Optional[int] = ...) -> None: ...

class CompleteTransferRequest(_message.Message):
    __slots__ = ("transfer_id", "request_id", "ok", "error", "traceparent", "pulled_bytes")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    PULLED_BYTES_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    request_id: str
    ok: bool
    error: str
    traceparent: str
    pulled_bytes: int
    def __init__(self, transfer_id: _Optional[str] = ..., request_id: _Optional[str] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., traceparent: _Optional[str] = ..., pulled_bytes: _Optional[int] = ...) -> None: ...

class CompleteTransferReply(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: KVTransferState
    def __init__(self, state: _Optional[_Union[KVTransferState, str]] = ...) -> None: ...

class ExtendLeaseRequest(_message.Message):
    __slots__ = ("transfer_id", "request_id", "extend_ms", "traceparent")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EXTEND_MS_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    request_id: str
    extend_ms: int
    traceparent: str
    def __init__(self, transfer_id: _Optional[str] = ..., request_id: _Optional[str] = ..., extend_ms: _Optional[int] = ..., traceparent: _Optional[str] = ...) -> None: ...

class ExtendLeaseReply(_message.Message):
    __slots__ = ("state", "lease_remaining_ms")
    STATE_FIELD_NUMBER: _ClassVar[int]
    LEASE_REMAINING_MS_FIELD_NUMBER: _ClassVar[int]
    state: KVTransferState
    lease_remaining_ms: int
    def __init__(self, state: _Optional[_Union[KVTransferState, str]] = ..., lease_remaining_ms: _Optional[int] = ...) -> None: ...

class CancelTransferRequest(_message.Message):
    __slots__ = ("transfer_id", "request_id", "reason", "traceparent")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    request_id: str
    reason: str
    traceparent: str
    def __init__(self, transfer_id: _Optional[str] = ..., request_id: _Optional[str] = ..., reason: _Optional[str] = ..., traceparent: _Optional[str] = ...) -> None: ...

class CancelTransferReply(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: KVTransferState
    def __init__(self, state: _Optional[_Union[KVTransferState, str]] = ...) -> None: ...

class WatchTransferRequest(_message.Message):
    __slots__ = ("transfer_id", "request_id", "traceparent")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    request_id: str
    traceparent: str
    def __init__(self, transfer_id: _Optional[str] = ..., request_id: _Optional[str] = ..., traceparent: _Optional[str] = ...) -> None: ...

class TransferProgress(_message.Message):
    __slots__ = ("first_index", "block_ids", "block_checksums", "sealed", "failed")
    FIRST_INDEX_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    SEALED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    first_index: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    block_checksums: _containers.RepeatedScalarFieldContainer[int]
    sealed: bool
    failed: str
    def __init__(self, first_index: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., block_checksums: _Optional[_Iterable[int]] = ..., sealed: _Optional[bool] = ..., failed: _Optional[str] = ...) -> None: ...
