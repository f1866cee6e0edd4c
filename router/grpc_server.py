"""The router's gRPC API (``pdserve.v1.Router``): ``Generate`` streams one completion,
``Abort`` stops one, ``Health`` and ``ListModels`` describe the service.

It runs on the same event loop and the same ``Router`` as the HTTP API, so both see the
same workers, routing and metrics. Errors map to status codes: INVALID_ARGUMENT for bad
input (the message names the field and the limit), NOT_FOUND for an unknown model,
UNAVAILABLE when no worker of a needed role is live.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import grpc

from pdserve.cluster.wire import logprob_to_proto, sampling_params_from_proto
from pdserve.engine.tokenizer import encode_prompt
from pdserve.proto import router_pb2, router_pb2_grpc
from pdserve.router.protocol import RequestError
from pdserve.router.service import GenerateRequest, Router

_STATUS = {400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND,
           503: grpc.StatusCode.UNAVAILABLE}


class RouterServicer(router_pb2_grpc.RouterServicer):
    """Serves ``pdserve.v1.Router`` over ``router``."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self._running: dict[str, asyncio.Task] = {}
        self._aborted: set[str] = set()  # ids whose Generate an Abort is cancelling

    async def Generate(self, request, context):
        try:
            generate_request = self._to_request(request)
            self.router.check_available()
        except (RequestError, ValueError) as exc:
            await context.abort(*_status(exc))
        request_id = generate_request.request_id
        self._running[request_id] = asyncio.current_task()
        num_cached = num_tokens = 0
        prompt = len(generate_request.prompt_token_ids)
        try:
            async with contextlib.aclosing(self.router.generate(generate_request)) as chunks:
                async for chunk in chunks:
                    num_cached = max(num_cached, chunk.num_cached_tokens)
                    num_tokens += len(chunk.token_ids)
                    response = router_pb2.GenerateResponse(
                        request_id=request_id, text=chunk.text, token_ids=chunk.token_ids,
                        logprobs=[logprob_to_proto(lp) for lp in chunk.logprobs],
                        finish_reason=chunk.finish_reason or "")
                    if chunk.finish_reason:
                        response.usage.CopyFrom(_usage(prompt, num_tokens, num_cached))
                    yield response
        except RequestError as exc:
            await context.abort(*_status(exc))
        except asyncio.CancelledError:
            if request_id not in self._aborted:
                raise
            # Abort: the request is freed on its workers (the stream above was closed);
            # the client's stream ends cleanly, as vLLM's does, with finish_reason "abort"
            self._aborted.discard(request_id)
            yield router_pb2.GenerateResponse(
                request_id=request_id, finish_reason="abort",
                usage=_usage(prompt, num_tokens, num_cached))
        finally:
            self._running.pop(request_id, None)

    async def Abort(self, request, context):
        task = self._running.pop(request.request_id, None)
        if task is not None:
            self._aborted.add(request.request_id)
            task.cancel()  # closing the stream aborts the request on its workers
        return router_pb2.RouterAbortResponse(aborted=task is not None)

    async def Health(self, request, context):
        state = self.router.health()
        return router_pb2.RouterHealthResponse(
            status=state["status"], num_prefill_workers=state["num_prefill_workers"],
            num_decode_workers=state["num_decode_workers"])

    async def ListModels(self, request, context):
        return router_pb2.ListModelsResponse(models=[self.router.served_model_name],
                                             max_model_len=self.router.max_model_len)

    def _to_request(self, request) -> GenerateRequest:
        """Validate and tokenize. Raises RequestError naming the field."""
        if request.model and request.model != self.router.served_model_name:
            raise RequestError(f"The model `{request.model}` does not exist.", "model", 404)
        kind = request.WhichOneof("prompt")
        if kind == "text":
            prompt = encode_prompt(self.router.tokenizer, request.text)
        elif kind == "token_ids":
            prompt = list(request.token_ids.ids)
        else:
            raise RequestError("prompt is required: set text or token_ids", "prompt")
        vocab = self.router.vocab_size
        if not prompt or any(not 0 <= t < vocab for t in prompt):
            raise RequestError(f"prompt must be 1 or more token ids in [0, {vocab})", "prompt")
        params = sampling_params_from_proto(request.sampling_params)
        limit = self.router.max_model_len
        room = limit - len(prompt)
        if params.max_tokens is None:
            params.max_tokens = room
        if room < 1 or params.max_tokens > room:
            raise RequestError(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {len(prompt) + params.max_tokens} tokens ({len(prompt)} in the "
                f"prompt, {params.max_tokens} in the completion).", "max_tokens")
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        return GenerateRequest(
            request.request_id or f"grpc-{uuid.uuid4().hex}", prompt, params,
            list(request.stop), request.include_stop_str_in_output, skip,
            request.cache_salt if request.HasField("cache_salt") else None)


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> router_pb2.Usage:
    return router_pb2.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                            total_tokens=prompt_tokens + completion_tokens,
                            cached_tokens=cached_tokens)


def _status(exc: Exception) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, RequestError):
        return _STATUS.get(exc.status, grpc.StatusCode.INTERNAL), str(exc)
    return grpc.StatusCode.INVALID_ARGUMENT, str(exc)


async def start_grpc_server(router: Router, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """Start the router's gRPC server on ``host:port`` (0: a free port); returns it and
    the bound port. Raises RuntimeError when the port cannot be bound."""
    server = grpc.aio.server()
    router_pb2_grpc.add_RouterServicer_to_server(RouterServicer(router), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"cannot bind the router's gRPC server to {host}:{port}")
    await server.start()
    return server, bound
