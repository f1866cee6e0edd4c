"""OpenAI-compatible request, response and error models, as vLLM's server accepts them.

Follows the OpenAI API reference (``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``, the error object) and vLLM's extensions (``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
``skip_special_tokens``, ``include_stop_str_in_output``, ``cache_salt``), and structured
output: OpenAI's ``response_format``, vLLM's ``structured_outputs`` and ``guided_json`` /
``guided_regex`` / ``guided_choice`` / ``guided_grammar`` (one constraint per request,
parsed with xgrammar at validation, ``engine/structured_output.py``). Unknown request
fields are kept in ``model_extra`` (vLLM logs and ignores them). Validation errors name the
offending field: see ``validation_error_response``. Stop strings are not engine parameters:
the router applies them (``router/detokenizer.py``).

Every field is bounded where it is declared (the limits are in ``router/limits.py``), so
no value reaches protobuf, the tokenizer or block hashing out of range (issue 12): integers
that travel as protobuf ``int32`` stay within ``INT32_MAX``; ``n`` is at most ``MAX_N``
and a request at most ``MAX_NUM_SEQUENCES`` sequences; ``stop`` at most
``MAX_STOP_STRINGS`` strings of ``MAX_STOP_STRING_CHARS`` characters; ``stop_token_ids``
at most ``MAX_STOP_TOKEN_IDS`` ids; strings hold no lone surrogates (JSON escapes such as
``"\\ud800"`` decode to them, and they have no UTF-8 form); floats are finite. Token ids
are checked against the vocabulary when the caller passes ``context={"vocab_size": ...}``
to ``model_validate``.
"""

from __future__ import annotations

import reprlib
import time
import uuid
from collections.abc import Sequence
from typing import Annotated, Any, Literal

import orjson
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from pdserve.engine.generation_config import GenerationDefaults
from pdserve.engine.sampling_params import LOGIT_BIAS_LIMIT, MAX_LOGIT_BIAS_ENTRIES, SamplingParams
from pdserve.engine.structured_output import (
    StructuredOutputSpec,
    check_spec,
    json_schema_spec,
)
from pdserve.router.limits import (
    INT32_MAX,
    MAX_N,
    MAX_NUM_SEQUENCES,
    MAX_STOP_TOKEN_IDS,
    SEED_LIMIT,
    check_stop_strings,
    check_text,
    check_token_id,
)

MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit; the engine's too
INTERNAL_ERROR = "internal error; the server has logged it"  # all a client learns of a bug
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                404: "not_found_error", 413: "invalid_request_error", 429: "rate_limit_error",
                500: "internal_server_error", 503: "service_unavailable"}


def _vocab_size(info: ValidationInfo) -> int | None:
    return info.context.get("vocab_size") if isinstance(info.context, dict) else None


def _token_id_in_vocab(value: int, info: ValidationInfo) -> int:
    return check_token_id(value, _vocab_size(info))


StrictInt = Annotated[int, Field(strict=True)]
Int32 = Annotated[int, Field(strict=True, le=INT32_MAX)]
TokenId = Annotated[int, Field(strict=True, ge=0, le=INT32_MAX),
                    AfterValidator(_token_id_in_vocab)]
Text = Annotated[str, AfterValidator(check_text)]  # no lone surrogates


class RequestError(Exception):
    """A request the server refuses: ``status`` (HTTP code), ``message``, offending ``param``."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status


class StreamOptions(BaseModel):
    """``include_usage``: end the stream with a chunk holding only ``usage``."""

    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """OpenAI's ``response_format.json_schema``: the output is JSON valid against
    ``schema`` (always enforced, whatever ``strict`` says)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: Text = Field(max_length=256)
    description: Text | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object`` (any JSON
    object) or ``json_schema``."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(BaseModel):
    """vLLM's ``structured_outputs``: one of ``json`` (a JSON schema), ``regex``,
    ``choice``, ``grammar`` (EBNF, xgrammar's dialect), ``json_object: true``. vLLM's other
    keys (``whitespace_pattern``, ``structural_tag``, ...) are refused."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_: dict[str, Any] | bool | str | None = Field(None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: bool | None = None


# OpenAI and vLLM request fields pdserve does not implement yet, and why a request with
# one is refused rather than served as if it were absent.
UNSUPPORTED_FIELDS = {
    "functions": "function calling is not supported",
    "function_call": "function calling is not supported",
    "guided_decoding_backend": "pdserve has one structured output backend (xgrammar)",
    "guided_whitespace_pattern": "JSON is written without free whitespace",
    "suffix": "suffix (insertion) is not supported",
    "prompt_logprobs": "prompt_logprobs is not supported",
}


def _unknown_field(model: type[BaseModel], data: Any) -> str | None:
    """The first key of a request body ``data`` that ``model`` does not declare."""
    if isinstance(data, dict):
        return next((name for name in data if name not in model.model_fields), None)
    return None


class _SamplingFields(BaseModel):
    """Fields shared by completion and chat requests (OpenAI's, then vLLM's extras).

    A field that is none of these is refused with a 400 naming it (``RequestError``),
    never accepted and ignored: its effect would silently be missing from the answer.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _refuse_unknown_fields(cls, data: Any) -> Any:
        name = _unknown_field(cls, data)
        if name is not None:
            why = UNSUPPORTED_FIELDS.get(name, "pdserve does not implement it")
            raise RequestError(f"Unsupported field '{name}': {why}", name)
        return data

    model: Text | None = None
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: StrictInt | None = Field(None, ge=0, lt=SEED_LIMIT)  # choice i: choice_seed(seed, i)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    user: Text | None = None  # accepted and ignored, as vLLM does
    top_k: Int32 | None = Field(None, ge=-1)  # -1 and 0: off
    # NOTE: None (unset) takes the model's generation_config.json default, then vLLM's
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    min_tokens: Int32 = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=MAX_STOP_TOKEN_IDS)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: Text | None = None
    # OpenAI's: token id (a string of digits, as JSON keys are) -> bias in [-100, 100]
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS_ENTRIES)
    # Structured output: OpenAI's response_format, vLLM's structured_outputs and its older
    # guided_* fields; at most one constraint (see structured_output_spec)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None

    _structured_output: StructuredOutputSpec | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _check_structured_output(self) -> Any:
        """Build and check the structured output spec once (``structured_output_spec``).

        Raises:
            RequestError: two or more constraints (naming them all), a ``json_schema``
                without its schema, or a constraint that is too large or does not
                compile (naming its field, e.g. ``response_format.json_schema.schema``).
        """
        given = self._structured_output_fields()
        if len(given) > 1:
            names = ", ".join(name for name, _ in given)
            raise RequestError(f"Give at most one structured output constraint; this "
                               f"request has {len(given)}: {names}", given[1][0])
        if given:
            name, build = given[0]
            try:
                self._structured_output = build()
                check_spec(self._structured_output)
            except ValueError as exc:
                message = str(exc).removeprefix("structured_output: ")
                raise RequestError(f"Invalid value for '{name}': {message}", name) from exc
        return self

    def structured_output_spec(self) -> StructuredOutputSpec | None:
        """The request's one structured output constraint as the engine's spec (checked
        with xgrammar's parser, ``check_spec``, when the request was validated), or None."""
        return self._structured_output

    def _structured_output_fields(self) -> list[tuple[str, Any]]:
        """(field name, spec builder) of each constraint the request sets."""
        given: list[tuple[str, Any]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            given.append(("response_format", lambda: StructuredOutputSpec("json_object")))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise RequestError("response_format of type json_schema needs "
                                   "json_schema.schema", "response_format.json_schema")
            given.append(("response_format.json_schema.schema",
                          lambda: json_schema_spec(rf.json_schema.schema_)))
        so = self.structured_outputs
        if so is not None:
            given += _constraints("structured_outputs.", so.json_, so.regex, so.choice,
                                  so.grammar, so.json_object)
        given += _constraints("guided_", self.guided_json, self.guided_regex,
                              self.guided_choice, self.guided_grammar, None)
        return given

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None:
            return None
        for key, bias in value.items():
            if not key.isdigit():
                raise ValueError(f"keys must be token ids (digits), got {key!r}"[:120])
            check_token_id(int(key), _vocab_size(info))
            if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                raise ValueError(f"bias {bias} of token {key} must be in [-100, 100]")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop(cls, value: Any) -> Any:
        if value is None:
            return None
        strings = [value] if isinstance(value, str) else value
        if not isinstance(strings, list) or not all(isinstance(s, str) for s in strings):
            raise ValueError("must be a string or a list of strings")
        check_stop_strings(strings)
        return value

    @field_validator("stream_options")
    @classmethod
    def _check_stream_options(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options can only be set when stream=True")
        return value

    def stop_strings(self) -> list[str]:
        """The stop strings as a list (empty when none were given)."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk (``stream_options.include_usage``)."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


def _constraints(prefix: str, json_schema: Any, regex: str | None, choice: list[str] | None,
                 grammar: str | None, json_object: bool | None) -> list[tuple[str, Any]]:
    """The constraints of vLLM's ``structured_outputs`` (``prefix`` "structured_outputs.")
    or of its ``guided_*`` fields (``prefix`` "guided_"), as (field name, spec builder)."""
    given = []
    if json_schema is not None:
        given.append((prefix + "json", lambda: json_schema_spec(json_schema)))
    if regex is not None:
        given.append((prefix + "regex", lambda: StructuredOutputSpec("regex", regex)))
    if choice is not None:
        given.append((prefix + "choice", lambda: StructuredOutputSpec("choice", tuple(choice))))
    if grammar is not None:
        given.append((prefix + "grammar", lambda: StructuredOutputSpec("grammar", grammar)))
    if json_object:
        given.append((prefix + "json_object", lambda: StructuredOutputSpec("json_object")))
    return given


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions`` body. ``prompt`` is text, texts, token ids or lists of them."""

    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: Int32 | None = Field(16, ge=1)  # OpenAI's and vLLM's default; null = rest
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: StrictInt | None = Field(None, ge=1)  # only as many as n: no extra candidates

    @field_validator("best_of")
    @classmethod
    def _check_best_of(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None and value != info.data.get("n", 1):
            raise ValueError("best_of other than n is not supported (no extra candidates "
                             "are generated and ranked)")
        return value

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, value: Any, info: ValidationInfo) -> Any:
        """Token ids must be in the vocabulary (``check_token_id``), strings valid Unicode."""
        if isinstance(value, str):
            return check_text(value)
        if not isinstance(value, list) or not value:
            raise ValueError("prompt must be a string or a non-empty list")
        if all(isinstance(p, str) for p in value):
            for p in value:
                check_text(p)
            return value
        lists = [value] if _is_token_ids(value) else value
        if all(isinstance(p, list) and p and _is_token_ids(p) for p in lists):
            for p in lists:
                for t in p:
                    check_token_id(t, _vocab_size(info))
            return value
        raise ValueError("prompt must be a string, a list of strings, a list of token ids "
                         "(non-negative integers) or a list of non-empty token-id lists")

    @model_validator(mode="after")
    def _check_num_sequences(self) -> CompletionRequest:
        """Raises ``RequestError`` (param ``n``; pydantic cannot name a field from a model
        validator) when prompts x ``n`` exceeds ``MAX_NUM_SEQUENCES``."""
        num_prompts = len(self.prompts())
        if num_prompts * self.n > MAX_NUM_SEQUENCES:
            raise RequestError(
                f"Invalid value for 'n': {num_prompts} prompts x n={self.n} is "
                f"{num_prompts * self.n} sequences; at most {MAX_NUM_SEQUENCES} per request",
                "n")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of prompts, each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


def _is_token_ids(values: list) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in values)


MAX_TOOLS = 128  # tools in one request
MAX_TOOL_CALLS = 128  # calls in one assistant message
# Names the chat template is called with; chat_template_kwargs may not set them.
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
        name = _unknown_field(cls, data)
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


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions`` body. ``max_completion_tokens`` wins over the
    deprecated ``max_tokens``; ``top_logprobs`` needs ``logprobs=True``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int32 | None = Field(None, ge=1)
    max_completion_tokens: Int32 | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

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

    @model_validator(mode="after")
    def _check_tool_choice(self) -> ChatCompletionRequest:
        choice = self.tool_choice
        if choice not in (None, "none") and not self.tools:
            raise RequestError("tool_choice needs tools", "tool_choice")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {
                t.function.name for t in self.tools or ()}:
            raise RequestError(f"tool_choice names the function {choice.function.name!r}, "
                               f"which is not among the tools", "tool_choice")
        return self

    def effective_tool_choice(self) -> str | NamedToolChoice:
        """``tool_choice``, defaulted as OpenAI does: ``auto`` with tools, else ``none``."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    @field_validator("top_logprobs")
    @classmethod
    def _check_top_logprobs(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs=True")
        return value


# ---- responses ------------------------------------------------------------------------


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


class CompletionChoice(_Choice):
    """One completion (or, in a stream, the text added to it by this chunk)."""

    text: str
    logprobs: CompletionLogProbs | None = None


class CompletionResponse(_Response):
    """``/v1/completions`` answer; a stream sends ``CompletionStreamResponse`` chunks."""

    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class CompletionStreamResponse(CompletionResponse):
    """One SSE chunk; the same shape as the full response (OpenAI streams it that way)."""


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
    """The assistant's message in a full chat answer; ``tool_calls`` when it called tools."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ChatToolCall] = Field(default_factory=list)


class ChatCompletionChoice(_Choice):
    """One chat completion."""

    message: ChatResponseMessage
    logprobs: ChatChoiceLogProbs | None = None


class ChatCompletionResponse(_Response):
    """``/v1/chat/completions`` answer."""

    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatCompletionChoice]


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
    """One choice's part of a chat stream chunk."""

    delta: DeltaMessage
    logprobs: ChatChoiceLogProbs | None = None


class ChatCompletionStreamResponse(_Response):
    """One SSE chunk of ``/v1/chat/completions`` with ``stream=true``."""

    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatCompletionStreamChoice]


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
                             logprobs: dict | None = None) -> dict:
    """A stream chunk's ``CompletionChoice`` as a dict (``logprobs`` a
    ``CompletionLogProbs.model_dump()``)."""
    return {"index": index, "finish_reason": finish_reason, "stop_reason": stop_reason,
            "text": text, "logprobs": logprobs}


def chat_stream_chunk(response_id: str, model: str, choices: list[dict],
                      usage: dict | None = None) -> dict:
    """A ``ChatCompletionStreamResponse`` as a dict, ``created`` now; ``choices`` from
    ``chat_stream_choice``."""
    return {"id": response_id, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model, "choices": choices, "usage": usage}


def chat_stream_choice(index: int, content: str | None, role: str | None = None,
                       finish_reason: str | None = None, stop_reason: int | str | None = None,
                       logprobs: dict | None = None,
                       tool_calls: list[tuple[int, str, str, str]] = ()) -> dict:
    """A ``ChatCompletionStreamChoice`` as a dict: its ``delta`` holds ``role`` and
    ``content`` (``logprobs`` a ``ChatChoiceLogProbs.model_dump()``), and ``tool_calls``
    given as ``(index, id, name, arguments)``, each sent as OpenAI streams a call: an entry
    with the id, the name and empty arguments, then one with the arguments."""
    delta: dict[str, Any] = {"role": role, "content": content}
    if tool_calls:
        delta["tool_calls"] = [entry for i, call_id, name, arguments in tool_calls for entry in (
            {"index": i, "id": call_id, "type": "function",
             "function": {"name": name, "arguments": ""}},
            {"index": i, "function": {"arguments": arguments}})]
    return {"index": index, "finish_reason": finish_reason, "stop_reason": stop_reason,
            "delta": delta, "logprobs": logprobs}


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


class TokenizeRequest(BaseModel):
    """vLLM's ``POST /tokenize``: a completion ``prompt``, or chat ``messages`` through the
    chat template (one of the two)."""

    model_config = ConfigDict(extra="forbid")

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise RequestError("give exactly one of 'prompt' and 'messages'", "prompt")
        return self


class TokenizeResponse(BaseModel):
    """``count`` tokens, ``tokens`` their ids; ``max_model_len`` as vLLM answers."""

    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(BaseModel):
    """vLLM's ``POST /detokenize``: token ids in the vocabulary."""

    model_config = ConfigDict(extra="forbid")

    model: Text | None = None
    tokens: list[TokenId] = Field(max_length=1 << 20)

    @field_validator("tokens")
    @classmethod
    def _in_vocabulary(cls, value: list[int], info: ValidationInfo) -> list[int]:
        for t in value:
            check_token_id(t, _vocab_size(info))
        return value


class ModelList(BaseModel):
    """``/v1/models`` answer."""

    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class ErrorInfo(BaseModel):
    """``message``, ``type`` (e.g. ``invalid_request_error``), ``param``, ``code``."""

    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


def random_id(prefix: str) -> str:
    """``<prefix>-<32 hex digits>``, e.g. ``cmpl-...`` or ``chatcmpl-...``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def error_response(status: int, message: str, param: str | None = None,
                   type: str | None = None, code: int | str | None = None) -> ErrorResponse:
    """An ``ErrorResponse``; ``type`` defaults from the HTTP ``status`` (400 ->
    ``invalid_request_error``) and ``code`` to the status, as vLLM sends it (OpenAI's own
    codes, such as ``invalid_api_key``, where one fits)."""
    err_type = type or _ERROR_TYPES.get(status, "server_error" if status >= 500 else
                                        "invalid_request_error")
    return ErrorResponse(error=ErrorInfo(message=message, type=err_type, param=param,
                                         code=status if code is None else code))


def validation_error_response(exc: ValidationError | Sequence[dict]) -> ErrorResponse:
    """A 400 ``ErrorResponse`` for a pydantic ``ValidationError`` (or FastAPI's
    ``RequestValidationError.errors()``), naming the first offending field as ``param``,
    e.g. ``max_tokens`` or ``messages[0].role``."""
    errors = exc.errors() if isinstance(exc, ValidationError) else list(exc)
    first = errors[0]
    param = _param_from_loc(first.get("loc", ()))
    msg = first.get("msg", "invalid value").removeprefix("Value error, ")
    shown = _SHORT_REPR.repr(first.get("input"))
    if len(shown) > 60:
        shown = shown[:57] + "..."
    where = f"'{param}'" if param else "the request body"
    return error_response(400, f"Invalid value for {where}: {msg} (got {shown})", param)


_SHORT_REPR = reprlib.Repr()  # bounded work even for a 16 MiB input
_SHORT_REPR.maxstring = _SHORT_REPR.maxother = 60


def _param_from_loc(loc: Sequence[str | int]) -> str | None:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif item == "body" and not parts:
            continue
        elif "[" in item or item in ("str", "int", "float", "bool") or "-" in item:
            continue  # pydantic's union member tags, not field names
        else:
            parts.append(("." if parts else "") + item)
    return "".join(parts) or None


def to_sampling_params(request: CompletionRequest | ChatCompletionRequest, *,
                       max_model_len: int, prompt_len: int,
                       defaults: GenerationDefaults | None = None) -> SamplingParams:
    """The engine's ``SamplingParams`` for ``request`` whose prompt has ``prompt_len``
    tokens. ``max_tokens`` defaults to ``max_model_len - prompt_len`` (vLLM's default);
    ``temperature``, ``top_p``, ``top_k``, ``min_p`` and ``repetition_penalty`` left unset
    take ``defaults`` (the model's generation config), else vLLM's defaults.

    Raises:
        RequestError: the prompt, or prompt plus ``max_tokens``, exceeds ``max_model_len``
            (vLLM's wording, naming both numbers), or the engine refuses a value.
    """
    is_chat = isinstance(request, ChatCompletionRequest)
    prompt_param = "messages" if is_chat else "prompt"
    if prompt_len >= max_model_len:
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"request has {prompt_len} input tokens. Please reduce the length of the input "
            f"{prompt_param}.", prompt_param)
    max_tokens = request.max_tokens
    if is_chat and request.max_completion_tokens is not None:
        max_tokens = request.max_completion_tokens
    if max_tokens is None:
        max_tokens = max_model_len - prompt_len
    elif prompt_len + max_tokens > max_model_len:
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the messages, "
            f"{max_tokens} in the completion). Please reduce the length of the messages or "
            f"completion.", "max_completion_tokens" if is_chat and
            request.max_completion_tokens is not None else "max_tokens")
    if is_chat:
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
    else:
        logprobs = request.logprobs
        if request.echo and logprobs is not None:
            raise RequestError("echo with logprobs is not supported (no prompt logprobs)",
                               "echo")
    try:
        model_defaults = (defaults or GenerationDefaults()).sampling_kwargs(
            temperature=request.temperature, top_p=request.top_p, top_k=request.top_k,
            min_p=request.min_p, repetition_penalty=request.repetition_penalty)
        return SamplingParams(
            n=request.n, **model_defaults, presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty, seed=request.seed,
            max_tokens=max_tokens, min_tokens=request.min_tokens,
            stop_token_ids=list(request.stop_token_ids), ignore_eos=request.ignore_eos,
            logprobs=logprobs, logit_bias={int(k): v for k, v in
                                           (request.logit_bias or {}).items()} or None,
            structured_output=request.structured_output_spec())
    except ValueError as exc:  # SamplingParams names the field first: "min_tokens=9 is ..."
        raise RequestError(str(exc), str(exc).split("=", 1)[0]) from exc
