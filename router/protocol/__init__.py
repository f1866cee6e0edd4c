"""OpenAI-compatible requests, responses and errors, as vLLM's server accepts and sends
them, and the request-validation rules the HTTP and gRPC APIs share.

- ``requests.py``: the request bodies (``CompletionRequest``, ``ChatCompletionRequest``)
  and ``to_sampling_params``;
- ``tokenize.py``: vLLM's ``/tokenize`` and ``/detokenize`` bodies (``TokenizeRequest``,
  ``DetokenizeRequest``);
- ``messages.py``: chat messages and tools, which requests carry and responses echo, and
  what else a chat template reads (``ChatTemplateInputs``);
- ``responses.py``: the answers, the stream's chunks and server-sent events;
- ``errors.py``: ``RequestError`` (naming its field as ``param``) and OpenAI's error body;
- ``validation.py``: the rules both APIs call (the model's length, ``fit_max_tokens``;
  a field's check naming it, ``check_field``; the engine's sampling checks) and the
  bounded field types.

Every field is bounded where it is declared (the limits are in ``router/limits.py``), so
no value reaches protobuf, the tokenizer or block hashing out of range (issue 12): integers
that travel as protobuf ``int32`` stay within ``INT32_MAX``; ``n`` is at most ``MAX_N``
and a request at most ``MAX_NUM_SEQUENCES`` sequences; ``stop`` at most
``MAX_STOP_STRINGS`` strings of ``MAX_STOP_STRING_CHARS`` characters; ``stop_token_ids``
at most ``MAX_STOP_TOKEN_IDS`` ids; strings hold no lone surrogates (JSON escapes such as
``"\\ud800"`` decode to them, and they have no UTF-8 form); floats are finite. Token ids
are checked against the vocabulary when the caller passes ``context={"vocab_size": ...}``
to ``model_validate``. Validation errors name the offending field: see
``validation_error_response``.

This module only re-exports the public names of those modules, so that
``from pdserve.router.protocol import X`` works; the modules import one another directly.
"""

from __future__ import annotations

from pdserve.router.protocol.errors import (
    INTERNAL_ERROR,
    ErrorInfo,
    ErrorResponse,
    RequestError,
    error_response,
    validation_error_response,
)
from pdserve.router.protocol.messages import (
    MAX_TOOL_CALLS,
    MAX_TOOLS,
    RESERVED_TEMPLATE_KWARGS,
    ChatMessage,
    ChatTemplateInputs,
    ChatTool,
    ChatToolCall,
    FunctionDefinition,
    NamedToolChoice,
    ToolCallFunction,
)
from pdserve.router.protocol.requests import (
    UNSUPPORTED_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
    JsonSchemaFormat,
    ResponseFormat,
    StreamOptions,
    StructuredOutputsParams,
    to_sampling_params,
)
from pdserve.router.protocol.responses import (
    SSE_DONE,
    ChatChoiceLogProbs,
    ChatCompletionChoice,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatLogprobEntry,
    ChatResponseMessage,
    ChatTopLogprob,
    CompletionChoice,
    CompletionLogProbs,
    CompletionResponse,
    CompletionStreamChoice,
    CompletionStreamResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FinishReason,
    ModelCard,
    ModelList,
    PromptLogprob,
    PromptTokensDetails,
    TokenizeResponse,
    UsageInfo,
    chat_stream_choice,
    chat_stream_chunk,
    completion_stream_choice,
    completion_stream_chunk,
    random_id,
    sse_event,
)
from pdserve.router.protocol.tokenize import DetokenizeRequest, TokenizeRequest
from pdserve.router.protocol.validation import (
    MAX_LOGPROBS,
    Int32,
    StrictInt,
    Text,
    TokenId,
    check_field,
    checked_sampling_params,
    fit_max_tokens,
)

__all__ = [
    "INTERNAL_ERROR",
    "MAX_LOGPROBS",
    "MAX_TOOLS",
    "MAX_TOOL_CALLS",
    "RESERVED_TEMPLATE_KWARGS",
    "SSE_DONE",
    "UNSUPPORTED_FIELDS",
    "ChatChoiceLogProbs",
    "ChatCompletionChoice",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatCompletionStreamChoice",
    "ChatCompletionStreamResponse",
    "ChatLogprobEntry",
    "ChatMessage",
    "ChatResponseMessage",
    "ChatTemplateInputs",
    "ChatTool",
    "ChatToolCall",
    "ChatTopLogprob",
    "CompletionChoice",
    "CompletionLogProbs",
    "CompletionRequest",
    "CompletionResponse",
    "CompletionStreamChoice",
    "CompletionStreamResponse",
    "DeltaFunctionCall",
    "DeltaMessage",
    "DeltaToolCall",
    "DetokenizeRequest",
    "ErrorInfo",
    "ErrorResponse",
    "FinishReason",
    "FunctionDefinition",
    "Int32",
    "JsonSchemaFormat",
    "ModelCard",
    "ModelList",
    "NamedToolChoice",
    "PromptLogprob",
    "PromptTokensDetails",
    "RequestError",
    "ResponseFormat",
    "StreamOptions",
    "StrictInt",
    "StructuredOutputsParams",
    "Text",
    "TokenId",
    "TokenizeRequest",
    "TokenizeResponse",
    "ToolCallFunction",
    "UsageInfo",
    "chat_stream_choice",
    "chat_stream_chunk",
    "check_field",
    "checked_sampling_params",
    "completion_stream_choice",
    "completion_stream_chunk",
    "error_response",
    "fit_max_tokens",
    "random_id",
    "sse_event",
    "to_sampling_params",
    "validation_error_response",
]
