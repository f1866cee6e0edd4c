"""The router's gRPC API (``pdserve.v1.Router``): ``Generate`` streams one completion,
``Abort`` stops one, ``Health`` and ``ListModels`` describe the service.

It runs on the same event loop and the same ``ModelService`` as the HTTP API, so both see the
same workers, routing and metrics. Errors map to status codes: UNAUTHENTICATED without an
accepted API key where keys are set (``router/api_keys.py``); INVALID_ARGUMENT for bad
input (the message names the field and the limit; the bounds are the HTTP API's,
``router/limits.py``), also for a request that does not parse (a string field that is not
UTF-8) and for a ``request_id`` that is longer than 128 characters or holds a character
outside ``[A-Za-z0-9._:-]`` (in ``Abort`` also an empty one); ALREADY_EXISTS for a
``request_id`` of a request still running on this router (ids are unique among running
requests; an empty one gets ``grpc-<hex>``); NOT_FOUND for an unknown model; UNAVAILABLE
when no worker of a needed role is live; INTERNAL, saying only "internal error" (the
stack goes to the log), for a bug or a worker's failure.

A client's side of a connection is bounded as the HTTP API's is (``router/http_server.py``;
``GRPCLimits``): its HTTP/2 preface must arrive within the header deadline; one connection
runs at most ``max_concurrent_streams`` RPCs at once (its client queues the rest); a
connection with no RPC for ``max_connection_idle_s`` is closed (GOAWAY: a client
reconnects when it next calls); and a ``Generate`` whose client takes none of its response
messages for ``send_timeout_s`` while the router has more to send (HTTP/2 flow control
holds them back once the client's window is full) ends with DEADLINE_EXCEEDED, and its
request is cancelled on the workers, instead of its tokens piling up in the router.
``pdserve:grpc_response_send_timeouts_total`` counts those. A completion that fits in the
client's window is sent whole whether or not the client reads it: grpc holds those bytes,
bounded by ``max_tokens``, until the client reads or leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
import uuid
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError
from prometheus_client import CollectorRegistry, Counter

from pdserve.cluster.wire import (
    logprob_to_proto,
    prompt_logprobs_to_proto,
    sampling_params_from_proto,
)
from pdserve.engine.structured_output import check_spec
from pdserve.engine.tokenizer import encode_prompt
from pdserve.proto import common_pb2, router_pb2, router_pb2_grpc
from pdserve.router.api_keys import AdminAuth, ApiKeyAuth, ApiKeyInterceptor
from pdserve.router.config import GRPCLimits
from pdserve.router.generate_request import GenerateRequest
from pdserve.router.limits import (
    MAX_STOP_TOKEN_IDS,
    check_request_id,
    check_stop_strings,
    check_text,
)
from pdserve.router.model_service import ModelService
from pdserve.router.protocol.errors import INTERNAL_ERROR, RequestError
from pdserve.router.protocol.validation import (
    check_field,
    check_prompt_logprobs,
    checked_sampling_params,
    fit_max_tokens,
)
from pdserve.router.served_models import ServedModels

logger = logging.getLogger(__name__)

_END, _ABORTED = object(), object()  # the end of a Generate's chunks; an Abort
_STATUS = {400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND,
           503: grpc.StatusCode.UNAVAILABLE}
_WARN_EVERY_S = 60.0  # at most one warning a minute about clients that stopped reading


class GRPCServerMetrics:
    """Metrics of the gRPC server itself: ``pdserve:grpc_response_send_timeouts_total``,
    the ``Generate`` streams ended because their client took no response message within
    ``GRPCLimits.send_timeout_s``.

    Args:
        registry: where the counter is registered (``pdserve serve`` passes the HTTP
            server's, which ``/metrics`` shows); a new one by default.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._send_timeouts = Counter(
            "pdserve:grpc_response_send_timeouts", "Generate streams ended because their "
            "client took no response message within --response-send-timeout-s",
            registry=self.registry)
        self._warned_at = -_WARN_EVERY_S
        self._warned_count = 0

    @property
    def send_timeouts(self) -> int:
        """Streams ended so far (read from the counter)."""
        return int(self.registry.get_sample_value(
            "pdserve:grpc_response_send_timeouts_total") or 0)

    def send_timed_out(self, limit_s: float) -> None:
        """Count one stream ended after ``limit_s`` seconds; warn in the log at most once
        a minute with how many ended since the last warning."""
        self._send_timeouts.inc()
        now = time.monotonic()
        if now - self._warned_at >= _WARN_EVERY_S:
            count = self.send_timeouts
            logger.warning("ended %d gRPC stream(s) whose client took no response message "
                           "within %g s", count - self._warned_count, limit_s)
            self._warned_at, self._warned_count = now, count


if sys.version_info >= (3, 11):
    async def _write_within(context, message, timeout_s: float) -> None:
        """``context.write(message)``; TimeoutError past ``timeout_s`` seconds."""
        async with asyncio.timeout(timeout_s):
            await context.write(message)
else:  # NOTE: wait_for runs the write in a task of its own: a little more per message
    async def _write_within(context, message, timeout_s: float) -> None:
        """``context.write(message)``; TimeoutError past ``timeout_s`` seconds."""
        await asyncio.wait_for(context.write(message), timeout_s)


@dataclass(eq=False)
class _Running:
    """A running ``Generate``: the queue its handler reads, the task that fills it (which
    ``Abort`` cancels), and whether its last chunk (or its error) is queued already: then
    the request has ended, though its handler may still be sending, and ``Abort`` finds
    nothing to stop."""

    chunks: asyncio.Queue
    pump: asyncio.Task | None = None
    ended: bool = False


class RouterServicer(router_pb2_grpc.RouterServicer):
    """Serves ``pdserve.v1.Router`` over ``router``, or several routers (``ServedModels``, one
    per model; a request's ``model`` picks one, the first when it names none)."""

    def __init__(self, router: ModelService | ServedModels, limits: GRPCLimits | None = None,
                 metrics: GRPCServerMetrics | None = None) -> None:
        self.routers = router if isinstance(router, ServedModels) else ServedModels([router])
        self.limits = limits or GRPCLimits()
        self.metrics = metrics or GRPCServerMetrics()
        self._running: dict[str, _Running] = {}  # request id -> its Generate

    async def Generate(self, request, context):
        if isinstance(request, UndecodableRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        try:
            router = self.routers.pick(request.model or None)
            request_id = _client_request_id(request.request_id)
            generate_request = self._to_request(request, router, _worker_request_id(
                request_id, chosen=bool(request.request_id)))
            router.check_available()
        except (RequestError, ValueError) as exc:
            await context.abort(*_status(exc))
        except Exception:
            logger.exception("Generate failed before it started")
            await context.abort(grpc.StatusCode.INTERNAL, INTERNAL_ERROR)
        if request_id in self._running:  # NOTE: no await from here to its insertion
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, (
                f"Invalid value for 'request_id': {request_id!r} is the id of a request "
                "still running on this router; request ids must be unique among running "
                "requests (one may be reused once its request has ended)"))
        # NOTE: the request runs in a task of its own, which Abort cancels (its clean-up
        # frees the request on its workers); cancelling this handler's task instead could
        # land inside grpc's send and reset the stream
        running = _Running(asyncio.Queue())
        running.pump = asyncio.create_task(self._pump(router, generate_request, running))
        self._running[request_id] = running
        num_cached = num_tokens = 0
        prompt = len(generate_request.prompt_token_ids)
        try:
            while True:
                chunk = await running.chunks.get()
                if chunk is _END:
                    return
                if chunk is _ABORTED:  # ends cleanly, as vLLM's abort does
                    await self._send(context, router_pb2.GenerateResponse(
                        request_id=request_id, finish_reason="abort",
                        usage=_usage(prompt, num_tokens, num_cached)))
                    return
                if isinstance(chunk, RequestError):
                    await context.abort(*_status(chunk))
                if isinstance(chunk, BaseException):
                    logger.error("Generate %s failed", request_id, exc_info=chunk)
                    await context.abort(grpc.StatusCode.INTERNAL, INTERNAL_ERROR)
                num_cached = max(num_cached, chunk.num_cached_tokens)
                num_tokens += len(chunk.token_ids)
                response = router_pb2.GenerateResponse(
                    request_id=request_id, text=chunk.text, token_ids=chunk.token_ids,
                    logprobs=[logprob_to_proto(lp) for lp in chunk.logprobs],
                    finish_reason=chunk.finish_reason or "")
                if chunk.prompt_logprobs is not None:
                    response.prompt_logprobs.extend(
                        prompt_logprobs_to_proto(chunk.prompt_logprobs))
                if chunk.finish_reason:
                    response.usage.CopyFrom(_usage(prompt, num_tokens, num_cached))
                await self._send(context, response)
        finally:
            if self._running.get(request_id) is running:  # not Abort's, nor a later one's
                del self._running[request_id]
            running.pump.cancel()  # the client left (or it ended): nothing keeps running

    async def _send(self, context, response) -> None:
        """Hand ``response`` to the client; past ``limits.send_timeout_s`` (it took none
        of what was sent before), end the RPC with DEADLINE_EXCEEDED."""
        limit = self.limits.send_timeout_s
        try:
            await _write_within(context, response, limit)
        except asyncio.TimeoutError:
            self.metrics.send_timed_out(limit)
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"the client took no response message within {limit:g} s "
                                "(--response-send-timeout-s)")

    async def _pump(self, router: ModelService, request: GenerateRequest,
                    running: _Running) -> None:
        """Run ``request`` on ``router``, handing its chunks (then ``_END``, or the
        exception that ended it) to ``running.chunks``; ``running.ended`` from the last."""
        try:
            async with contextlib.aclosing(router.generate(request)) as stream:
                async for chunk in stream:
                    running.chunks.put_nowait(chunk)
                    running.ended = bool(chunk.finish_reason)
            running.chunks.put_nowait(_END)
        except Exception as exc:  # noqa: BLE001 - handed to the handler
            running.chunks.put_nowait(exc)
        running.ended = True

    async def Abort(self, request, context):
        """Abort the running ``Generate`` whose id is ``request_id``; ``aborted`` says
        whether one was running. An empty or malformed id (``limits.check_request_id``)
        gets INVALID_ARGUMENT naming the field, as in ``Generate``."""
        try:
            if not request.request_id:
                raise RequestError("Invalid value for 'request_id': required, the id of "
                                   "the request to abort", param="request_id")
            check_field("request_id", check_request_id, request.request_id)
        except (RequestError, ValueError) as exc:
            await context.abort(*_status(exc))
        running = self._running.get(request.request_id)
        if running is None or running.ended:  # its last chunk is on its way already
            return router_pb2.RouterAbortResponse(aborted=False)
        del self._running[request.request_id]
        running.pump.cancel()  # closing the stream aborts the request on its workers
        running.chunks.put_nowait(_ABORTED)
        return router_pb2.RouterAbortResponse(aborted=True)

    async def Health(self, request, context):
        """The worst status of the models, and their workers added up."""
        states = [r.health() for r in self.routers]
        order = ("ok", "degraded", "unavailable")
        return router_pb2.RouterHealthResponse(
            status=max((s["status"] for s in states), key=order.index),
            num_prefill_workers=sum(s["num_prefill_workers"] for s in states),
            num_decode_workers=sum(s["num_decode_workers"] for s in states))

    async def ListModels(self, request, context):
        """Every model served (``max_model_len``: the first model's)."""
        return router_pb2.ListModelsResponse(
            models=[name for r in self.routers for name in r.served_model_names],
            max_model_len=self.routers.first.max_model_len)

    def _to_request(self, request, router: ModelService, request_id: str) -> GenerateRequest:
        """Validate and tokenize for ``router`` (the request's model's), with the HTTP
        API's bounds; ``request_id`` is the id the workers see (``_worker_request_id``).

        Raises:
            RequestError: naming the field (``text``, ``token_ids``, ``stop``,
                ``cache_salt``, ``priority``, ``stop_token_ids``, ``max_tokens``, another sampling
                parameter: 400; the rules are the HTTP API's, ``protocol/validation.py``).
        """
        prompt = self._prompt(request, router)
        stop = list(request.stop)
        cache_salt = request.cache_salt if request.HasField("cache_salt") else None
        check_field("stop", check_stop_strings, stop)
        if cache_salt is not None:
            check_field("cache_salt", check_text, cache_salt)
        params = self._sampling_params(request.sampling_params, router)
        params.max_tokens = fit_max_tokens(len(prompt), params.max_tokens,
                                           router.max_model_len, api="grpc")
        check_prompt_logprobs(len(prompt), params.prompt_logprobs, "prompt_logprobs")
        priority = check_field("priority", router.check_priority, request.priority)
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        return GenerateRequest(request_id, prompt, params, stop,
                               request.include_stop_str_in_output, skip, cache_salt, priority)

    def _prompt(self, request, router: ModelService) -> list[int]:
        """The prompt's token ids: ``text`` tokenized, or ``token_ids`` in the vocabulary."""
        kind = request.WhichOneof("prompt")
        if kind == "text":
            # NOTE: protobuf strings arrive as valid UTF-8 (an invalid one fails to parse,
            # see UndecodableRequest); the check costs little and keeps the rule in one place.
            check_field("text", check_text, request.text)
            prompt = encode_prompt(router.tokenizer, request.text)
        elif kind == "token_ids":
            prompt = list(request.token_ids.ids)
        else:
            raise RequestError("prompt is required: set text or token_ids", "prompt")
        vocab = router.vocab_size
        if not prompt or any(not 0 <= t < vocab for t in prompt):
            raise RequestError(f"prompt ({kind}) must be 1 or more token ids in [0, {vocab})",
                               kind or "prompt")
        return prompt

    @staticmethod
    def _sampling_params(msg: common_pb2.SamplingParams, router: ModelService):
        if len(msg.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise RequestError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got "
                               f"{len(msg.stop_token_ids)}", "stop_token_ids")
        params = checked_sampling_params(lambda: sampling_params_from_proto(
            msg, vocab_size=router.vocab_size, defaults=router.generation_defaults))
        if params.structured_output is not None:
            check_field("structured_output", check_spec, params.structured_output)
        return params


def _client_request_id(value: str) -> str:
    """The id a ``Generate`` answers and ``Abort`` finds its request by: the client's
    ``request_id`` once valid (``limits.check_request_id``), else a new ``grpc-<hex>``.

    Raises:
        RequestError: naming ``request_id`` and the limit it breaks (400).
    """
    if not value:
        return f"grpc-{uuid.uuid4().hex}"
    check_field("request_id", check_request_id, value)
    return value


def _worker_request_id(client_id: str, chosen: bool) -> str:
    """The id of a request on the workers. A client's own id gets a random suffix, so
    that no id a client picks can be the id of another request on a worker: one of
    another router, an HTTP request (``cmpl-<hex>-<i>``) or another request's later
    attempt (``<id>.<n>``, ``router/attempt.py``). The suffix ends in hex digits and
    every attempt id in ``.<n>``, so these never meet either."""
    return f"{client_id}-{uuid.uuid4().hex[:16]}" if chosen else client_id


@dataclass(frozen=True, slots=True)
class UndecodableRequest:
    """What ``Generate`` receives for bytes that do not parse as a ``GenerateRequest``
    (e.g. a string field that is not UTF-8, such as an encoded lone surrogate): grpc would
    answer a deserializer's exception with UNKNOWN and protobuf's internals; ``Generate``
    answers INVALID_ARGUMENT instead."""

    message: str


def _decode_generate_request(data: bytes) -> router_pb2.GenerateRequest | UndecodableRequest:
    try:
        return router_pb2.GenerateRequest.FromString(data)
    except DecodeError as exc:
        reason = str(exc).rsplit(": ", 1)[-1]  # "String field had bad UTF-8"
        return UndecodableRequest(f"the request is not a valid pdserve.v1.GenerateRequest: "
                                  f"{reason}")


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> router_pb2.Usage:
    return router_pb2.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                            total_tokens=prompt_tokens + completion_tokens,
                            cached_tokens=cached_tokens)


def _status(exc: Exception) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, RequestError):
        code = _STATUS.get(exc.status, grpc.StatusCode.INTERNAL)
        if code == grpc.StatusCode.INTERNAL:  # a worker's error: details to the log
            logger.error("Generate failed: %s", exc.message)
            return code, INTERNAL_ERROR
        return code, str(exc)
    return grpc.StatusCode.INVALID_ARGUMENT, str(exc)


def _add_router_servicer(servicer: RouterServicer, server: grpc.aio.Server) -> None:
    """``router_pb2_grpc.add_RouterServicer_to_server``, but ``Generate`` parses its own
    request (``_decode_generate_request``) so that bytes that do not parse get
    INVALID_ARGUMENT."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            servicer.Generate, request_deserializer=_decode_generate_request,
            response_serializer=router_pb2.GenerateResponse.SerializeToString),
        "Abort": grpc.unary_unary_rpc_method_handler(
            servicer.Abort, request_deserializer=router_pb2.RouterAbortRequest.FromString,
            response_serializer=router_pb2.RouterAbortResponse.SerializeToString),
        "Health": grpc.unary_unary_rpc_method_handler(
            servicer.Health, request_deserializer=common_pb2.HealthRequest.FromString,
            response_serializer=router_pb2.RouterHealthResponse.SerializeToString),
        "ListModels": grpc.unary_unary_rpc_method_handler(
            servicer.ListModels, request_deserializer=router_pb2.ListModelsRequest.FromString,
            response_serializer=router_pb2.ListModelsResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("pdserve.v1.Router", handlers),))


async def start_grpc_server(router: ModelService | ServedModels, host: str, port: int, *,
                            api_auth: ApiKeyAuth | None = None,
                            admin_auth: AdminAuth | None = None,
                            limits: GRPCLimits | None = None,
                            metrics: GRPCServerMetrics | None = None
                            ) -> tuple[grpc.aio.Server, int]:
    """Start the router's gRPC server on ``host:port`` (0: a free port); returns it and
    the bound port. With ``api_auth``, a call needs the metadata ``authorization:
    Bearer <key>`` (UNAUTHENTICATED otherwise; ``router/api_keys.py``), a client key or one
    of ``admin_auth``'s (the service has no admin method). ``limits`` (default
    ``GRPCLimits()``) bound what a client connection holds, counted in ``metrics``.
    Raises RuntimeError when the port cannot be bound."""
    limits = limits or GRPCLimits()
    # NOTE: no SO_REUSEPORT (grpc's default), so no other process can bind the port too
    # and take a share of the connections
    server = grpc.aio.server(
        options=[("grpc.so_reuseport", 0), *limits.server_options()],
        interceptors=None if api_auth is None else [ApiKeyInterceptor(api_auth, admin_auth)])
    _add_router_servicer(RouterServicer(router, limits, metrics), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"cannot bind the router's gRPC server to {host}:{port}")
    await server.start()
    return server, bound
