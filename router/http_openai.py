"""The HTTP API's OpenAI and vLLM routes: ``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``, ``/v1/models/{id}``, ``/tokenize``, ``/tokenizer_info`` and ``/detokenize``
(``add_openai_routes``), and how a completion request is served, in full or as a stream
of server-sent events (``router/http.py`` describes the errors)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdserve.engine.tokenizer import apply_chat_template, bad_word_sequences, encode_prompt
from pdserve.router.generate_request import GenerateRequest
from pdserve.router.history import ReplyTokens
from pdserve.router.http_format import ChatFormatter, CompletionFormatter, Formatter
from pdserve.router.http_guard import json_body
from pdserve.router.limits import choice_seed
from pdserve.router.model_service import ModelService
from pdserve.router.output import GenerationChunk
from pdserve.router.protocol import (
    INTERNAL_ERROR,
    SSE_DONE,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    RequestError,
    TokenizeRequest,
    TokenizeResponse,
    error_response,
    random_id,
    sse_event,
    to_sampling_params,
)
from pdserve.router.protocol.requests import REQUEST_ID_PATTERN
from pdserve.router.protocol.validation import (
    check_field,
    check_request_prompt_logprobs,
    checked_sampling_params,
)
from pdserve.router.served_models import ServedModels
from pdserve.router.tool_calling import ToolCalling

logger = logging.getLogger(__name__)


def add_openai_routes(app: FastAPI, routers: ServedModels, max_body_bytes: int) -> None:
    """Add, in this order, ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET
    /v1/models``, ``GET /v1/models/{model_id}``, ``POST /tokenize``, ``GET
    /tokenizer_info`` (answered when the model's router enables it) and ``POST
    /detokenize`` to ``app``, serving ``routers`` (a request's ``model`` picks one, the
    first when it names none); a body over ``max_body_bytes`` gets a 413."""
    _add_completion_routes(app, routers, max_body_bytes)
    _add_model_routes(app, routers, max_body_bytes)


async def request_body(raw: Request, routers: ServedModels,
                       max_body_bytes: int) -> tuple[ModelService, Any]:
    """The request's JSON body and the router of the model it names.

    Raises:
        RequestError: the body is too large (413) or not JSON (400), or it names a model
            none of ``routers`` serves (404).
    """
    body = await json_body(raw, max_body_bytes)
    model = body.get("model") if isinstance(body, dict) else None
    return routers.pick(model if isinstance(model, str) else None), body


def _add_completion_routes(app: FastAPI, routers: ServedModels, max_body_bytes: int) -> None:
    # The tokenizers are loaded when the routers start: a cache is made on first use.
    history: dict[str, ReplyTokens] = {}

    def reply_tokens(router: ModelService) -> ReplyTokens:
        if router.served_model_name not in history:
            history[router.served_model_name] = ReplyTokens(router.tokenizer)
        return history[router.served_model_name]

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        router, body = await request_body(raw, routers, max_body_bytes)
        request = CompletionRequest.model_validate(body, context=router.validation_context)
        given = [_tokenize_prompt(router, p, request.add_special_tokens)
                 for p in request.prompts()]
        prompts = [request.truncate(p, router.max_model_len) for p in given]
        texts = [p if isinstance(p, str) and len(ids) == len(full)
                 else router.tokenizer.decode(ids)
                 for p, ids, full in zip(request.prompts(), prompts, given, strict=True)
                 ] if request.echo else None
        response_id, base_id = _ids(raw, "cmpl", request)
        return await _serve(router, request, prompts, CompletionFormatter(
            router, request, response_id, prompts, texts), base_id)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> Response:
        router, body = await request_body(raw, routers, max_body_bytes)
        request = ChatCompletionRequest.model_validate(body, context=router.validation_context)
        tools = ToolCalling.of(request, router.config)
        prompt = _chat_prompt(router, request)
        replies = reply_tokens(router)
        prompt = request.truncate(replies.splice(prompt, [
            m.content for m in request.messages if m.role == "assistant" and m.content]),
            router.max_model_len)
        response_id, base_id = _ids(raw, "chatcmpl", request)
        return await _serve(router, request, [prompt], ChatFormatter(
            router, request, response_id, [prompt], tools, replies), base_id)


def _ids(raw: Request, prefix: str, request: CompletionRequest | ChatCompletionRequest
         ) -> tuple[str, str]:
    """The answer's id and its sequences' ids' base (``<base>-<i>`` on the workers). The
    answer's: ``<prefix>-<X-Request-Id header>``, else ``<prefix>-<the body's
    request_id>`` (vLLM's order), else a random one, which is then the base too; the base
    is always the router's own, as two clients may send one id.

    Raises:
        RequestError: the header is not 1-256 visible ASCII characters (param
            ``X-Request-Id``).
    """
    given = raw.headers.get("x-request-id")
    if given is not None and not re.fullmatch(REQUEST_ID_PATTERN, given):
        raise RequestError("the X-Request-Id header must be 1 to 256 visible ASCII "
                           "characters", "X-Request-Id")
    given = given or request.request_id
    base = random_id(prefix)
    return (base if given is None else f"{prefix}-{given}"), base


def _chat_prompt(router: ModelService, request: ChatCompletionRequest | TokenizeRequest
                 ) -> list[int]:
    """The chat's token ids through the model's chat template (or the request's own, with
    ``--trust-request-chat-template``), with the request's tools, documents and template
    variables (``ChatTemplateInputs``): what a chat completion and ``/tokenize`` render.

    Raises:
        RequestError: the template refuses the messages (param ``messages``), or the
            request brings its own ``chat_template`` to a router that does not trust them.
    """
    messages = [m.template_dict() for m in request.messages]
    if request.chat_template is not None and not router.config.trust_request_chat_template:
        raise RequestError("a request's own chat_template is not rendered here (pdserve "
                           "serve --trust-request-chat-template allows it)", "chat_template")
    try:
        return apply_chat_template(
            router.tokenizer, messages, add_generation_prompt=request.add_generation_prompt,
            tools=[t.model_dump(exclude_none=True) for t in request.tools or ()] or None,
            template_kwargs=request.chat_template_kwargs,
            continue_final_message=request.continue_final_message,
            documents=request.documents, chat_template=request.chat_template)
    except ValueError as exc:
        raise RequestError(str(exc), "messages") from exc


def _add_model_routes(app: FastAPI, routers: ServedModels, max_body_bytes: int) -> None:
    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[_card(r, name) for r in routers for name in r.served_model_names])

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> ModelCard:
        return _card(routers.pick(model_id), model_id)

    @app.post("/tokenize")
    async def tokenize(raw: Request) -> TokenizeResponse:
        """vLLM's: a prompt's token ids as the completions API would make them (or, with
        ``add_special_tokens=false``, without the BOS), or a chat's through its template."""
        router, body = await request_body(raw, routers, max_body_bytes)
        request = TokenizeRequest.model_validate(body)
        if request.messages is not None:
            tokens = _chat_prompt(router, request)
        else:
            tokens = encode_prompt(router.tokenizer, request.prompt,
                                   request.add_special_tokens is not False)
        strs = router.tokenizer.convert_ids_to_tokens(tokens) if request.return_token_strs \
            else None
        return TokenizeResponse(count=len(tokens), max_model_len=router.max_model_len,
                                tokens=tokens, token_strs=strs)

    @app.get("/tokenizer_info")
    async def tokenizer_info(model: str | None = None) -> Response:
        """vLLM's (behind ``--enable-tokenizer-info-endpoint``, as there): the served
        tokenizer's class, special tokens, chat template and ``model_max_length`` (the
        served ``max_model_len``); ``?model=`` picks a served model (default: the first).
        404 when the flag is off."""
        router = routers.pick(model)
        if not router.config.enable_tokenizer_info_endpoint:
            raise RequestError("GET /tokenizer_info: not served (pdserve serve "
                               "--enable-tokenizer-info-endpoint turns it on)", status=404)
        return JSONResponse(_tokenizer_info(router))

    @app.post("/detokenize")
    async def detokenize(raw: Request) -> Response:
        """vLLM's: the text of token ids (special tokens kept)."""
        router, body = await request_body(raw, routers, max_body_bytes)
        request = DetokenizeRequest.model_validate(body, context=router.validation_context)
        return JSONResponse({"prompt": router.tokenizer.decode(request.tokens)})


def _tokenizer_info(router: ModelService) -> dict:
    """``/tokenizer_info``'s body: the tokenizer's class, its special tokens as text (None
    where it has none), whether it adds a BOS, its chat template (None without one) and
    the served ``max_model_len`` as ``model_max_length``."""
    tokenizer = router.tokenizer
    info: dict = {"tokenizer_class": type(tokenizer).__name__,
                  "model_max_length": router.max_model_len}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = getattr(tokenizer, name, None)
        info[name] = None if value is None else str(value)
    add_bos = getattr(tokenizer, "add_bos_token", None)
    info["add_bos_token"] = add_bos if isinstance(add_bos, bool) else None
    template = getattr(tokenizer, "chat_template", None)
    info["chat_template"] = template if isinstance(template, str) else None
    return info


def _card(router: ModelService, name: str) -> ModelCard:
    return ModelCard(id=name, root=router.config.model,
                     max_model_len=router.max_model_len)


def _tokenize_prompt(router: ModelService, prompt: str | list[int],
                     add_special_tokens: bool = True) -> list[int]:
    """Token ids of one prompt, a text one with the tokenizer's special tokens unless
    ``add_special_tokens`` is false (token-id prompts were checked against the vocabulary
    when the request was validated, and are taken as they are)."""
    if isinstance(prompt, str):
        return encode_prompt(router.tokenizer, prompt, add_special_tokens)
    return list(prompt)


async def _serve(router: ModelService, request: CompletionRequest | ChatCompletionRequest,
                 prompts: list[list[int]], formatter: Formatter, base_id: str) -> Response:
    """Validate, start every sequence (n per prompt; ids ``<base_id>-<i>``), and answer in
    full or as a stream."""
    sequences = []
    tools: ToolCalling | None = getattr(formatter, "tools", None)
    # NOTE: a parser whose markers are special tokens must see them in the text.
    skip_special_tokens = request.skip_special_tokens and not (
        tools is not None and tools.needs_special_tokens)
    prompt_logprob_entries = 0
    bad_words = bad_word_sequences(router.tokenizer, request.bad_words or ())
    priority = check_field("priority", router.check_priority, request.priority)
    for prompt in prompts:
        params = to_sampling_params(request, max_model_len=router.max_model_len,
                                    prompt_len=len(prompt), defaults=router.generation_defaults)
        if bad_words:
            params = checked_sampling_params(
                lambda p=params: dataclasses.replace(p, bad_words_token_ids=bad_words))
        if tools is not None and tools.spec is not None:  # tool_choice required / named
            params = dataclasses.replace(params, structured_output=tools.spec)
        for i in range(request.n):
            seq_params = dataclasses.replace(params, n=1, seed=choice_seed(params.seed, i))
            if seq_params.prompt_logprobs is not None and i and not request.stream:
                seq_params.prompt_logprobs = None  # the prompt's first choice has them
            elif seq_params.prompt_logprobs is not None:
                prompt_logprob_entries += len(prompt) * (seq_params.prompt_logprobs + 1)
            sequences.append(GenerateRequest(
                f"{base_id}-{len(sequences)}", prompt, seq_params,
                request.stop_strings(),
                request.include_stop_str_in_output, skip_special_tokens,
                request.cache_salt, priority))
    check_request_prompt_logprobs(prompt_logprob_entries)
    router.check_available(len(sequences))
    merged = _Merged([router.generate(s) for s in sequences])
    try:
        first = await anext(merged)
        if not request.stream:
            formatter.add(*first)
            async for item in merged:
                formatter.add(*item)
            return JSONResponse(formatter.response().model_dump())
    except BaseException:
        merged.cancel()
        raise
    return _EventStream(_sse(formatter, first, merged), on_close=merged.cancel)


async def _sse(formatter: Formatter, first: tuple[int, GenerationChunk],
               merged: _Merged) -> AsyncIterator[bytes]:
    try:
        for chunk in formatter.stream_start():
            yield sse_event(chunk)
        yield sse_event(formatter.stream_chunk(*first))
        async for index, chunk in merged:
            yield sse_event(formatter.stream_chunk(index, chunk))
        usage = formatter.stream_usage()
        if usage is not None:
            yield sse_event(usage)
    except RequestError as exc:
        if exc.status >= 500 and exc.status != 503:
            logger.error("stream failed: %s", exc.message)
            yield _error_event(exc.status, INTERNAL_ERROR)
        else:
            yield _error_event(exc.status, exc.message, exc.param)
    except Exception:  # the headers are sent: report it in the stream
        logger.exception("stream failed")
        yield _error_event(500, INTERNAL_ERROR)
    finally:
        merged.cancel()
    yield SSE_DONE


def _error_event(status: int, message: str, param: str | None = None) -> bytes:
    return sse_event(error_response(status, message, param).model_dump())


_DONE = object()


class _Merged:
    """Interleaves ``streams`` as ``(index, chunk)`` in arrival order. Each stream runs in
    a task of its own, so ``cancel()`` (synchronous: safe in a cancelled scope) stops them
    all, and each stream's cleanup aborts its request on the workers."""

    def __init__(self, streams: list[AsyncIterator[GenerationChunk]]) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()
        self._remaining = len(streams)
        self._tasks = [asyncio.create_task(self._pump(i, s)) for i, s in enumerate(streams)]

    async def _pump(self, index: int, stream: AsyncIterator[GenerationChunk]) -> None:
        try:
            async for chunk in stream:
                self._queue.put_nowait((index, chunk))
            self._queue.put_nowait((index, _DONE))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            self._queue.put_nowait((index, exc))

    def __aiter__(self) -> _Merged:
        return self

    async def __anext__(self) -> tuple[int, GenerationChunk]:
        while self._remaining:
            index, item = await self._queue.get()
            if item is _DONE:
                self._remaining -= 1
            elif isinstance(item, Exception):
                self.cancel()
                raise item
            else:
                return index, item
        raise StopAsyncIteration

    def cancel(self) -> None:
        """Stop every stream still running."""
        for task in self._tasks:
            task.cancel()


class _EventStream(StreamingResponse):
    """An SSE response that calls ``on_close`` however it ends: Starlette cancels the
    body iterator when the client disconnects without closing it."""

    def __init__(self, content: AsyncIterator[bytes], on_close) -> None:
        super().__init__(content, media_type="text/event-stream")
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
