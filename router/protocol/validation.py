"""The request-validation rules that the HTTP API and the gRPC API both call.

One rule, one place: the model's length (``fit_max_tokens``), a field check whose
ValueError names the field (``check_field``), the engine's checks of the sampling
parameters (``checked_sampling_params``), and the bounded field types the request models
are declared with (``Text``, ``TokenId``, ``Int32``, ``StrictInt``). Every error raised
here is a ``RequestError`` whose ``param`` is set where it is raised, never read back out
of a message.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, Field, ValidationInfo

from pdserve.engine.sampling_params import MAX_LOGPROBS, SamplingParamError, SamplingParams
from pdserve.router.limits import INT32_MAX, check_text, check_token_id
from pdserve.router.protocol.errors import RequestError

__all__ = ["MAX_LOGPROBS", "Int32", "StrictInt", "Text", "TokenId", "check_field",
           "checked_sampling_params", "fit_max_tokens", "unknown_field", "vocab_size"]

T = TypeVar("T")


def vocab_size(info: ValidationInfo) -> int | None:
    """The vocabulary size a caller passed as ``model_validate(..., context={"vocab_size":
    ...})``; None without one (token ids then are not checked against it)."""
    return info.context.get("vocab_size") if isinstance(info.context, dict) else None


def _token_id_in_vocab(value: int, info: ValidationInfo) -> int:
    return check_token_id(value, vocab_size(info))


StrictInt = Annotated[int, Field(strict=True)]
Int32 = Annotated[int, Field(strict=True, le=INT32_MAX)]
TokenId = Annotated[int, Field(strict=True, ge=0, le=INT32_MAX),
                    AfterValidator(_token_id_in_vocab)]
Text = Annotated[str, AfterValidator(check_text)]  # no lone surrogates


def unknown_field(model: type[BaseModel], data: Any) -> str | None:
    """The first key of a request body ``data`` that ``model`` does not declare."""
    if isinstance(data, dict):
        return next((name for name in data if name not in model.model_fields), None)
    return None


def check_field(name: str, check: Callable[[Any], T], value: Any, *,
                drop_prefix: str = "") -> T:
    """``check(value)``; its ValueError becomes a 400 ``RequestError`` naming ``name``:
    ``Invalid value for '<name>': <the error, less drop_prefix>``.

    Raises:
        RequestError: ``param`` ``name``.
    """
    try:
        return check(value)
    except ValueError as exc:
        message = str(exc).removeprefix(drop_prefix)
        raise RequestError(f"Invalid value for '{name}': {message}", name) from exc


def fit_max_tokens(prompt_len: int, max_tokens: int | None, max_model_len: int, *,
                   api: Literal["openai", "grpc"], prompt_param: str = "prompt",
                   max_tokens_param: str = "max_tokens") -> int:
    """The model's length rule: a prompt of ``prompt_len`` tokens plus the tokens to
    generate fit in ``max_model_len`` tokens. Returns the completion's budget in tokens:
    ``max_tokens``, or when it is None the rest of the context, ``max_model_len -
    prompt_len`` (vLLM's default).

    ``api`` picks the wording of the error, which each API has always sent: ``openai``
    (vLLM's, for the HTTP API) says a prompt that leaves no room for one token is too long
    (``param`` ``prompt_param``: ``prompt`` or ``messages``) and counts the prompt "in the
    messages"; ``grpc`` reports that case as the request being too long and counts the
    prompt "in the prompt".

    Raises:
        RequestError: 400, the prompt leaves no room (see ``api``), or ``prompt_len +
            max_tokens > max_model_len`` (``param`` ``max_tokens_param``: ``max_tokens``,
            or ``max_completion_tokens`` when a chat request set that), naming both numbers.
    """
    room = max_model_len - prompt_len
    if room < 1 and api == "openai":
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"request has {prompt_len} input tokens. Please reduce the length of the input "
            f"{prompt_param}.", prompt_param)
    budget = room if max_tokens is None else max_tokens
    if room < 1 or budget > room:
        where, advice = ("prompt", "")
        if api == "openai":
            where, advice = "messages", " Please reduce the length of the messages or completion."
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + budget} tokens ({prompt_len} in the {where}, "
            f"{budget} in the completion).{advice}", max_tokens_param)
    return budget


def checked_sampling_params(build: Callable[[], SamplingParams]) -> SamplingParams:
    """``build()``, the engine's ``SamplingParams`` of a request (the HTTP API builds them
    from its model, the gRPC API from its message); the engine's refusal of a value
    becomes a 400 ``RequestError`` with the engine's message, naming the parameter.

    Raises:
        RequestError: ``param`` the refused parameter (``SamplingParamError.param``, e.g.
            ``min_tokens`` for ``min_tokens=9 is invalid: ...``).
    """
    try:
        return build()
    except SamplingParamError as exc:
        raise RequestError(str(exc), exc.param) from exc


# Prompt positions x (prompt_logprobs + 1) one sequence may ask log-probabilities for: a
# worker's reply carries them all in one gRPC message (~13-17 bytes an entry), which must
# stay under gRPC's default 4 MiB receive limit.
MAX_PROMPT_LOGPROB_ENTRIES = 1 << 17
# ... and one request, all its sequences together: the router holds them as Python
# objects (~100 bytes an entry) and writes them as JSON, so they bound its memory.
MAX_REQUEST_PROMPT_LOGPROB_ENTRIES = 1 << 19


def check_prompt_logprobs(prompt_len: int, num_top: int | None, param: str) -> None:
    """Refuse a request whose ``prompt_len`` tokens with ``num_top`` alternatives each
    (None: no prompt logprobs) ask for more than ``MAX_PROMPT_LOGPROB_ENTRIES`` values.

    Raises:
        RequestError: naming ``param`` (``prompt_logprobs``, or ``logprobs`` with echo)
            and the limit.
    """
    if num_top is not None and prompt_len * (num_top + 1) > MAX_PROMPT_LOGPROB_ENTRIES:
        raise RequestError(
            f"Invalid value for '{param}': a prompt of {prompt_len} tokens with {num_top} "
            f"alternatives each asks for {prompt_len * (num_top + 1)} prompt log-"
            f"probabilities; at most {MAX_PROMPT_LOGPROB_ENTRIES} per prompt", param)


def check_request_prompt_logprobs(num_entries: int) -> None:
    """Refuse a request whose sequences ask for more than
    ``MAX_REQUEST_PROMPT_LOGPROB_ENTRIES`` prompt log-probabilities together (prompt
    positions x (alternatives + 1), summed over the prompts, and over the choices of a
    stream, where each choice's first chunk carries its own).

    Raises:
        RequestError: naming ``prompt_logprobs`` and the limit.
    """
    if num_entries > MAX_REQUEST_PROMPT_LOGPROB_ENTRIES:
        raise RequestError(
            f"Invalid value for 'prompt_logprobs': the request's prompts ask for "
            f"{num_entries} prompt log-probabilities in all (positions x (alternatives + "
            f"1)); at most {MAX_REQUEST_PROMPT_LOGPROB_ENTRIES} per request",
            "prompt_logprobs")
