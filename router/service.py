"""The router's request lifecycle (DESIGN.md, A request's path): live workers and their
loads, routing, Prefill then streaming Decode, detokenization, stop strings, aborts and
one retry.

A request's life here::

    route (prefix-index lookup, choose_prefill_worker, choose_decode_worker)
      -> Prefill (first token yielded at once: TTFT)    [skipped below the local threshold]
      -> Decode stream (detokenized, stop strings applied)
      -> finish; or on cancellation: Abort the decode, Release the prefill's KV lease

A worker answering UNAVAILABLE before any token was yielded is left out and the request
runs once more on the others. Every RPC has a timeout (``RouterConfig``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from pdserve.cluster.prefix_index import PrefixIndex, PrefixIndexUnavailable
from pdserve.cluster.registry import WorkerRegistry
from pdserve.cluster.wire import logprob_from_proto, sampling_params_to_proto
from pdserve.engine.block_hash import hash_block_chain, root_block_hash
from pdserve.engine.request import Logprob
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tokenizer import load_tokenizer
from pdserve.proto import decode_pb2, prefill_pb2
from pdserve.router.detokenizer import IncrementalDetokenizer, StopChecker
from pdserve.router.metrics import RouterMetrics
from pdserve.router.protocol import RequestError
from pdserve.router.routing import (
    choose_decode_worker,
    choose_prefill_worker,
    should_prefill_locally,
)
from pdserve.router.workers import WorkerHandle, WorkerPool

logger = logging.getLogger(__name__)

# NOTE: a prompt shorter than one block has no full block to reuse from any prefix cache
# and costs the decode worker about one step to prefill, less than a KV transfer.
DEFAULT_LOCAL_PREFILL_THRESHOLD = 16


@dataclass(slots=True)
class RouterConfig:
    """Router settings. Times in seconds; ``max_model_len`` defaults to the checkpoint's
    ``max_position_embeddings``; prompts under ``local_prefill_threshold`` tokens are
    prefilled on the decode worker (0: never)."""

    model: str
    redis_url: str
    served_model_name: str | None = None
    block_size: int = 16
    max_model_len: int | None = None
    local_prefill_threshold: int = DEFAULT_LOCAL_PREFILL_THRESHOLD
    overlap_weight: float = 1.0
    registry_interval_s: float = 1.0
    health_interval_s: float = 0.5
    health_timeout_s: float = 1.0
    control_timeout_s: float = 5.0  # Abort, Release
    prefill_timeout_s: float = 120.0
    request_timeout_s: float = 600.0  # a whole Decode stream
    retry_after_s: int = 1


@dataclass(slots=True)
class GenerateRequest:
    """One sequence to generate: token ids, engine parameters, and the router's own
    options (stop strings, detokenization, ``cache_salt``)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    cache_salt: str | None = None


@dataclass(slots=True)
class GenerationChunk:
    """What one step added: text (stop strings applied), token ids, logprobs; at the end
    ``finish_reason`` (``stop`` or ``length``) and ``stop_reason`` (token id or string).
    ``num_cached_tokens`` is the prompt's prefix-cache hit (tokens)."""

    text: str
    token_ids: list[int]
    logprobs: list[Logprob]
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(slots=True)
class _Route:
    prefill: WorkerHandle | None
    decode: WorkerHandle


@dataclass(slots=True)
class _Live:
    """What one attempt holds on the workers, for cleanup."""

    prefill: WorkerHandle | None = None
    decode: WorkerHandle | None = None
    kv_held: bool = False  # the prefill worker pins KV that no decode has taken yet
    decode_done: bool = False  # the decode worker finished the request itself
    failed_worker: str | None = None


class Router:
    """Routes and runs requests on the cluster in ``config.redis_url``.

    ``await start()`` before use, ``await stop()`` after. ``generate`` yields
    ``GenerationChunk``s of one sequence.

    Raises (``generate``):
        RequestError: 503 when no worker of a needed role is live or all failed; 400 when
            a worker refuses the input; 500 for other worker errors.
    """

    def __init__(self, config: RouterConfig, tokenizer=None) -> None:
        self.config = config
        self.served_model_name = config.served_model_name or config.model
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.model)
        model_config = json.loads((Path(config.model) / "config.json").read_text())
        self.max_model_len = config.max_model_len or model_config["max_position_embeddings"]
        self.vocab_size = int(model_config.get("vocab_size", len(self.tokenizer)))
        self.metrics = RouterMetrics(self.served_model_name)
        self.pool = WorkerPool(WorkerRegistry(config.redis_url), config)
        self.index = PrefixIndex(config.redis_url)
        self._root_hash = root_block_hash(self.served_model_name, config.block_size)
        self._rotation = itertools.count()
        self._index_down = False
        self._tasks: set[asyncio.Task] = set()
        self._pool_task: asyncio.Task | None = None

    async def start(self) -> None:
        """Read the live workers and their loads, then keep them fresh in the background."""
        await self.pool.refresh()
        await self.pool.poll_health()
        self._pool_task = asyncio.create_task(self.pool.run())

    async def stop(self) -> None:
        """Stop the background refresh, wait for pending cleanups, close channels."""
        if self._pool_task is not None:
            self._pool_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pool_task
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=self.config.control_timeout_s)
        await self.pool.close()
        self.index.close()

    def check_available(self) -> None:
        """Raises ``RequestError(503)`` when no decode worker (or, with local prefill
        off, no prefill worker) is live."""
        for role in ("decode", "prefill"):
            if role == "prefill" and self.config.local_prefill_threshold >= self.max_model_len:
                continue
            if not self.pool.live(role):
                raise RequestError(f"no live {role} worker; retry later", status=503)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerationChunk]:
        """Run ``request``; yield chunks until one carries ``finish_reason``. Closing the
        iterator early (client gone) aborts the request on its workers."""
        metrics = self.metrics.request()
        self.metrics.num_requests_waiting.inc()
        waiting, finish, exclude, sent_any = True, "abort", set(), False
        try:
            for attempt in range(2):
                live = _Live()
                try:
                    route = await self._route(request, exclude)
                    async with contextlib.aclosing(self._run(request, route, live)) as chunks:
                        async for chunk in chunks:
                            if waiting:
                                waiting = False
                                self.metrics.num_requests_waiting.dec()
                                self.metrics.num_requests_running.inc()
                            sent_any = True
                            metrics.on_tokens(len(chunk.token_ids))
                            finish = chunk.finish_reason or finish
                            yield chunk
                    return
                except grpc.aio.AioRpcError as exc:
                    if exc.code() != grpc.StatusCode.UNAVAILABLE or sent_any or attempt:
                        raise _request_error(exc) from exc
                    logger.warning("worker %s unavailable, retrying %s elsewhere: %s",
                                   live.failed_worker, request.request_id, exc.details())
                    exclude.add(live.failed_worker)
                    self.metrics.request_retries.inc()
                finally:
                    self._cleanup(request.request_id, live)
        finally:
            gauge = self.metrics.num_requests_waiting if waiting else \
                self.metrics.num_requests_running
            gauge.dec()
            metrics.on_finish(finish, num_prompt_tokens=len(request.prompt_token_ids))

    async def _route(self, request: GenerateRequest, exclude: set[str]) -> _Route:
        decodes = self.pool.live("decode", exclude)
        if not decodes:
            raise RequestError("no live decode worker; retry later", status=503)
        decode_id = choose_decode_worker([w.current_load() for w in decodes],
                                         rotation=next(self._rotation))
        decode = next(w for w in decodes if w.worker_id == decode_id)
        decode.num_routed += 1
        self.metrics.record_routing("decode", decode_id)
        prompt = request.prompt_token_ids
        if should_prefill_locally(len(prompt), self.config.local_prefill_threshold):
            return _Route(None, decode)
        prefills = self.pool.live("prefill", exclude)
        if not prefills:
            raise RequestError("no live prefill worker; retry later", status=503)
        hashes = hash_block_chain(prompt, self.config.block_size, self._root_hash,
                                  request.cache_salt)
        overlaps = await self._lookup(hashes)
        choice = choose_prefill_worker(len(hashes), overlaps,
                                       [w.current_load() for w in prefills],
                                       self.config.overlap_weight, rotation=next(self._rotation))
        prefill = next(w for w in prefills if w.worker_id == choice.worker_id)
        prefill.num_routed += 1
        self.metrics.record_routing("prefill", choice.worker_id)
        return _Route(prefill, decode)

    async def _lookup(self, hashes: list[bytes]) -> dict[str, int]:
        """Leading cached blocks per worker; ``{}`` (route by load) when Redis is down."""
        if not hashes:
            return {}
        try:
            overlaps = await asyncio.to_thread(self.index.longest_prefix, hashes,
                                               self.pool.all_ids())
        except PrefixIndexUnavailable as exc:
            if not self._index_down:
                logger.warning("prefix index unreachable, routing by load alone: %s", exc)
            self._index_down = True
            self.metrics.record_index_lookup("unavailable")
            return {}
        if self._index_down:
            logger.info("prefix index reachable again")
        self._index_down = False
        self.metrics.record_index_lookup("hit" if overlaps else "miss")
        return overlaps

    async def _run(self, request: GenerateRequest, route: _Route, live: _Live
                   ) -> AsyncIterator[GenerationChunk]:
        """One attempt: Prefill (unless local), then the Decode stream."""
        output = _Output(self.tokenizer, request)
        wire_params = sampling_params_to_proto(request.params)
        salt = {"cache_salt": request.cache_salt} if request.cache_salt else {}
        decode_request = decode_pb2.DecodeRequest(
            request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
            sampling_params=wire_params, **salt)
        if route.prefill is not None:
            live.prefill, live.failed_worker = route.prefill, route.prefill.worker_id
            reply = await route.prefill.stub.Prefill(prefill_pb2.PrefillRequest(
                request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
                sampling_params=wire_params, **salt), timeout=self.config.prefill_timeout_s)
            live.kv_held = reply.HasField("kv_handle")
            output.num_cached_tokens = reply.num_cached_tokens
            self.metrics.record_prefix_cache(len(request.prompt_token_ids),
                                             reply.num_cached_tokens)
            first_lp = reply.first_logprob if reply.HasField("first_logprob") else None
            chunk = output.add([reply.first_token_id],
                               [logprob_from_proto(first_lp)] if first_lp else [],
                               reply.finish_reason, _stop_reason(reply))
            yield chunk
            if chunk.finish_reason:
                return
            decode_request.first_token_id = reply.first_token_id
            if first_lp is not None:
                decode_request.first_logprob.CopyFrom(first_lp)
            decode_request.kv_handle.CopyFrom(reply.kv_handle)
        live.decode, live.failed_worker = route.decode, route.decode.worker_id
        call = route.decode.stub.Decode(decode_request, timeout=self.config.request_timeout_s)
        try:
            async for message in call:
                live.kv_held = False  # the decode worker has the KV (or ended the lease)
                live.decode_done = bool(message.finish_reason)
                if route.prefill is None and message.num_cached_tokens:
                    output.num_cached_tokens = message.num_cached_tokens
                if not message.token_ids and not message.finish_reason:
                    continue
                chunk = output.add(list(message.token_ids),
                                   [logprob_from_proto(lp) for lp in message.logprobs],
                                   message.finish_reason, _stop_reason(message))
                yield chunk
                if chunk.finish_reason:
                    return
        finally:
            call.cancel()

    def _cleanup(self, request_id: str, live: _Live) -> None:
        """Abort an unfinished decode and release an untaken KV lease, in the background."""
        if live.decode is not None and not live.decode_done:
            self._spawn(live.decode.stub.Abort(decode_pb2.AbortRequest(request_id=request_id),
                                               timeout=self.config.control_timeout_s))
        if live.prefill is not None and live.kv_held:
            self._spawn(live.prefill.stub.Release(
                prefill_pb2.ReleaseRequest(request_id=request_id),
                timeout=self.config.control_timeout_s))

    def _spawn(self, rpc) -> None:
        async def run() -> None:
            try:
                await rpc
            except grpc.aio.AioRpcError as exc:
                logger.info("cleanup RPC failed: %s", exc.details())

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


class _Output:
    """Detokenizes one sequence's tokens and applies its stop strings."""

    def __init__(self, tokenizer, request: GenerateRequest) -> None:
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, request.prompt_token_ids, skip_special_tokens=request.skip_special_tokens)
        self.stop = StopChecker(request.stop,
                                include_stop_str_in_output=request.include_stop_str_in_output)
        self.num_cached_tokens = 0

    def add(self, token_ids: list[int], logprobs: list[Logprob], finish_reason: str,
            stop_reason: int | None) -> GenerationChunk:
        """The chunk for new tokens; ``finish_reason`` is the worker's (``""`` if running).

        Raises:
            RequestError: the worker aborted the request (503).
        """
        text = self.detokenizer.add_tokens(token_ids)
        if finish_reason:
            text += self.detokenizer.flush()
        result = self.stop.process(text)
        chunk = GenerationChunk(result.text, token_ids, logprobs, self.num_cached_tokens)
        if result.stopped:
            chunk.finish_reason, chunk.stop_reason = "stop", result.stop_str
        elif finish_reason == "abort":
            raise RequestError("the worker aborted the request; retry later", status=503)
        elif finish_reason:
            chunk.text += self.stop.flush()
            chunk.finish_reason, chunk.stop_reason = finish_reason, stop_reason
        return chunk


def _stop_reason(message) -> int | None:
    return message.stop_reason if message.HasField("stop_reason") else None


def _request_error(exc: grpc.aio.AioRpcError) -> RequestError:
    """The HTTP-facing error for a failed worker RPC."""
    code = exc.code()
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return RequestError(exc.details() or "invalid request")
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.RESOURCE_EXHAUSTED):
        return RequestError(f"worker unavailable: {exc.details()}", status=503)
    return RequestError(f"worker error ({code.name}): {exc.details()}", status=500)
