from pdserve.proto import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "cache_salt", "decode_worker_id", "decode_kv_address", "priority")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: _common_pb2.SamplingParams
    cache_salt: str
    decode_worker_id: str
    decode_kv_address: str
    priority: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., decode_worker_id: _Optional[str] = ..., decode_kv_address: _Optional[str] = ..., priority: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "first_logprob", "num_cached_tokens", "finish_reason", "stop_reason", "kv_handle", "prompt_logprobs")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    first_logprob: _common_pb2.TokenLogprob
    num_cached_tokens: int
    finish_reason: str
    stop_reason: int
    kv_handle: _common_pb2.KVHandle
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, first_token_id: _Optional[int] = ..., first_logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ..., num_cached_tokens: _Optional[int] = ..., finish_reason: _Optional[str] = ..., stop_reason: _Optional[int] = ..., kv_handle: _Optional[_Union[_common_pb2.KVHandle, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class SendKVRequest(_message.Message):
    __slots__ = ("request_id", "decode_worker_id", "decode_kv_address", "block_indices", "timeout_s", "kv_ticket")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_INDICES_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    KV_TICKET_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    decode_worker_id: str
    decode_kv_address: str
    block_indices: _containers.RepeatedScalarFieldContainer[int]
    timeout_s: float
    kv_ticket: str
    def __init__(self, request_id: _Optional[str] = ..., decode_worker_id: _Optional[str] = ..., decode_kv_address: _Optional[str] = ..., block_indices: _Optional[_Iterable[int]] = ..., timeout_s: _Optional[float] = ..., kv_ticket: _Optional[str] = ...) -> None: ...

class SendKVResponse(_message.Message):
    __slots__ = ("num_blocks", "num_bytes", "seconds")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    num_bytes: int
    seconds: float
    def __init__(self, num_blocks: _Optional[int] = ..., num_bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class GrantKVRequest(_message.Message):
    __slots__ = ("request_id", "decode_worker_id", "decode_kv_address")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    decode_worker_id: str
    decode_kv_address: str
    def __init__(self, request_id: _Optional[str] = ..., decode_worker_id: _Optional[str] = ..., decode_kv_address: _Optional[str] = ...) -> None: ...

class GrantKVResponse(_message.Message):
    __slots__ = ("granted",)
    GRANTED_FIELD_NUMBER: _ClassVar[int]
    granted: bool
    def __init__(self, granted: bool = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: bool = ...) -> None: ...
