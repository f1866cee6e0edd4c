"""The OpenAI-compatible HTTP API of the router (FastAPI): ``/v1/completions``,
``/v1/chat/completions``, ``/v1/models``, ``/health`` (liveness, with the router's state), ``/ready`` (readiness),
``/metrics``, ``/metrics/targets`` (the workers' metrics, for Prometheus's HTTP service
discovery); vLLM's ``/v1/models/{id}``, ``/tokenize``, ``/detokenize`` and ``/version``;
``/admin/scale`` and ``/admin/pools`` (``pdserve scale``).

Every error is an OpenAI error body (``router/protocol.py``): 401 without an accepted API
key where keys are set, 403 on an admin endpoint for a client key or, with no admin key,
a client not on loopback (``router/auth.py``), 400 naming the offending
field for invalid JSON or values, 404 for an unknown model or path, 413 for a body over
``max_body_bytes``, 503 with ``Retry-After`` when no worker can take the request, and 500
("internal error", nothing more) for a bug, whose stack goes to the log; the connection
stays open after every one of them. Streams are server-sent events,
``data: {json}\\n\\n`` chunks ending with ``data: [DONE]\\n\\n``; a stream is started only
once its first token arrived, so errors before it are plain HTTP errors.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, StrictInt, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve import __version__ as pdserve_version
from pdserve.engine.tokenizer import apply_chat_template, encode_prompt
from pdserve.router.auth import AdminAuth, ApiKeyAuth, ApiKeyMiddleware
from pdserve.router.detokenizer import fast_decoder
from pdserve.router.grpc_server import GRPCServerMetrics
from pdserve.router.history import ReplyTokens
from pdserve.router.http_guard import (
    MAX_BODY_BYTES,
    ErrorJSONResponse,
    InternalErrorMiddleware,
    json_body,
)
from pdserve.router.http_server import HTTPServerMetrics, HTTPTimeouts
from pdserve.router.limits import choice_seed
from pdserve.router.logprobs import chat_logprobs, completion_logprobs
from pdserve.router.protocol import (
    INTERNAL_ERROR,
    SSE_DONE,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    ChatToolCall,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    RequestError,
    TokenizeRequest,
    TokenizeResponse,
    ToolCallFunction,
    UsageInfo,
    chat_stream_choice,
    chat_stream_chunk,
    completion_stream_choice,
    completion_stream_chunk,
    error_response,
    random_id,
    sse_event,
    to_sampling_params,
    validation_error_response,
)
from pdserve.router.routers import Routers
from pdserve.router.service import GenerateRequest, GenerationChunk, Router
from pdserve.router.tool_calling import ToolCalling

logger = logging.getLogger(__name__)


class ScaleRequest(BaseModel):
    """``POST /admin/scale``: the pool sizes wanted (workers) of ``model`` (needed when
    the cluster serves several); a pool left out keeps its size."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str | None = None

    prefill_workers: StrictInt | None = None
    decode_workers: StrictInt | None = None


def build_app(router: Router | Sequence[Router], *, max_body_bytes: int = MAX_BODY_BYTES,
              api_auth: ApiKeyAuth | None = None, admin_auth: AdminAuth | None = None,
              scaler=None,
              background: Sequence[Callable[[], Awaitable[None]]] = (),
              http_timeouts: HTTPTimeouts | None = None) -> FastAPI:
    """The FastAPI app serving ``router``, or several routers, one per model (their
    ``served_model_name``s distinct; a request's ``model`` picks one, the first when it
    names none); its lifespan starts and stops them.

    ``scaler`` (``entrypoints/scaling.py``'s ``PoolScaler``, from ``pdserve serve``; with
    several models a dict of them by model name) resizes the pools behind ``POST
    /admin/scale``; without one, ``/admin/*`` answers 501 (a router run alone does not
    own its workers). ``background``: coroutine functions run as tasks while the router
    serves (started after it, cancelled before it stops), such as the SLO planner's loop.

    ``max_body_bytes`` bounds a request body (413 beyond it, from ``Content-Length`` or
    while reading). With ``api_auth``, every path but its public ones needs one of its
    API keys (401 otherwise, ``router/auth.py``); it is kept as ``app.state.api_auth``,
    so that a gRPC server started beside the app can take the same keys. The admin
    endpoints (``/admin/*``, ``/metrics/targets``) take ``admin_auth``'s keys only, or
    with none (the default) answer loopback clients only (403 otherwise); kept as
    ``app.state.admin_auth``.

    ``http_timeouts`` (default ``HTTPTimeouts()``) bound how long a request may take to
    arrive; kept as ``app.state.http_timeouts`` beside ``app.state.http_metrics`` for the
    server that ``router/http_server.py``'s ``uvicorn_config`` makes for the app.
    ``app.state.grpc_metrics`` (shown on ``/metrics``) is for a gRPC server beside it.

    Raises:
        ValueError: no router, or two serving the same model name.
    """
    routers = Routers([router] if isinstance(router, Router) else list(router))
    scalers = scaler if isinstance(scaler, Mapping) or scaler is None else \
        {routers.first.served_model_name: scaler}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        for each in routers:
            await each.start()
        tasks = [asyncio.create_task(fn()) for fn in background]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=30.0)
            for each in routers:
                await each.stop()

    app = FastAPI(title="pdserve router", lifespan=lifespan)
    _add_error_handlers(app, routers.first)
    app.add_middleware(InternalErrorMiddleware)
    app.state.api_auth = api_auth
    app.state.admin_auth = admin_auth = admin_auth or AdminAuth()
    app.state.http_timeouts = http_timeouts or HTTPTimeouts()
    app.state.http_metrics = http_metrics = HTTPServerMetrics()
    # NOTE: on /metrics with the HTTP server's, from the start: a gRPC server started
    # beside the app (entrypoints/serve.py's run_router) counts in it
    app.state.grpc_metrics = GRPCServerMetrics(http_metrics.registry)
    # NOTE: added last, so it runs first: before anything else
    app.add_middleware(ApiKeyMiddleware, auth=api_auth, admin=admin_auth)
    # The tokenizers are loaded when the routers start: a cache is made on first use.
    history: dict[str, ReplyTokens] = {}

    def reply_tokens(router: Router) -> ReplyTokens:
        if router.served_model_name not in history:
            history[router.served_model_name] = ReplyTokens(router.tokenizer)
        return history[router.served_model_name]

    async def body_of(raw: Request) -> tuple[Router, Any]:
        """The request's JSON body and the router of the model it names."""
        body = await json_body(raw, max_body_bytes)
        model = body.get("model") if isinstance(body, dict) else None
        return routers.pick(model if isinstance(model, str) else None), body

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        router, body = await body_of(raw)
        request = CompletionRequest.model_validate(body, context=router.validation_context)
        prompts = [_tokenize_prompt(router, p) for p in request.prompts()]
        texts = [p if isinstance(p, str) else router.tokenizer.decode(p) for p in
                 request.prompts()] if request.echo else None
        return await _serve(router, request, prompts, CompletionFormatter(
            router, request, random_id("cmpl"), prompts, texts))

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> Response:
        router, body = await body_of(raw)
        request = ChatCompletionRequest.model_validate(body, context=router.validation_context)
        tools = ToolCalling.of(request, router.config)
        messages = [m.template_dict() for m in request.messages]
        try:
            prompt = apply_chat_template(
                router.tokenizer, messages, add_generation_prompt=request.add_generation_prompt,
                tools=[t.model_dump(exclude_none=True) for t in request.tools or ()] or None,
                template_kwargs=request.chat_template_kwargs)
        except ValueError as exc:
            raise RequestError(str(exc), "messages") from exc
        replies = reply_tokens(router)
        prompt = replies.splice(prompt, [m.content for m in request.messages
                                         if m.role == "assistant" and m.content])
        return await _serve(router, request, [prompt], ChatFormatter(
            router, request, random_id("chatcmpl"), [prompt], tools, replies))

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
        router, body = await body_of(raw)
        request = TokenizeRequest.model_validate(body)
        if request.messages is not None:
            messages = [{"role": m.role, "content": m.content} for m in request.messages]
            try:
                tokens = apply_chat_template(
                    router.tokenizer, messages,
                    add_generation_prompt=request.add_generation_prompt)
            except ValueError as exc:
                raise RequestError(str(exc), "messages") from exc
        elif request.add_special_tokens:
            tokens = encode_prompt(router.tokenizer, request.prompt)
        else:
            tokens = list(router.tokenizer.encode(request.prompt, add_special_tokens=False))
        return TokenizeResponse(count=len(tokens), max_model_len=router.max_model_len,
                                tokens=tokens)

    @app.post("/detokenize")
    async def detokenize(raw: Request) -> Response:
        """vLLM's: the text of token ids (special tokens kept)."""
        router, body = await body_of(raw)
        request = DetokenizeRequest.model_validate(body, context=router.validation_context)
        return JSONResponse({"prompt": router.tokenizer.decode(request.tokens)})

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": pdserve_version})

    @app.get("/health")
    async def health() -> Response:
        """Liveness: 200 while the router runs, with its state (``Router.health``):
        ``status`` ``ok``, ``degraded`` (Redis unreachable: serving on the last view) or
        ``unavailable`` (no live decode worker); with several models, the worst of theirs
        and each model's under ``models``."""
        return JSONResponse(routers.health())

    @app.get("/ready")
    async def ready() -> Response:
        """Readiness: 200 when a request can be served now (for every model), else 503
        with the state."""
        state = routers.health()
        return JSONResponse(state, status_code=503 if state["status"] == "unavailable" else 200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(routers.exposition(http_metrics.registry),
                        media_type=routers.first.metrics.CONTENT_TYPE)

    def need_scaler(model: str | None):
        if scalers is None:
            raise RequestError("pool scaling needs the workers' owner: `pdserve serve` "
                               "(Ray); this router was started without one", status=501)
        if model is None and len(routers) > 1:
            raise RequestError(f"this cluster serves {len(routers)} models: name one in "
                               "'model'", "model")
        return scalers[routers.pick(model).served_model_name]

    @app.get("/admin/pools")
    async def pools(model: str | None = None) -> Response:
        """The pool sizes ``pdserve serve`` keeps (workers per pool) of ``model``."""
        sizes = need_scaler(model).sizes()
        return JSONResponse({f"{role}_workers": n for role, n in sizes.items()})

    @app.post("/admin/scale")
    async def scale(raw: Request) -> Response:
        """Resize a model's pools; answers once new workers serve and removed ones have
        drained (minutes, when a model loads). An admin endpoint (``router/auth.py``)."""
        request = ScaleRequest.model_validate(await json_body(raw, max_body_bytes))
        owner = need_scaler(request.model)
        wanted = {"prefill": request.prefill_workers, "decode": request.decode_workers}
        try:
            sizes = await owner.scale(wanted)
        except ValueError as exc:
            raise RequestError(str(exc), _scale_param(str(exc))) from exc
        return JSONResponse({f"{role}_workers": n for role, n in sizes.items()})

    @app.get("/metrics/targets")
    async def metrics_targets() -> Response:
        """Prometheus HTTP service discovery (``http_sd_configs``) of every worker's
        ``/metrics``, from the registry. An admin endpoint: it names internal addresses
        (Prometheus sends the admin API key as ``authorization``)."""
        return JSONResponse([t for r in routers
                             for t in r.pool.metrics_targets(r.served_model_name)])

    return app


def _card(router: Router, name: str) -> ModelCard:
    return ModelCard(id=name, root=router.config.model,
                     max_model_len=router.max_model_len)


def _scale_param(message: str) -> str | None:
    """The field a ``ScaleError`` names (its message starts with it), if any."""
    return next((p for p in ("prefill_workers", "decode_workers") if p in message), None)


def _add_error_handlers(app: FastAPI, router: Router) -> None:
    retry_after = {"Retry-After": str(router.config.retry_after_s)}

    def reply(status: int, body: BaseModel) -> JSONResponse:
        return ErrorJSONResponse(body.model_dump(), status_code=status,
                                 headers=retry_after if status == 503 else None)

    @app.exception_handler(RequestError)
    async def on_request_error(request: Request, exc: RequestError) -> JSONResponse:
        if exc.status >= 500 and exc.status != 503:  # a worker's error: details to the log
            logger.error("%s %s failed: %s", request.method, request.url.path, exc.message)
            return reply(exc.status, error_response(exc.status, INTERNAL_ERROR))
        return reply(exc.status, error_response(exc.status, exc.message, exc.param))

    @app.exception_handler(ValidationError)
    async def on_validation_error(request: Request, exc: ValidationError) -> JSONResponse:
        return reply(400, validation_error_response(exc))

    @app.exception_handler(RequestValidationError)
    async def on_request_validation(request: Request, exc: RequestValidationError
                                    ) -> JSONResponse:
        return reply(400, validation_error_response(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"{request.method} {request.url.path}: no such route"
        return reply(exc.status_code, error_response(exc.status_code, message))


def _tokenize_prompt(router: Router, prompt: str | list[int]) -> list[int]:
    """Token ids of one prompt (token-id prompts were checked against the vocabulary
    when the request was validated)."""
    if isinstance(prompt, str):
        return encode_prompt(router.tokenizer, prompt)
    return list(prompt)


async def _serve(router: Router, request: CompletionRequest | ChatCompletionRequest,
                 prompts: list[list[int]], formatter: Formatter) -> Response:
    """Validate, start every sequence (n per prompt), and answer in full or as a stream."""
    sequences = []
    tools: ToolCalling | None = getattr(formatter, "tools", None)
    # NOTE: a parser whose markers are special tokens must see them in the text.
    skip_special_tokens = request.skip_special_tokens and not (
        tools is not None and tools.needs_special_tokens)
    for prompt in prompts:
        params = to_sampling_params(request, max_model_len=router.max_model_len,
                                    prompt_len=len(prompt), defaults=router.generation_defaults)
        if tools is not None and tools.spec is not None:  # tool_choice required / named
            params = dataclasses.replace(params, structured_output=tools.spec)
        for i in range(request.n):
            sequences.append(GenerateRequest(
                f"{formatter.response_id}-{len(sequences)}", prompt,
                dataclasses.replace(params, n=1, seed=choice_seed(params.seed, i)),
                request.stop_strings(),
                request.include_stop_str_in_output, skip_special_tokens,
                request.cache_salt))
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


class Formatter:
    """Collects one request's choices (``n`` per prompt, indexed ``prompt * n + i``) and
    writes OpenAI responses (models) and stream chunks (dicts in the stream models' shape,
    ``router/protocol.py``); subclasses write the two APIs' shapes."""

    def __init__(self, router: Router, request, response_id: str,
                 prompts: list[list[int]]) -> None:
        self.request = request
        self.response_id = response_id
        self.model = router.served_model_name
        self._decode = fast_decoder(router.tokenizer, skip_special_tokens=False)
        self.prompts = prompts
        num_choices = len(prompts) * request.n
        self.texts = [""] * num_choices
        self.logprobs: list[list] = [[] for _ in range(num_choices)]
        self.num_tokens = [0] * num_choices
        self.finish: list[tuple[str | None, int | str | None]] = [(None, None)] * num_choices
        self.cached_tokens = [0] * len(prompts)

    def add(self, index: int, chunk: GenerationChunk) -> None:
        """Record ``chunk`` of choice ``index``."""
        self.texts[index] += chunk.text
        self.logprobs[index] += chunk.logprobs
        self.num_tokens[index] += len(chunk.token_ids)
        prompt = index // self.request.n
        self.cached_tokens[prompt] = max(self.cached_tokens[prompt], chunk.num_cached_tokens)
        if chunk.finish_reason:
            self.finish[index] = (chunk.finish_reason, chunk.stop_reason)

    def usage(self) -> UsageInfo:
        """Usage so far: prompt tokens (once per prompt), generated tokens, cache hits."""
        return UsageInfo.of(sum(len(p) for p in self.prompts), sum(self.num_tokens),
                            sum(self.cached_tokens))

    def decode_token(self, token_id: int) -> str:
        """The text of one token for logprobs: ``tokenizer.decode([token_id])``."""
        return self._decode([token_id])

    def stream_start(self) -> list[dict]:
        """Chunks sent before any token (chat: each choice's role)."""
        return []

    def stream_usage(self) -> dict | None:
        """The last chunk, with only usage, when ``stream_options.include_usage``."""
        if not self.request.include_usage():
            return None
        return self._stream_response([], usage=self.usage().model_dump())


class CompletionFormatter(Formatter):
    """``text_completion`` responses; ``echo_texts`` are the prompts' texts with ``echo``."""

    def __init__(self, router: Router, request: CompletionRequest, response_id: str,
                 prompts: list[list[int]], echo_texts: list[str] | None) -> None:
        super().__init__(router, request, response_id, prompts)
        self.echo = ["" if echo_texts is None else echo_texts[i // request.n]
                     for i in range(len(self.texts))]

    def _logprobs(self, index: int, logprobs: list, text_offset: int):
        if self.request.logprobs is None:
            return None
        return completion_logprobs(logprobs, self.decode_token, text_offset)

    def stream_chunk(self, index: int, chunk: GenerationChunk) -> dict:
        """Record ``chunk`` of choice ``index``; its ``CompletionStreamResponse`` dict."""
        prefix = self.echo[index] if not self.num_tokens[index] else ""
        offset = len(self.echo[index]) + len(self.texts[index])
        self.add(index, chunk)
        logprobs = self._logprobs(index, chunk.logprobs, offset)
        return self._stream_response([completion_stream_choice(
            index, prefix + chunk.text, chunk.finish_reason, chunk.stop_reason,
            None if logprobs is None else logprobs.model_dump())])

    def _stream_response(self, choices: list[dict], usage: dict | None = None) -> dict:
        return completion_stream_chunk(self.response_id, self.model, choices, usage)

    def response(self) -> CompletionResponse:
        choices = [CompletionChoice(
            index=i, text=self.echo[i] + text, finish_reason=self.finish[i][0],
            stop_reason=self.finish[i][1],
            logprobs=self._logprobs(i, self.logprobs[i], len(self.echo[i])))
            for i, text in enumerate(self.texts)]
        return CompletionResponse(id=self.response_id, model=self.model, choices=choices,
                                  usage=self.usage())


class ChatFormatter(Formatter):
    """``chat.completion`` responses and ``chat.completion.chunk`` stream chunks; with
    ``tools``, each choice's text is read for tool calls (``ToolCalling``)."""

    def __init__(self, router: Router, request: ChatCompletionRequest, response_id: str,
                 prompts: list[list[int]], tools: ToolCalling | None = None,
                 replies: ReplyTokens | None = None) -> None:
        super().__init__(router, request, response_id, prompts)
        self.tools = tools
        self.replies = replies
        self._streams = [tools.stream() if tools else None for _ in self.texts]
        self._has_calls = [False] * len(self.texts)
        self.token_ids: list[list[int]] = [[] for _ in self.texts]

    def add(self, index: int, chunk: GenerationChunk) -> None:
        """Record ``chunk`` of choice ``index``; a finished plain-text reply's token ids
        are remembered for the next turn (``ReplyTokens``)."""
        super().add(index, chunk)
        self.token_ids[index] += chunk.token_ids
        if chunk.finish_reason and self.replies is not None and self.tools is None:
            self.replies.remember(self.texts[index], self.token_ids[index])

    def _logprobs(self, logprobs: list):
        if not self.request.logprobs:
            return None
        return chat_logprobs(logprobs, self.decode_token, self.request.top_logprobs or 0)

    def _finish_reason(self, index: int, reason: str | None) -> str | None:
        if reason == "stop" and self._has_calls[index] and self.tools.finish_as_tool_calls:
            return "tool_calls"
        return reason

    def stream_start(self) -> list[dict]:
        return [self._stream_response([chat_stream_choice(i, "", role="assistant")])
                for i in range(len(self.texts))]

    def stream_chunk(self, index: int, chunk: GenerationChunk) -> dict:
        """Record ``chunk`` of choice ``index``; its ``ChatCompletionStreamResponse`` dict."""
        self.add(index, chunk)
        logprobs = self._logprobs(chunk.logprobs)
        content, calls = chunk.text, []
        stream = self._streams[index]
        if stream is not None:
            first = len(stream.calls)
            content, new = stream.feed(chunk.text, final=chunk.finish_reason is not None)
            calls = [(first + i, call_id, c.name, c.arguments)
                     for i, (call_id, c) in enumerate(new)]
            self._has_calls[index] |= bool(stream.calls)
        return self._stream_response([chat_stream_choice(
            index, content, finish_reason=self._finish_reason(index, chunk.finish_reason),
            stop_reason=chunk.stop_reason,
            logprobs=None if logprobs is None else logprobs.model_dump(), tool_calls=calls)])

    def _stream_response(self, choices: list[dict], usage: dict | None = None) -> dict:
        return chat_stream_chunk(self.response_id, self.model, choices, usage)

    def _message(self, index: int) -> ChatResponseMessage:
        text = self.texts[index]
        if self.tools is None:
            return ChatResponseMessage(content=text)
        stream = self.tools.stream()
        content, calls = stream.feed(text, final=True)
        self._has_calls[index] = bool(calls)
        return ChatResponseMessage(content=content or (None if calls else ""), tool_calls=[
            ChatToolCall(id=call_id, function=ToolCallFunction(name=c.name, arguments=c.arguments))
            for call_id, c in calls])

    def response(self) -> ChatCompletionResponse:
        messages = [self._message(i) for i in range(len(self.texts))]
        choices = [ChatCompletionChoice(
            index=i, message=message,
            finish_reason=self._finish_reason(i, self.finish[i][0]),
            stop_reason=self.finish[i][1], logprobs=self._logprobs(self.logprobs[i]))
            for i, message in enumerate(messages)]
        return ChatCompletionResponse(id=self.response_id, model=self.model, choices=choices,
                                      usage=self.usage())
