from pdmesh.v1 import common_pb2 as _common_pb2
from pdmesh.v1 import kv_transfer_pb2 as _kv_transfer_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_PREFILL: _ClassVar[Role]
    ROLE_DECODE: _ClassVar[Role]
    ROLE_COLOCATED: _ClassVar[Role]
ROLE_UNSPECIFIED: Role
ROLE_PREFILL: Role
ROLE_DECODE: Role
ROLE_COLOCATED: Role

class LendPrefixRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "cache_salt", "min_blocks", "max_blocks")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    MIN_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    min_blocks: int
    max_blocks: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ..., min_blocks: _Optional[int] = ..., max_blocks: _Optional[int] = ...) -> None: ...

class LendPrefixResponse(_message.Message):
    __slots__ = ("kv", "num_blocks", "instance_id")
    KV_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    kv: _kv_transfer_pb2.KVHandle
    num_blocks: int
    instance_id: str
    def __init__(self, kv: _Optional[_Union[_kv_transfer_pb2.KVHandle, _Mapping]] = ..., num_blocks: _Optional[int] = ..., instance_id: _Optional[str] = ...) -> None: ...

class PeerPrefix(_message.Message):
    __slots__ = ("kv", "capability", "instance_id")
    KV_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    kv: _kv_transfer_pb2.KVHandle
    capability: _kv_transfer_pb2.TransferCapability
    instance_id: str
    def __init__(self, kv: _Optional[_Union[_kv_transfer_pb2.KVHandle, _Mapping]] = ..., capability: _Optional[_Union[_kv_transfer_pb2.TransferCapability, _Mapping]] = ..., instance_id: _Optional[str] = ...) -> None: ...

class PeerPrefixResult(_message.Message):
    __slots__ = ("blocks_reused", "blocks_pulled", "bytes", "pull_ms", "fallback")
    BLOCKS_REUSED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_PULLED_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    PULL_MS_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_FIELD_NUMBER: _ClassVar[int]
    blocks_reused: int
    blocks_pulled: int
    bytes: int
    pull_ms: float
    fallback: str
    def __init__(self, blocks_reused: _Optional[int] = ..., blocks_pulled: _Optional[int] = ..., bytes: _Optional[int] = ..., pull_ms: _Optional[float] = ..., fallback: _Optional[str] = ...) -> None: ...

class EngineInfo(_message.Message):
    __slots__ = ("model", "instance_id", "role", "block_size", "hash_scheme_fingerprint", "max_model_len", "kv_capacity_tokens", "kv_backends", "selfcheck", "selfcheck_fallbacks", "kv_block_bytes")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    HASH_SCHEME_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BACKENDS_FIELD_NUMBER: _ClassVar[int]
    SELFCHECK_FIELD_NUMBER: _ClassVar[int]
    SELFCHECK_FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    model: str
    instance_id: str
    role: Role
    block_size: int
    hash_scheme_fingerprint: str
    max_model_len: int
    kv_capacity_tokens: int
    kv_backends: _containers.RepeatedScalarFieldContainer[str]
    selfcheck: str
    selfcheck_fallbacks: _containers.RepeatedScalarFieldContainer[str]
    kv_block_bytes: int
    def __init__(self, model: _Optional[str] = ..., instance_id: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., block_size: _Optional[int] = ..., hash_scheme_fingerprint: _Optional[str] = ..., max_model_len: _Optional[int] = ..., kv_capacity_tokens: _Optional[int] = ..., kv_backends: _Optional[_Iterable[str]] = ..., selfcheck: _Optional[str] = ..., selfcheck_fallbacks: _Optional[_Iterable[str]] = ..., kv_block_bytes: _Optional[int] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineLoad(_message.Message):
    __slots__ = ("instance_id", "role", "num_running", "num_waiting", "kv_usage", "num_free_blocks", "num_total_blocks", "num_pinned_blocks", "prefix_hit_tokens", "prefix_query_tokens", "kv_bytes_sent", "kv_bytes_received", "kv_transfers_sent", "kv_transfers_received", "num_steps", "step_seconds", "scheduled_tokens", "max_step_s", "core_silent_s", "core_stalled", "model_prefill_tokens_per_s")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFERS_SENT_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFERS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_STEP_S_FIELD_NUMBER: _ClassVar[int]
    CORE_SILENT_S_FIELD_NUMBER: _ClassVar[int]
    CORE_STALLED_FIELD_NUMBER: _ClassVar[int]
    MODEL_PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    role: Role
    num_running: int
    num_waiting: int
    kv_usage: float
    num_free_blocks: int
    num_total_blocks: int
    num_pinned_blocks: int
    prefix_hit_tokens: int
    prefix_query_tokens: int
    kv_bytes_sent: int
    kv_bytes_received: int
    kv_transfers_sent: int
    kv_transfers_received: int
    num_steps: int
    step_seconds: float
    scheduled_tokens: int
    max_step_s: float
    core_silent_s: float
    core_stalled: bool
    model_prefill_tokens_per_s: float
    def __init__(self, instance_id: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., kv_usage: _Optional[float] = ..., num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., num_pinned_blocks: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., prefix_query_tokens: _Optional[int] = ..., kv_bytes_sent: _Optional[int] = ..., kv_bytes_received: _Optional[int] = ..., kv_transfers_sent: _Optional[int] = ..., kv_transfers_received: _Optional[int] = ..., num_steps: _Optional[int] = ..., step_seconds: _Optional[float] = ..., scheduled_tokens: _Optional[int] = ..., max_step_s: _Optional[float] = ..., core_silent_s: _Optional[float] = ..., core_stalled: _Optional[bool] = ..., model_prefill_tokens_per_s: _Optional[float] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id", "reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reason: str
    def __init__(self, request_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "cache_salt", "priority", "peer_prefix")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    PEER_PREFIX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    cache_salt: str
    priority: int
    peer_prefix: PeerPrefix
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., priority: _Optional[int] = ..., peer_prefix: _Optional[_Union[PeerPrefix, _Mapping]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_id", "first", "prompt_logprobs", "cached_prompt_tokens", "kv", "timing", "instance_id", "peer_prefix")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_PREFIX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first: _containers.RepeatedCompositeFieldContainer[_common_pb2.SequenceDelta]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    cached_prompt_tokens: int
    kv: _kv_transfer_pb2.KVHandle
    timing: _common_pb2.Timing
    instance_id: str
    peer_prefix: PeerPrefixResult
    def __init__(self, request_id: _Optional[str] = ..., first: _Optional[_Iterable[_Union[_common_pb2.SequenceDelta, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., cached_prompt_tokens: _Optional[int] = ..., kv: _Optional[_Union[_kv_transfer_pb2.KVHandle, _Mapping]] = ..., timing: _Optional[_Union[_common_pb2.Timing, _Mapping]] = ..., instance_id: _Optional[str] = ..., peer_prefix: _Optional[_Union[PeerPrefixResult, _Mapping]] = ...) -> None: ...

class PrefillProgress(_message.Message):
    __slots__ = ("kv", "done")
    KV_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    kv: _kv_transfer_pb2.KVHandle
    done: PrefillResponse
    def __init__(self, kv: _Optional[_Union[_kv_transfer_pb2.KVHandle, _Mapping]] = ..., done: _Optional[_Union[PrefillResponse, _Mapping]] = ...) -> None: ...

class PrefillDoneRequest(_message.Message):
    __slots__ = ("request_id", "remote_prefill")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REMOTE_PREFILL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    remote_prefill: RemotePrefill
    def __init__(self, request_id: _Optional[str] = ..., remote_prefill: _Optional[_Union[RemotePrefill, _Mapping]] = ...) -> None: ...

class PrefillDoneResponse(_message.Message):
    __slots__ = ("accepted",)
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    def __init__(self, accepted: _Optional[bool] = ...) -> None: ...

class ReleaseKVRequest(_message.Message):
    __slots__ = ("request_id", "transfer_id", "reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    transfer_id: str
    reason: str
    def __init__(self, request_id: _Optional[str] = ..., transfer_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ReleaseKVResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class RemotePrefill(_message.Message):
    __slots__ = ("kv", "first", "cached_prompt_tokens", "capability", "streamed")
    KV_FIELD_NUMBER: _ClassVar[int]
    FIRST_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    STREAMED_FIELD_NUMBER: _ClassVar[int]
    kv: _kv_transfer_pb2.KVHandle
    first: _containers.RepeatedCompositeFieldContainer[_common_pb2.SequenceDelta]
    cached_prompt_tokens: int
    capability: _kv_transfer_pb2.TransferCapability
    streamed: bool
    def __init__(self, kv: _Optional[_Union[_kv_transfer_pb2.KVHandle, _Mapping]] = ..., first: _Optional[_Iterable[_Union[_common_pb2.SequenceDelta, _Mapping]]] = ..., cached_prompt_tokens: _Optional[int] = ..., capability: _Optional[_Union[_kv_transfer_pb2.TransferCapability, _Mapping]] = ..., streamed: _Optional[bool] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "cache_salt", "priority", "remote_prefill", "resume", "peer_prefix")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    REMOTE_PREFILL_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    PEER_PREFIX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    cache_salt: str
    priority: int
    remote_prefill: RemotePrefill
    resume: _containers.RepeatedCompositeFieldContainer[ResumedSequence]
    peer_prefix: PeerPrefix
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., priority: _Optional[int] = ..., remote_prefill: _Optional[_Union[RemotePrefill, _Mapping]] = ..., resume: _Optional[_Iterable[_Union[ResumedSequence, _Mapping]]] = ..., peer_prefix: _Optional[_Union[PeerPrefix, _Mapping]] = ...) -> None: ...

class ResumedSequence(_message.Message):
    __slots__ = ("index", "token_ids", "text", "finished")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finished: bool
    def __init__(self, index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finished: _Optional[bool] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("delta", "result", "prompt_logprobs")
    DELTA_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    delta: _common_pb2.SequenceDelta
    result: DecodeResult
    prompt_logprobs: _common_pb2.PromptLogprobs
    def __init__(self, delta: _Optional[_Union[_common_pb2.SequenceDelta, _Mapping]] = ..., result: _Optional[_Union[DecodeResult, _Mapping]] = ..., prompt_logprobs: _Optional[_Union[_common_pb2.PromptLogprobs, _Mapping]] = ...) -> None: ...

class DecodeResult(_message.Message):
    __slots__ = ("usage", "prompt_logprobs", "timing", "instance_id", "kv_load_fallback", "peer_prefix")
    USAGE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    KV_LOAD_FALLBACK_FIELD_NUMBER: _ClassVar[int]
    PEER_PREFIX_FIELD_NUMBER: _ClassVar[int]
    usage: _common_pb2.Usage
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    timing: _common_pb2.Timing
    instance_id: str
    kv_load_fallback: str
    peer_prefix: PeerPrefixResult
    def __init__(self, usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., timing: _Optional[_Union[_common_pb2.Timing, _Mapping]] = ..., instance_id: _Optional[str] = ..., kv_load_fallback: _Optional[str] = ..., peer_prefix: _Optional[_Union[PeerPrefixResult, _Mapping]] = ...) -> None: ...
