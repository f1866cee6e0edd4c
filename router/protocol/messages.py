"""Chat messages and tools (OpenAI's shapes): ``ChatMessage``, the tool definitions a
chat request carries (``ChatTool``, ``NamedToolChoice``), the calls an assistant
message holds (``ChatToolCall``), and what else a chat template reads
(``ChatTemplateInputs``: vLLM's fields, shared by chat completions and ``/tokenize``)."""

from __future__ import annotations

import reprlib
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from pdserve.router.protocol.validation import Text, unknown_field

MAX_TOOLS = 128  # tools in one request
MAX_TOOL_CALLS = 128  # calls in one assistant message
MAX_DOCUMENTS = 256  # documents in one chat request
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "tokenize", "return_dict", "return_tensors", "padding", "truncation", "max_length",
    "chat_template", "tokenizer_kwargs", "return_assistant_tokens_mask"})


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class FunctionDefinition(_Strict):
    """A tool's function: OpenAI's name rule (1-64 of ``a-zA-Z0-9_-``), a description, and
    its ``parameters`` as a JSON schema object."""

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Strict):
    """One entry of ``tools``."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class _FunctionName(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")


class NamedToolChoice(_Strict):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``."""

    type: Literal["function"] = "function"
    function: _FunctionName


class ToolCallFunction(_Strict):
    """A call's function: its name and its arguments as JSON text (OpenAI's shape)."""

    name: Text
    arguments: Text


class ChatToolCall(_Strict):
    """One of an assistant message's ``tool_calls``."""

    id: Text
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    """One chat turn. List content (``[{"type": "text", "text": ...}]``) is joined with
    newlines into a string, vLLM's "string" content format; other part types are refused.
    An assistant turn may carry ``tool_calls`` (its ``content`` then may be null); a
    ``tool`` turn carries the result of the call ``tool_call_id``."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    name: Text | None = None
    tool_calls: list[ChatToolCall] | None = Field(None, max_length=MAX_TOOL_CALLS)
    tool_call_id: Text | None = None
    # NOTE: last, so that its check sees the fields above (validated in this order).
    content: Text | None = Field(None, validate_default=True)

    @model_validator(mode="before")
    @classmethod
    def _refuse_unknown_fields(cls, data: Any) -> Any:
        name = unknown_field(cls, data)
        if name is not None:
            why = ("function calling is not supported: use tools" if name == "function_call"
                   else "a message has role, content, name, tool_calls and tool_call_id")
            raise ValueError(f"field '{name}' is not supported ({why})")
        return data

    @field_validator("content", mode="before")
    @classmethod
    def _join_text_parts(cls, value: Any) -> Any:
        if not isinstance(value, list):
            return value
        texts = []
        for part in value:
            text = part.get("text") if isinstance(part, dict) else None
            if not isinstance(text, str) or part.get("type") != "text":
                raise ValueError(f"content parts must be {{'type': 'text', 'text': <string>}}, "
                                 f"got {part!r}"[:200])
            texts.append(text)
        return "\n".join(texts)

    @field_validator("content")
    @classmethod
    def _check_content(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None and not (info.data.get("role") == "assistant"
                                  and info.data.get("tool_calls")):
            raise ValueError("content is required (null only in an assistant message with "
                             "tool_calls)")
        return value

    @model_validator(mode="after")
    def _check_roles(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls: only an assistant message has tool calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("tool_call_id: a tool message needs the id of its call")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError("tool_call_id: only a tool message has a tool_call_id")
        for call in self.tool_calls or ():
            try:
                arguments = orjson.loads(call.function.arguments)
            except orjson.JSONDecodeError:
                arguments = None
            if not isinstance(arguments, dict):
                raise ValueError(  # noqa: TRY004 - pydantic reports ValueErrors as 400s
                    f"tool_calls: the arguments of call {call.id!r} must be a "
                    f"JSON object, got {reprlib.repr(call.function.arguments)}")
        return self

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates read it (transformers' shape): a call's
        arguments as a dict, as vLLM passes them."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {
                    "name": c.function.name, "arguments": orjson.loads(c.function.arguments)}}
                for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class ChatTemplateInputs(_Strict):
    """What a chat request passes its chat template beside the messages (vLLM's fields):
    ``add_generation_prompt``; ``continue_final_message`` (the reply goes on the last
    message); ``documents`` for templates that take them (``{"title", "text", ...}``);
    the request's own ``chat_template`` (rendered only with
    ``--trust-request-chat-template``); ``chat_template_kwargs`` (extra template
    variables, none of those the request sets itself); ``tools`` (distinct names)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    documents: list[dict[str, Text]] | None = Field(None, max_length=MAX_DOCUMENTS)
    chat_template: Text | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = Field(None, max_length=MAX_TOOLS)

    @field_validator("chat_template_kwargs")
    @classmethod
    def _check_template_kwargs(cls, value: Any) -> Any:
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(value or ()))
        if reserved:
            raise ValueError(f"{reserved[0]!r} is set by the request itself, not "
                             f"chat_template_kwargs")
        return value

    @field_validator("tools")
    @classmethod
    def _check_tool_names(cls, value: Any) -> Any:
        names = [tool.function.name for tool in value or ()]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise ValueError(f"two tools are named {dup!r}")
        return value
