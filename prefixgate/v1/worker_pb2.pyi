from prefixgate.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVLayout(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_LAYOUT_UNSPECIFIED: _ClassVar[KVLayout]
    KV_LAYOUT_LAYER_TOKEN_HEAD_DIM: _ClassVar[KVLayout]
KV_LAYOUT_UNSPECIFIED: KVLayout
KV_LAYOUT_LAYER_TOKEN_HEAD_DIM: KVLayout

class PullSpec(_message.Message):
    __slots__ = ("peer_address", "peer_worker_id", "num_blocks", "ticket")
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PEER_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    peer_address: str
    peer_worker_id: str
    num_blocks: int
    ticket: bytes
    def __init__(self, peer_address: _Optional[str] = ..., peer_worker_id: _Optional[str] = ..., num_blocks: _Optional[int] = ..., ticket: _Optional[bytes] = ...) -> None: ...

class ExportBlocksRequest(_message.Message):
    __slots__ = ("block_hashes", "from_block", "ticket", "max_blocks")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    FROM_BLOCK_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    from_block: int
    ticket: bytes
    max_blocks: int
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ..., from_block: _Optional[int] = ..., ticket: _Optional[bytes] = ..., max_blocks: _Optional[int] = ...) -> None: ...

class KVBlocksHeader(_message.Message):
    __slots__ = ("worker_id", "model_fingerprint", "block_size", "dtype", "layout", "num_layers", "num_kv_heads", "head_dim", "bytes_per_token", "num_blocks")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    model_fingerprint: str
    block_size: int
    dtype: str
    layout: KVLayout
    num_layers: int
    num_kv_heads: int
    head_dim: int
    bytes_per_token: int
    num_blocks: int
    def __init__(self, worker_id: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., block_size: _Optional[int] = ..., dtype: _Optional[str] = ..., layout: _Optional[_Union[KVLayout, str]] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., bytes_per_token: _Optional[int] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class KVBlocksChunk(_message.Message):
    __slots__ = ("first_block", "num_blocks", "k", "v", "block_digests")
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    V_FIELD_NUMBER: _ClassVar[int]
    BLOCK_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    first_block: int
    num_blocks: int
    k: bytes
    v: bytes
    block_digests: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, first_block: _Optional[int] = ..., num_blocks: _Optional[int] = ..., k: _Optional[bytes] = ..., v: _Optional[bytes] = ..., block_digests: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ExportBlocksEvent(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: KVBlocksHeader
    chunk: KVBlocksChunk
    def __init__(self, header: _Optional[_Union[KVBlocksHeader, _Mapping]] = ..., chunk: _Optional[_Union[KVBlocksChunk, _Mapping]] = ...) -> None: ...

class PullBlocksRequest(_message.Message):
    __slots__ = ("peer_address", "peer_worker_id", "block_hashes", "ticket", "token_ids", "namespace")
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PEER_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    peer_address: str
    peer_worker_id: str
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    ticket: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    namespace: str
    def __init__(self, peer_address: _Optional[str] = ..., peer_worker_id: _Optional[str] = ..., block_hashes: _Optional[_Iterable[int]] = ..., ticket: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ..., namespace: _Optional[str] = ...) -> None: ...

class PullBlocksResponse(_message.Message):
    __slots__ = ("num_cached_blocks", "num_pulled_blocks", "num_bytes", "seconds")
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_PULLED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    num_cached_blocks: int
    num_pulled_blocks: int
    num_bytes: int
    seconds: float
    def __init__(self, num_cached_blocks: _Optional[int] = ..., num_pulled_blocks: _Optional[int] = ..., num_bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "packed_prompt_token_ids", "sampling", "namespace", "pull")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PACKED_PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PULL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    packed_prompt_token_ids: bytes
    sampling: _common_pb2.SamplingParams
    namespace: str
    pull: PullSpec
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., packed_prompt_token_ids: _Optional[bytes] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., namespace: _Optional[str] = ..., pull: _Optional[_Union[PullSpec, _Mapping]] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("token_ids", "text", "index", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    index: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., index: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class GenerateFinal(_message.Message):
    __slots__ = ("usage", "finish_reason", "timings", "sample_finish_reasons")
    USAGE_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FINISH_REASONS_FIELD_NUMBER: _ClassVar[int]
    usage: _common_pb2.Usage
    finish_reason: _common_pb2.FinishReason
    timings: _common_pb2.Timings
    sample_finish_reasons: _containers.RepeatedScalarFieldContainer[_common_pb2.FinishReason]
    def __init__(self, usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., timings: _Optional[_Union[_common_pb2.Timings, _Mapping]] = ..., sample_finish_reasons: _Optional[_Iterable[_Union[_common_pb2.FinishReason, str]]] = ...) -> None: ...

class GenerateEvent(_message.Message):
    __slots__ = ("chunk", "final")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    chunk: GenerateChunk
    final: GenerateFinal
    def __init__(self, chunk: _Optional[_Union[GenerateChunk, _Mapping]] = ..., final: _Optional[_Union[GenerateFinal, _Mapping]] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "model_name", "model_fingerprint", "block_size", "max_context_tokens", "kv_capacity_tokens", "reuse_block_tokens")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REUSE_BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    model_name: str
    model_fingerprint: str
    block_size: int
    max_context_tokens: int
    kv_capacity_tokens: int
    reuse_block_tokens: int
    def __init__(self, worker_id: _Optional[str] = ..., model_name: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., block_size: _Optional[int] = ..., max_context_tokens: _Optional[int] = ..., kv_capacity_tokens: _Optional[int] = ..., reuse_block_tokens: _Optional[int] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("num_running_requests", "num_waiting_requests", "num_queued_prefill_tokens", "kv_used_tokens", "kv_capacity_tokens", "prefill_tokens_per_s", "decode_step_s", "prefill_chunk_tokens", "kv_bytes_per_token", "transfer_bytes_per_s", "transfer_setup_s", "transfer_rate_source")
    NUM_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_USED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEP_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SETUP_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_RATE_SOURCE_FIELD_NUMBER: _ClassVar[int]
    num_running_requests: int
    num_waiting_requests: int
    num_queued_prefill_tokens: int
    kv_used_tokens: int
    kv_capacity_tokens: int
    prefill_tokens_per_s: float
    decode_step_s: float
    prefill_chunk_tokens: int
    kv_bytes_per_token: int
    transfer_bytes_per_s: float
    transfer_setup_s: float
    transfer_rate_source: str
    def __init__(self, num_running_requests: _Optional[int] = ..., num_waiting_requests: _Optional[int] = ..., num_queued_prefill_tokens: _Optional[int] = ..., kv_used_tokens: _Optional[int] = ..., kv_capacity_tokens: _Optional[int] = ..., prefill_tokens_per_s: _Optional[float] = ..., decode_step_s: _Optional[float] = ..., prefill_chunk_tokens: _Optional[int] = ..., kv_bytes_per_token: _Optional[int] = ..., transfer_bytes_per_s: _Optional[float] = ..., transfer_setup_s: _Optional[float] = ..., transfer_rate_source: _Optional[str] = ...) -> None: ...

class WatchStatusRequest(_message.Message):
    __slots__ = ("min_interval_ms",)
    MIN_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    min_interval_ms: int
    def __init__(self, min_interval_ms: _Optional[int] = ...) -> None: ...

class FlushCacheRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FlushCacheResponse(_message.Message):
    __slots__ = ("num_flushed_tokens",)
    NUM_FLUSHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_flushed_tokens: int
    def __init__(self, num_flushed_tokens: _Optional[int] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("incarnation", "after_seq")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    incarnation: int
    after_seq: int
    def __init__(self, incarnation: _Optional[int] = ..., after_seq: _Optional[int] = ...) -> None: ...

class KVStored(_message.Message):
    __slots__ = ("has_parent", "parent_hash", "block_hashes")
    HAS_PARENT_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    has_parent: bool
    parent_hash: int
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, has_parent: _Optional[bool] = ..., parent_hash: _Optional[int] = ..., block_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class KVRemoved(_message.Message):
    __slots__ = ("block_hashes",)
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class KVCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("stored", "removed", "cleared")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    stored: KVStored
    removed: KVRemoved
    cleared: KVCleared
    def __init__(self, stored: _Optional[_Union[KVStored, _Mapping]] = ..., removed: _Optional[_Union[KVRemoved, _Mapping]] = ..., cleared: _Optional[_Union[KVCleared, _Mapping]] = ...) -> None: ...

class KVEventBatch(_message.Message):
    __slots__ = ("worker_id", "incarnation", "last_seq", "snapshot", "events")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    incarnation: int
    last_seq: int
    snapshot: bool
    events: _containers.RepeatedCompositeFieldContainer[KVEvent]
    def __init__(self, worker_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., last_seq: _Optional[int] = ..., snapshot: _Optional[bool] = ..., events: _Optional[_Iterable[_Union[KVEvent, _Mapping]]] = ...) -> None: ...
