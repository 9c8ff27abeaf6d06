from prefixgate.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class Messages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatRequest(_message.Message):
    __slots__ = ("messages", "prompt_token_ids", "packed_prompt_token_ids", "conversation_id", "namespace", "sampling", "model", "no_resume")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PACKED_PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NO_RESUME_FIELD_NUMBER: _ClassVar[int]
    messages: Messages
    prompt_token_ids: TokenIds
    packed_prompt_token_ids: bytes
    conversation_id: str
    namespace: str
    sampling: _common_pb2.SamplingParams
    model: str
    no_resume: bool
    def __init__(self, messages: _Optional[_Union[Messages, _Mapping]] = ..., prompt_token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., packed_prompt_token_ids: _Optional[bytes] = ..., conversation_id: _Optional[str] = ..., namespace: _Optional[str] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., model: _Optional[str] = ..., no_resume: _Optional[bool] = ...) -> None: ...

class ChatDelta(_message.Message):
    __slots__ = ("text", "token_ids", "index", "logprobs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    index: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., index: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class ChatFinal(_message.Message):
    __slots__ = ("usage", "finish_reason", "worker_id", "timings", "sample_finish_reasons", "predicted_cached_tokens", "best_predicted_cached_tokens", "predicted_transferred_tokens", "num_resumes")
    USAGE_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FINISH_REASONS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BEST_PREDICTED_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_TRANSFERRED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_RESUMES_FIELD_NUMBER: _ClassVar[int]
    usage: _common_pb2.Usage
    finish_reason: _common_pb2.FinishReason
    worker_id: str
    timings: _common_pb2.Timings
    sample_finish_reasons: _containers.RepeatedScalarFieldContainer[_common_pb2.FinishReason]
    predicted_cached_tokens: int
    best_predicted_cached_tokens: int
    predicted_transferred_tokens: int
    num_resumes: int
    def __init__(self, usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., worker_id: _Optional[str] = ..., timings: _Optional[_Union[_common_pb2.Timings, _Mapping]] = ..., sample_finish_reasons: _Optional[_Iterable[_Union[_common_pb2.FinishReason, str]]] = ..., predicted_cached_tokens: _Optional[int] = ..., best_predicted_cached_tokens: _Optional[int] = ..., predicted_transferred_tokens: _Optional[int] = ..., num_resumes: _Optional[int] = ...) -> None: ...

class ChatEvent(_message.Message):
    __slots__ = ("delta", "final")
    DELTA_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    delta: ChatDelta
    final: ChatFinal
    def __init__(self, delta: _Optional[_Union[ChatDelta, _Mapping]] = ..., final: _Optional[_Union[ChatFinal, _Mapping]] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "fingerprint", "max_context_tokens", "max_completion_tokens", "block_size", "num_workers")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    fingerprint: str
    max_context_tokens: int
    max_completion_tokens: int
    block_size: int
    num_workers: int
    def __init__(self, name: _Optional[str] = ..., fingerprint: _Optional[str] = ..., max_context_tokens: _Optional[int] = ..., max_completion_tokens: _Optional[int] = ..., block_size: _Optional[int] = ..., num_workers: _Optional[int] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...
