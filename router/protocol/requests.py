"""OpenAI-compatible request models, as vLLM's server accepts them.

Follows the OpenAI API reference (``/v1/completions``, ``/v1/chat/completions``) and
vLLM's extensions (``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``,
``ignore_eos``, ``stop_token_ids``, ``skip_special_tokens``,
``include_stop_str_in_output``, ``cache_salt``, ``/tokenize``, ``/detokenize``), and
structured output: OpenAI's ``response_format``, vLLM's ``structured_outputs`` and
``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` (one
constraint per request, parsed with xgrammar at validation,
``engine/structured_output.py``). A field none of these declare is refused, naming it.
Stop strings are not engine parameters: the router applies them
(``router/detokenizer.py``). ``to_sampling_params`` turns a request into the engine's
``SamplingParams`` with the rules the gRPC API shares (``validation.py``).
"""

from __future__ import annotations

from typing import Any, Literal

import orjson
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from pdserve.engine.generation_config import GenerationDefaults
from pdserve.engine.sampling_params import (
    LOGIT_BIAS_LIMIT,
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS_ENTRIES,
    SamplingParams,
)
from pdserve.engine.structured_output import (
    StructuredOutputSpec,
    check_spec,
    json_schema_spec,
)
from pdserve.router.limits import (
    MAX_N,
    MAX_NUM_SEQUENCES,
    MAX_STOP_TOKEN_IDS,
    SEED_LIMIT,
    check_stop_strings,
    check_text,
    check_token_id,
)
from pdserve.router.protocol.errors import RequestError
from pdserve.router.protocol.messages import ChatMessage, ChatTemplateInputs, NamedToolChoice
from pdserve.router.protocol.validation import (
    MAX_LOGPROBS,
    Int32,
    StrictInt,
    Text,
    TokenId,
    check_field,
    check_prompt_logprobs,
    checked_sampling_params,
    fit_max_tokens,
    unknown_field,
    vocab_size,
)


class StreamOptions(BaseModel):
    """``include_usage``: end the stream with a chunk holding only ``usage``;
    ``continuous_usage_stats`` (vLLM's, with ``include_usage``): every chunk also carries
    the usage so far."""

    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    continuous_usage_stats: bool = False


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


REQUEST_ID_PATTERN = r"^[!-~]{1,256}$"  # a client's request id: 1-256 visible ASCII


# OpenAI and vLLM request fields pdserve does not implement yet, and why a request with
# one is refused rather than served as if it were absent.
UNSUPPORTED_FIELDS = {
    "functions": "function calling is not supported",
    "function_call": "function calling is not supported",
    "guided_decoding_backend": "pdserve has one structured output backend (xgrammar)",
    "guided_whitespace_pattern": "JSON is written without free whitespace",
    "suffix": "suffix (insertion) is not supported",
}


# vLLM request fields served at their default value only (what clients that send every
# field send), and why another value is refused
DEFAULT_ONLY_FIELDS = {
    "use_beam_search": (False, "beam search is not supported"),
    "length_penalty": (1.0, "it weighs beam search's candidates (not supported)"),
    "spaces_between_special_tokens": (True, "special tokens are joined as the tokenizer does"),
}


def _same(value: Any, default: Any) -> bool:
    """``value`` is ``default`` as JSON gives it (``1`` for ``1.0``, never ``true`` for 1)."""
    return type(value) is type(default) and value == default or (
        isinstance(default, float) and type(value) is int and value == default)


class _SamplingFields(BaseModel):
    """Fields shared by completion and chat requests (OpenAI's, then vLLM's extras).

    A field that is none of these is refused with a 400 naming it (``RequestError``),
    never accepted and ignored: its effect would silently be missing from the answer.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _refuse_unknown_fields(cls, data: Any) -> Any:
        while (name := unknown_field(cls, data)) is not None:
            if name in DEFAULT_ONLY_FIELDS and _same(data[name], DEFAULT_ONLY_FIELDS[name][0]):
                data = {k: v for k, v in data.items() if k != name}  # its default: served
                continue
            if name in DEFAULT_ONLY_FIELDS:
                default, why = DEFAULT_ONLY_FIELDS[name]
                raise RequestError(f"Unsupported value for '{name}': only its default "
                                   f"{orjson.dumps(default).decode()} is served ({why})", name)
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
    # vLLM's: the top prompt_logprobs alternatives of each prompt token (not streamed)
    prompt_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # vLLM's: keep the prompt's last k tokens (-1: the last max_model_len); see truncate()
    truncate_prompt_tokens: Int32 | None = Field(None, ge=-1)
    # vLLM's: logprobs name tokens "token_id:<id>", not by their (maybe partial) text
    return_tokens_as_token_ids: bool = False
    # vLLM's: the answer carries the prompt's and the generated tokens' ids beside the text
    return_token_ids: bool = False
    # vLLM's: the answer's id is cmpl- / chatcmpl-<request_id> (an X-Request-Id header wins,
    # as in vLLM); the workers' ids stay the router's own, so clients' ids never collide
    request_id: str | None = Field(None, pattern=REQUEST_ID_PATTERN)
    # vLLM's: only these tokens may be generated
    allowed_token_ids: list[TokenId] | None = Field(None, min_length=1,
                                                    max_length=MAX_ALLOWED_TOKEN_IDS)
    # vLLM's: words the output must not contain (engine.tokenizer.bad_word_sequences)
    bad_words: list[Text] | None = Field(None, max_length=MAX_BAD_WORDS // 2)
    # vLLM's: lower is served first; other than 0 only under --scheduling-policy priority
    # (ModelService.check_priority)
    priority: Int32 = 0
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

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _check_truncation(cls, value: Any) -> Any:
        if value == 0:
            raise ValueError("truncate_prompt_tokens must be -1 (the model's context) or at "
                             "least 1 (0 would leave no prompt)")
        return value

    def truncate(self, prompt: list[int], max_model_len: int) -> list[int]:
        """``prompt`` cut to its last ``truncate_prompt_tokens`` tokens (vLLM's left
        truncation; -1 keeps the last ``max_model_len``), as it is when unset or shorter."""
        keep = self.truncate_prompt_tokens
        if keep is None:
            return prompt
        keep = max_model_len if keep == -1 else keep
        return prompt[-keep:] if len(prompt) > keep else prompt

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
            self._structured_output = check_field(name, _built_and_checked, build,
                                                  drop_prefix="structured_output: ")
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
            check_token_id(int(key), vocab_size(info))
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

    def continuous_usage(self) -> bool:
        """Whether every stream chunk carries the usage so far (vLLM's
        ``stream_options.continuous_usage_stats``, which needs ``include_usage``)."""
        return self.include_usage() and self.stream_options.continuous_usage_stats


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
    # OpenAI's and vLLM's default; null = the rest; 0 only with echo (the prompt alone)
    max_tokens: Int32 | None = Field(16, ge=0)
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: StrictInt | None = Field(None, ge=1)  # only as many as n: no extra candidates
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS (etc.) on text prompts

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
                    check_token_id(t, vocab_size(info))
            return value
        raise ValueError("prompt must be a string, a list of strings, a list of token ids "
                         "(non-negative integers) or a list of non-empty token-id lists")

    @model_validator(mode="after")
    def _check_zero_max_tokens(self) -> CompletionRequest:
        """``max_tokens: 0`` answers with the echoed prompt alone (OpenAI's legacy API and
        vLLM do so, for scoring a text by its prompt logprobs); without ``echo`` there is
        nothing to answer with."""
        if self.max_tokens == 0 and not self.echo:
            raise RequestError("Invalid value for 'max_tokens': 0 needs echo (the prompt "
                               "alone); otherwise it must be at least 1", "max_tokens")
        return self

    def prompt_only(self) -> bool:
        """The answer is the echoed prompt alone (``max_tokens: 0`` with ``echo``): the
        engine generates one token, which the answer leaves out."""
        return self.max_tokens == 0

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


def check_continuation(continue_final_message: bool, add_generation_prompt: bool) -> None:
    """vLLM's rule: a chat's reply either starts a new assistant turn
    (``add_generation_prompt``) or goes on the last message (``continue_final_message``),
    not both (a chat request's and ``/tokenize``'s).

    Raises:
        RequestError: both are true, naming ``continue_final_message``.
    """
    if continue_final_message and add_generation_prompt:
        raise RequestError("continue_final_message and add_generation_prompt cannot both "
                           "be true (send add_generation_prompt: false)",
                           "continue_final_message")


def _is_token_ids(values: list) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in values)


class ChatCompletionRequest(_SamplingFields, ChatTemplateInputs):
    """``POST /v1/chat/completions`` body (the template's inputs: ``ChatTemplateInputs``).
    ``max_completion_tokens`` wins over the deprecated ``max_tokens``; ``top_logprobs``
    needs ``logprobs=True``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int32 | None = Field(None, ge=1)
    max_completion_tokens: Int32 | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # vLLM's: the reply starts with the last message's content when that is the assistant's
    echo: bool = False
    # vLLM's: the tokenizer's special tokens on top of the template's (false, its default)
    add_special_tokens: bool = False
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # vLLM's: false leaves the reasoning out (--reasoning-parser still splits it off)
    include_reasoning: bool = True

    @field_validator("add_special_tokens")
    @classmethod
    def _no_special_tokens_on_top(cls, value: bool) -> bool:
        if value:
            raise ValueError("true is not supported: the chat template writes the special "
                             "tokens (BOS, turn markers) itself")
        return value

    @model_validator(mode="after")
    def _check_continue_final_message(self) -> ChatCompletionRequest:
        check_continuation(self.continue_final_message, self.add_generation_prompt)
        return self

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

    def echoed(self) -> str:
        """What the reply starts with under ``echo`` (vLLM's): the last message's content
        when it is the assistant's (the role the reply continues), else nothing."""
        last = self.messages[-1]
        return last.content or "" if self.echo and last.role == "assistant" else ""

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


def _built_and_checked(build: Any) -> StructuredOutputSpec:
    """``build()``'s spec once xgrammar parses it (``check_spec``); ValueError if not."""
    spec = build()
    check_spec(spec)
    return spec


def to_sampling_params(request: CompletionRequest | ChatCompletionRequest, *,
                       max_model_len: int, prompt_len: int,
                       defaults: GenerationDefaults | None = None) -> SamplingParams:
    """The engine's ``SamplingParams`` for ``request`` whose prompt has ``prompt_len``
    tokens. ``max_tokens`` defaults to ``max_model_len - prompt_len`` (vLLM's default);
    ``temperature``, ``top_p``, ``top_k``, ``min_p`` and ``repetition_penalty`` left unset
    take ``defaults`` (the model's generation config), else vLLM's defaults.

    Raises:
        RequestError: the prompt, or prompt plus ``max_tokens``, exceeds ``max_model_len``
            (vLLM's wording, naming both numbers: ``fit_max_tokens``), or the engine
            refuses a value (``checked_sampling_params``).
    """
    is_chat = isinstance(request, ChatCompletionRequest)
    max_tokens, max_tokens_param = request.max_tokens, "max_tokens"
    if is_chat and request.max_completion_tokens is not None:
        max_tokens, max_tokens_param = request.max_completion_tokens, "max_completion_tokens"
    if max_tokens == 0:  # CompletionRequest.prompt_only: one token, left out
        max_tokens = 1
    max_tokens = fit_max_tokens(prompt_len, max_tokens, max_model_len, api="openai",
                                prompt_param="messages" if is_chat else "prompt",
                                max_tokens_param=max_tokens_param)
    if is_chat:
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
    else:
        logprobs = request.logprobs
    prompt_logprobs = _prompt_logprobs(request, prompt_len)
    model_defaults = (defaults or GenerationDefaults()).sampling_kwargs(
        temperature=request.temperature, top_p=request.top_p, top_k=request.top_k,
        min_p=request.min_p, repetition_penalty=request.repetition_penalty)
    return checked_sampling_params(lambda: SamplingParams(
        n=request.n, **model_defaults, presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty, seed=request.seed,
        max_tokens=max_tokens, min_tokens=request.min_tokens,
        stop_token_ids=list(request.stop_token_ids), ignore_eos=request.ignore_eos,
        logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        logit_bias={int(k): v for k, v in
                                       (request.logit_bias or {}).items()} or None,
        structured_output=request.structured_output_spec(),
        allowed_token_ids=request.allowed_token_ids))


def _prompt_logprobs(request: CompletionRequest | ChatCompletionRequest,
                     prompt_len: int) -> int | None:
    """How many top alternatives the engine computes for each prompt token: the request's
    ``prompt_logprobs``, or at least ``logprobs`` for a completion with ``echo`` (whose
    logprobs then start with the prompt's, as OpenAI's and vLLM's do); None for none.

    Raises:
        RequestError: ``prompt_logprobs`` with ``stream`` (vLLM refuses it too), or too
            many prompt log-probabilities (``check_prompt_logprobs``).
    """
    num_top, param = request.prompt_logprobs, "prompt_logprobs"
    if num_top is not None and request.stream:
        raise RequestError("prompt_logprobs are not available when stream is true",
                           "prompt_logprobs")
    echo_logprobs = request.logprobs if isinstance(request, CompletionRequest) and \
        request.echo else None
    if echo_logprobs is not None and (num_top is None or echo_logprobs > num_top):
        num_top, param = echo_logprobs, "logprobs"
    check_prompt_logprobs(prompt_len, num_top, param)
    return num_top
