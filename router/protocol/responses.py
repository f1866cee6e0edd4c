"""OpenAI-compatible response models, and the stream's chunks as dicts in their shape.

``/v1/completions`` and ``/v1/chat/completions`` answers (in full, or as server-sent
events: ``sse_event``, ``SSE_DONE``), ``/v1/models`` (``ModelList``, ``ModelCard``) and
vLLM's ``/tokenize`` answer (``TokenizeResponse``); OpenAI's field order throughout.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

import orjson
from pydantic import BaseModel, Field

from pdserve.router.protocol.messages import ChatToolCall


class PromptTokensDetails(BaseModel):
    """``cached_tokens``: prompt tokens served from a prefix cache."""

    cached_tokens: int = 0


class UsageInfo(BaseModel):
    """Token counts of one request (OpenAI's ``usage``)."""

    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> UsageInfo:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


FinishReason = Literal["stop", "length", "tool_calls"]


class _Response(BaseModel):
    """OpenAI's field order; subclasses narrow ``id``, ``object`` and ``choices``."""

    id: str
    object: str
    created: int = Field(default_factory=lambda: int(time.time()))  # Unix seconds
    model: str
    choices: list
    usage: UsageInfo | None = None


class _Choice(BaseModel):
    index: int
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # vLLM: the stop token id or string that matched


class CompletionLogProbs(BaseModel):
    """Completions-API logprobs: parallel lists over the generated tokens."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's record of one candidate for a prompt position: its log-probability (-inf
    written as -9999.0), its rank in the model's distribution (1 = most likely) and its
    text."""

    logprob: float
    rank: int
    decoded_token: str


# vLLM's prompt_logprobs: per prompt token None (the first: nothing predicts it) or the
# token's own record and its top alternatives', keyed by token id (as a JSON key string)
PromptLogprobs = list[dict[str, PromptLogprob] | None]


def _if_asked(default: Any = None) -> Any:
    """A field left out of the JSON while None: vLLM's ``return_token_ids`` fields."""
    return Field(default, exclude_if=lambda v: v is None)


class CompletionStreamChoice(_Choice):
    """In a stream, the text this chunk adds to one completion (and its logprobs); with
    ``return_token_ids`` (vLLM's), its tokens' ids and, in the choice's first chunk, the
    prompt's."""

    text: str
    logprobs: CompletionLogProbs | None = None
    token_ids: list[int] | None = _if_asked()
    prompt_token_ids: list[int] | None = _if_asked()


class CompletionChoice(CompletionStreamChoice):
    """One completion; vLLM's ``prompt_logprobs`` when asked for (not streamed)."""

    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(_Response):
    """``/v1/completions`` answer; a stream sends ``CompletionStreamResponse`` chunks."""

    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class CompletionStreamResponse(CompletionResponse):
    """One SSE chunk; the same shape as the full response (OpenAI streams it that way),
    less the choices' ``prompt_logprobs``."""

    choices: list[CompletionStreamChoice]


class ChatTopLogprob(BaseModel):
    """A candidate token: text, logprob and UTF-8 bytes."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobEntry(ChatTopLogprob):
    """A generated token with its top alternatives."""

    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatChoiceLogProbs(BaseModel):
    """Chat-API logprobs of a choice (or of a chunk's tokens)."""

    content: list[ChatLogprobEntry] | None = None


class ChatResponseMessage(BaseModel):
    """The assistant's message in a full chat answer; ``tool_calls`` when it called tools,
    ``reasoning`` (vLLM's) the reply's reasoning block under ``--reasoning-parser``."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning: str | None = _if_asked()
    tool_calls: list[ChatToolCall] = Field(default_factory=list)


class ChatCompletionChoice(_Choice):
    """One chat completion; its tokens' ids with ``return_token_ids`` (vLLM's)."""

    message: ChatResponseMessage
    logprobs: ChatChoiceLogProbs | None = None
    token_ids: list[int] | None = _if_asked()


class ChatCompletionResponse(_Response):
    """``/v1/chat/completions`` answer; the prompt's token ids with ``return_token_ids``."""

    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatCompletionChoice]
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = _if_asked()


class DeltaFunctionCall(BaseModel):
    """A streamed call's function: the name once, then pieces of the arguments."""

    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A piece of the call number ``index``; its first piece carries ``id`` and ``type``."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(BaseModel):
    """What a stream chunk adds: the role (first chunk), then content and tool calls."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    # Left out of a chunk without calls, as OpenAI leaves it out.
    tool_calls: list[DeltaToolCall] | None = Field(None, exclude_if=lambda v: v is None)


class ChatCompletionStreamChoice(_Choice):
    """One choice's part of a chat stream chunk (its tokens' ids with
    ``return_token_ids``)."""

    delta: DeltaMessage
    logprobs: ChatChoiceLogProbs | None = None
    token_ids: list[int] | None = _if_asked()


class ChatCompletionStreamResponse(_Response):
    """One SSE chunk of ``/v1/chat/completions`` with ``stream=true``; with
    ``return_token_ids`` the role chunks carry the prompt's token ids."""

    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatCompletionStreamChoice]
    prompt_token_ids: list[int] | None = _if_asked()


# NOTE: a stream sends a chunk per token, and building and dumping a model for each cost
# ~3 us of router CPU, taken from a CPU decode engine beside it. The stream sends dicts in
# the stream models' shape instead (their fields, in their order, written by orjson);
# tests/test_router_protocol.py checks each builder against its model.


def completion_stream_chunk(response_id: str, model: str, choices: list[dict],
                            usage: dict | None = None) -> dict:
    """A ``CompletionStreamResponse`` as a dict, ``created`` now; ``choices`` from
    ``completion_stream_choice``, ``usage`` a ``UsageInfo.model_dump()``."""
    return {"id": response_id, "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": usage}


def completion_stream_choice(index: int, text: str, finish_reason: str | None = None,
                             stop_reason: int | str | None = None,
                             logprobs: dict | None = None, token_ids: list[int] | None = None,
                             prompt_token_ids: list[int] | None = None) -> dict:
    """A stream chunk's ``CompletionChoice`` as a dict (``logprobs`` a
    ``CompletionLogProbs.model_dump()``; the token ids left out while None)."""
    choice = {"index": index, "finish_reason": finish_reason, "stop_reason": stop_reason,
              "text": text, "logprobs": logprobs}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    if prompt_token_ids is not None:
        choice["prompt_token_ids"] = prompt_token_ids
    return choice


def chat_stream_chunk(response_id: str, model: str, choices: list[dict],
                      usage: dict | None = None, prompt_token_ids: list[int] | None = None
                      ) -> dict:
    """A ``ChatCompletionStreamResponse`` as a dict, ``created`` now; ``choices`` from
    ``chat_stream_choice``."""
    chunk = {"id": response_id, "object": "chat.completion.chunk", "created": int(time.time()),
             "model": model, "choices": choices, "usage": usage}
    if prompt_token_ids is not None:
        chunk["prompt_token_ids"] = prompt_token_ids
    return chunk


def chat_stream_choice(index: int, content: str | None, role: str | None = None,
                       finish_reason: str | None = None, stop_reason: int | str | None = None,
                       logprobs: dict | None = None,
                       tool_calls: list[tuple[int, str, str, str]] = (),
                       token_ids: list[int] | None = None, reasoning: str | None = None
                       ) -> dict:
    """A ``ChatCompletionStreamChoice`` as a dict: its ``delta`` holds ``role`` and
    ``content`` (``logprobs`` a ``ChatChoiceLogProbs.model_dump()``), ``reasoning`` where
    given (vLLM's: what the chunk adds to the reasoning block), and ``tool_calls``
    given as ``(index, id, name, arguments)``, each sent as OpenAI streams a call: an entry
    with the id, the name and empty arguments, then one with the arguments."""
    delta: dict[str, Any] = {"role": role, "content": content}
    if reasoning is not None:
        delta["reasoning"] = reasoning
    if tool_calls:
        delta["tool_calls"] = [entry for i, call_id, name, arguments in tool_calls for entry in (
            {"index": i, "id": call_id, "type": "function",
             "function": {"name": name, "arguments": ""}},
            {"index": i, "function": {"arguments": arguments}})]
    choice = {"index": index, "finish_reason": finish_reason, "stop_reason": stop_reason,
              "delta": delta, "logprobs": logprobs}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def sse_event(body: dict) -> bytes:
    """``body`` as one server-sent event, ``data: {json}\\n\\n`` in UTF-8 (compact JSON, as
    ``model_dump_json`` writes it; a float that is not finite as ``null``)."""
    return b"data: " + orjson.dumps(body) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"  # OpenAI's last event of a stream


class ModelCard(BaseModel):
    """One served model in ``/v1/models``; ``max_model_len`` as vLLM adds it."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pdserve"
    root: str | None = None
    max_model_len: int | None = None


class TokenizeResponse(BaseModel):
    """``count`` tokens, ``tokens`` their ids, ``token_strs`` the tokens as the vocabulary
    writes them (when asked, else null); ``max_model_len`` as vLLM answers."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class ModelList(BaseModel):
    """``/v1/models`` answer."""

    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


def random_id(prefix: str) -> str:
    """``<prefix>-<32 hex digits>``, e.g. ``cmpl-...`` or ``chatcmpl-...``."""
    return f"{prefix}-{uuid.uuid4().hex}"
