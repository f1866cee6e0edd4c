"""``ModelService``: the router's request lifecycle for one served model (docs/architecture.md,
A request's path; Lifecycle and failure): admission, routing, Prefill then streaming Decode,
detokenization, stop strings, aborts, retries and migration.

A request's life here::

    admit (503 + Retry-After past the caps, before any work)
      -> route (prefix-index lookup, choose_prefill_worker, choose_decode_worker)
      -> Prefill (first token yielded at once: TTFT)    [skipped below the local threshold]
      -> Decode stream (detokenized, stop strings applied)
      -> finish; or on cancellation: the Decode is cancelled (the worker aborts it) and an
         untaken KV lease is released

Failure is a path (STYLE.md 13). Each attempt that fails is followed by another, up to
``migration_limit`` more, and the client sees one unbroken stream:

- a prefill worker that fails (UNAVAILABLE, DEADLINE_EXCEEDED, ...) is left out and the
  prompt goes to another one, or is prefilled on the decode worker when none is left;
- a decode worker that fails before its first message is left out and another one pulls
  the same still-leased KV (at most twice); one that fails later, or a pull that fails
  (FAILED_PRECONDITION), is followed by a migration: another decode worker gets the
  prompt and the tokens generated so far (``resume_token_ids``), prefills them locally
  and goes on. Per-position seeds make the continuation the same tokens, up to
  rounding (``docs/architecture.md``, Lifecycle and failure);
- RESOURCE_EXHAUSTED (no free blocks) leaves that worker out; INVALID_ARGUMENT is the
  client's error (400) and is never retried.

A slow worker is not a failed one: Prefill and the decode stream have no deadline while
their worker answers Health (``RouterConfig``: each call silent for ``stall_interval_s``
asks; no answer within a bounded number of tries fails the attempt). Every other RPC has
a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator

from pdserve.cluster import block_index
from pdserve.cluster.prefix_follower import LocalPrefixIndex
from pdserve.cluster.prefix_index import PrefixIndex, PrefixIndexUnavailable
from pdserve.cluster.registry import WorkerRegistry
from pdserve.engine import structured_output
from pdserve.engine.block_hash import hash_block_chain, root_block_hash
from pdserve.engine.config import ModelConfig
from pdserve.engine.generation_config import GenerationDefaults
from pdserve.engine.tokenizer import load_tokenizer, read_chat_template
from pdserve.router.attempt import AttemptFailed, Progress, WorkerCalls
from pdserve.router.config import RouterConfig
from pdserve.router.generate_request import GenerateRequest
from pdserve.router.metrics import RouterMetrics
from pdserve.router.output import GenerationChunk, SequenceOutput
from pdserve.router.protocol import RequestError
from pdserve.router.routing_policy import (
    PrefillPath,
    choose_decode_worker,
    choose_prefill_path,
    choose_prefill_worker,
    shares_compute,
    should_prefill_locally,
)
from pdserve.router.workers import WorkerHandle, WorkerPool

logger = logging.getLogger(__name__)

class ModelService:
    """One served model's requests, routed and run on the cluster in ``config.redis_url``.

    ``await start()`` before use, ``await stop()`` after. ``check_available`` admits a
    request; ``generate`` yields ``GenerationChunk``s of one sequence.

    Raises (``check_available``, ``generate``):
        RequestError: 503 when no worker of a needed role is live, past the admission
            caps, or when every attempt failed; 400 when a worker refuses the input.
            Messages are short sentences for clients, never internals.
    """

    def __init__(self, config: RouterConfig, tokenizer=None) -> None:
        self.config = config
        self.served_model_name = config.served_model_name or config.model
        self.served_model_names = (self.served_model_name, *config.served_model_aliases)
        if tokenizer is None:
            tokenizer = load_tokenizer(config.tokenizer or config.model,
                                       chat_template=read_chat_template(config.chat_template))
        self.tokenizer = tokenizer
        model_config = ModelConfig.from_pretrained(config.model,
                                                   max_model_len=config.max_model_len)
        self.max_model_len = model_config.max_model_len
        self.vocab_size = model_config.vocab_size
        self.generation_defaults = GenerationDefaults.load(config.model,
                                                           config.generation_config)
        if self.generation_defaults.as_dict():
            logger.info("%s: requests that leave them unset sample with the model's "
                        "generation config: %s (--generation-config vllm ignores it)",
                        self.served_model_name, self.generation_defaults.as_dict())
        self.metrics = RouterMetrics(self.served_model_name)
        self.pool = WorkerPool(WorkerRegistry(config.redis_url, auth=config.auth), config,
                               self.metrics)
        self.index = _prefix_index(config.redis_url)
        self.pool.on_worker_removed = self._forget_worker
        self.pool.on_registry_read = self._retain_workers
        self._root_hash = root_block_hash(self.served_model_name, config.block_size,
                                          config.kv_cache_dtype)
        # NOTE: one rotation per role: a shared counter advanced twice per request makes
        # every tie of two workers fall the same way in both pools.
        self._rotation = {"prefill": itertools.count(), "decode": itertools.count()}
        self._index_down = False
        self._num_waiting = 0  # admitted requests without their first token yet
        self.calls = WorkerCalls(config, self.pool, self.metrics)
        self._pool_task: asyncio.Task | None = None

    async def start(self) -> None:
        """Read the live workers and their loads, then keep them fresh in the background."""
        # NOTE: checking a structured output imports xgrammar; do it now, off the loop.
        asyncio.get_running_loop().run_in_executor(None, structured_output.preload)
        if isinstance(self.index, LocalPrefixIndex):
            self.index.start()
            await asyncio.to_thread(self.index.wait_loaded, 2.0)
        await self.pool.refresh()
        await self.pool.poll_health()
        self._pool_task = asyncio.create_task(self.pool.run())

    async def stop(self) -> None:
        """Stop the background refresh, wait for pending cleanups, close channels."""
        if self._pool_task is not None:
            self._pool_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pool_task
        await self.calls.wait_idle(self.calls.cleanup_bound_s)
        await self.pool.close()
        self.index.close()

    @property
    def validation_context(self) -> dict:
        """The ``context`` request models validate with (token ids within the vocabulary)."""
        return {"vocab_size": self.vocab_size}

    def health(self) -> dict:
        """The router's state for ``/health``: ``status`` is ``ok``, ``degraded`` (the
        registry or prefix index is unreachable, or the prefill pool is empty while
        prompts are prefilled on decode workers) or ``unavailable`` (no live decode
        worker); pool sizes; the registry and prefix index as ``ok`` / ``unreachable``."""
        num_prefill, num_decode = len(self.pool.live("prefill")), len(self.pool.live("decode"))
        registry = "unreachable" if self.pool.registry_down else "ok"
        index = "unreachable" if self._index_down else "ok"
        if not num_decode:
            status = "unavailable"
        elif registry != "ok" or index != "ok" or (not num_prefill and self._uses_prefill):
            status = "degraded"
        else:
            status = "ok"
        return {"status": status, "num_prefill_workers": num_prefill,
                "num_decode_workers": num_decode, "registry": registry, "prefix_index": index,
                "num_requests_waiting": self._num_waiting}

    @property
    def _uses_prefill(self) -> bool:
        return self.config.local_prefill_threshold < self.max_model_len

    def check_available(self, num_sequences: int = 1) -> None:
        """Admit a request of ``num_sequences`` sequences, before any work is done for it.

        Raises:
            RequestError: 503 when no decode worker is live, when ``max_waiting_requests``
                would be passed, or when every live worker of a pool the request needs is
                at its cap (``RouterConfig``). With no live prefill worker at all, prompts
                are prefilled on the decode workers instead.
        """
        if not self.pool.live("decode"):
            raise RequestError("no live decode worker; retry later", status=503)
        self._check_waiting(num_sequences)
        if not self._open_workers("decode"):
            self.metrics.record_rejection("decode_pool_full")
            raise RequestError("every decode worker is at capacity; retry later", status=503)
        if self._uses_prefill and self.pool.live("prefill") and not self._open_workers("prefill"):
            self.metrics.record_rejection("prefill_pool_full")
            raise RequestError("every prefill worker is at capacity; retry later", status=503)

    def _check_waiting(self, num_new: int) -> None:
        """Raises RequestError(503) if ``num_new`` more waiting sequences would pass
        ``max_waiting_requests``."""
        if self._num_waiting + num_new > self.config.max_waiting_requests:
            self.metrics.record_rejection("max_waiting_requests")
            raise RequestError(
                f"the server is overloaded: {self._num_waiting} requests are waiting for "
                f"their first token (limit {self.config.max_waiting_requests}); retry later",
                status=503)

    def _open_workers(self, role: str, exclude: set[str] = frozenset()) -> list[WorkerHandle]:
        """Live workers of ``role`` below their admission caps."""
        config = self.config
        if role == "prefill":
            return [w for w in self.pool.live(role, exclude)
                    if w.admission_count() < config.prefill_max_inflight]
        return [w for w in self.pool.live(role, exclude)
                if w.admission_count() < config.decode_max_inflight
                and w.load.kv_cache_usage < config.decode_max_kv_usage]

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerationChunk]:
        """Run ``request``; yield chunks until one carries ``finish_reason``. Closing the
        iterator early (client gone) aborts the request on its workers and releases any
        KV lease it holds. Failed attempts are retried or migrated (module docstring)."""
        self._check_waiting(1)  # NOTE: exact here: no await between it and the count
        metrics = self.metrics.request()
        self.metrics.num_requests_waiting.inc()
        self._num_waiting += 1
        output = SequenceOutput(self.tokenizer, request.prompt_token_ids, request.stop,
                                request.include_stop_str_in_output, request.skip_special_tokens)
        progress, exclude = Progress(), set()
        waiting, finish = True, "abort"
        try:
            while True:
                try:
                    async with contextlib.aclosing(
                            self._attempt(request, progress, output, exclude)) as chunks:
                        async for chunk in chunks:
                            if waiting:
                                waiting = False
                                self._num_waiting -= 1
                                self.metrics.num_requests_waiting.dec()
                                self.metrics.num_requests_running.inc()
                            metrics.on_tokens(len(chunk.token_ids))
                            finish = chunk.finish_reason or finish
                            yield chunk
                    return
                except AttemptFailed as failure:
                    self._on_attempt_failed(request, progress, failure)
        finally:
            if waiting:
                self._num_waiting -= 1
            self.calls.release_kv(request, progress)
            gauge = self.metrics.num_requests_waiting if waiting else \
                self.metrics.num_requests_running
            gauge.dec()
            metrics.on_finish(finish, num_prompt_tokens=len(request.prompt_token_ids))

    def _on_attempt_failed(self, request: GenerateRequest, progress: Progress,
                           failure: AttemptFailed) -> None:
        """Log and count a failed attempt; raises RequestError(503) past the limit."""
        if progress.num_attempts > self.config.migration_limit:
            logger.warning("request %s failed after %d attempts; last: %s", request.request_id,
                           progress.num_attempts, failure)
            raise RequestError(f"the request failed on {progress.num_attempts} workers in a "
                               "row; retry later", status=503) from failure
        if progress.generated:
            kind = "migration"
            self.metrics.request_migrations.inc()
        else:
            kind = "retry"
            self.metrics.request_retries.inc()
        logger.warning("%s of %s after %d tokens: %s", kind, request.request_id,
                       len(progress.generated), failure)

    async def _attempt(self, request: GenerateRequest, progress: Progress,
                       output: SequenceOutput, exclude: set[str]
                       ) -> AsyncIterator[GenerationChunk]:
        """One attempt: route, Prefill (unless local, resumed or already leased), Decode.

        Raises:
            AttemptFailed: a worker failed; ``exclude`` and ``progress`` say what is left.
        """
        first = progress.num_attempts == 0
        progress.num_attempts += 1
        # NOTE: a worker's num_inflight counts a request from the moment it is chosen, in
        # the same step as the cap check, so a burst cannot pass a cap between two polls
        fresh = not progress.generated and progress.kv is None  # a prompt to prefill
        hashes, overlaps = await self._prefix_lookup(request) if fresh else ([], {})
        decode = self._choose_decode(exclude, admit=first, overlaps=overlaps,
                                     num_tokens=len(request.prompt_token_ids))
        decode.num_inflight += 1
        try:
            prefill = None
            if fresh:
                prefill = await self._choose_prefill(request, decode, exclude, first,
                                                     hashes, overlaps)
            if prefill is not None:
                chunk = await self.calls.prefill(request, prefill, decode, progress, output,
                                                 exclude)
                yield chunk
                if chunk.finish_reason:
                    return
            async for chunk in self.calls.decode(request, decode, progress, output, exclude):
                yield chunk
        finally:
            decode.num_inflight -= 1

    async def _prefix_lookup(self, request: GenerateRequest
                             ) -> tuple[list[bytes], dict[str, int]]:
        """The prompt's block hashes and, per worker, how many leading ones it caches
        (the Redis prefix index; ``{}`` while it is down or for a prompt under a block)."""
        if len(request.prompt_token_ids) < self.config.block_size:
            return [], {}
        hashes = _hash_chain(request.prompt_token_ids, self.config.block_size,
                             self._root_hash, request.cache_salt)
        return hashes, await self._lookup(hashes)

    def _choose_decode(self, exclude: set[str], admit: bool, overlaps: dict[str, int],
                       num_tokens: int) -> WorkerHandle:
        """The decode worker: the one caching most of the prompt when that is at least
        half of it (and more than ``local_prefill_threshold`` tokens), else by load
        (``routing.choose_decode_worker``)."""
        workers = self._open_workers("decode", exclude) if admit else \
            self.pool.live("decode", exclude)
        if not workers:
            if admit and self.pool.live("decode", exclude):
                self.metrics.record_rejection("decode_pool_full")
                raise RequestError("every decode worker is at capacity; retry later",
                                   status=503)
            raise RequestError("no live decode worker; retry later", status=503)
        cached = {w.worker_id: min(overlaps.get(w.worker_id, 0) * self.config.block_size,
                                   num_tokens) for w in workers}
        worker_id = choose_decode_worker(
            [w.current_load() for w in workers], rotation=next(self._rotation["decode"]),
            cached_tokens=cached,
            min_cached_tokens=max(self.config.local_prefill_threshold, num_tokens // 2, 1))
        worker = next(w for w in workers if w.worker_id == worker_id)
        worker.num_routed += 1
        self.metrics.record_routing("decode", worker_id)
        return worker

    async def _choose_prefill(self, request: GenerateRequest, decode: WorkerHandle,
                              exclude: set[str], admit: bool, hashes: list[bytes],
                              overlaps: dict[str, int]) -> WorkerHandle | None:
        """The prefill worker for ``request``, or None to prefill on the decode worker
        ``decode`` (conditional disaggregation, ``RouterConfig.disaggregation``); the
        choice is counted in ``pdserve:prefill_path``.

        Raises:
            RequestError: 503 when ``disaggregation="always"`` and every prefill worker
                is at its cap (in ``"auto"`` the prompt is prefilled locally instead).
        """
        num_tokens = len(request.prompt_token_ids)
        always = self.config.disaggregation == "always"
        live = self.pool.live("prefill", exclude)
        if not live or should_prefill_locally(num_tokens, self.config.local_prefill_threshold):
            self.metrics.record_prefill_path("short_prompt" if live else "no_prefill_worker")
            return None
        candidates = {w.worker_id for w in live
                      if always or not shares_compute(decode.record.compute, w.record.compute)}
        open_workers = self._open_workers("prefill", exclude) if admit else live
        workers = [w for w in open_workers if w.worker_id in candidates]
        if always and not workers:
            self.metrics.record_rejection("prefill_pool_full")
            raise RequestError("every prefill worker is at capacity; retry later",
                               status=503)
        choice = None
        if workers and self.config.prefill_routing == "round-robin":
            loads = sorted((w.current_load() for w in workers), key=lambda w: w.worker_id)
            turn = loads[next(self._rotation["prefill"]) % len(loads)]
            choice = choose_prefill_worker(len(hashes), overlaps, [turn], 0.0)
        elif workers:
            choice = choose_prefill_worker(len(hashes), overlaps,
                                           [w.current_load() for w in workers],
                                           self.config.overlap_weight,
                                           rotation=next(self._rotation["prefill"]))
        worker = None if choice is None else \
            next(w for w in workers if w.worker_id == choice.worker_id)
        if always:
            path = PrefillPath(choice.worker_id, "remote")
        elif candidates and worker is None:  # every prefill worker it may use is at its cap
            path = PrefillPath(None, "prefill_busy")
        else:
            decode_cached = min(overlaps.get(decode.worker_id, 0) * self.config.block_size,
                                num_tokens)
            path = choose_prefill_path(
                num_tokens, decode_cached, self.config.local_prefill_threshold,
                decode.record.compute, {w.worker_id: w.record.compute for w in live}, choice,
                None if worker is None else worker.current_load(),
                self.config.max_prefill_queue_size)
        self.metrics.record_prefill_path(path.reason)
        if path.prefill_worker_id is None:
            return None
        worker.num_routed += 1
        worker.num_inflight += 1  # given back by _prefill, called right after
        self.metrics.record_routing("prefill", worker.worker_id)
        return worker

    async def _lookup(self, hashes: list[bytes]) -> dict[str, int]:
        """Leading cached blocks per worker; ``{}`` (route by load) when Redis is down."""
        if not hashes:
            return {}
        try:
            # NOTE: the in-memory copy answers in microseconds; Redis needs a thread.
            # Never clean_stale: one index serves every model of the cluster, and a
            # worker leaving this model's pool is forgotten by _forget_worker
            if isinstance(self.index, LocalPrefixIndex):
                overlaps = self.index.longest_prefix(hashes, self.pool.all_ids(),
                                                     clean_stale=False)
            else:
                overlaps = await asyncio.to_thread(self.index.longest_prefix, hashes,
                                                   self.pool.all_ids(), clean_stale=False)
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

    def _forget_worker(self, worker_id: str) -> None:
        """A worker left this model's pool (gone from the registry, not answering Health):
        its blocks leave the index, here and in Redis (``LocalPrefixIndex.forget``)."""
        if isinstance(self.index, LocalPrefixIndex):
            self.index.forget(worker_id)

    def _retain_workers(self, registered: set[str]) -> None:
        """The registry's live workers (all models): the index forgets those absent from
        it for ``_ABSENT_GRACE_S`` (their sets leave Redis; one alive after all
        republishes at its next probe)."""
        if isinstance(self.index, LocalPrefixIndex):
            self.index.retain(registered, max(_ABSENT_GRACE_S,
                                              3 * self.config.registry_interval_s))


_ABSENT_GRACE_S = 30.0


def _prefix_index(redis_url: str) -> LocalPrefixIndex | PrefixIndex:
    """The router's in-memory copy of the prefix index (not started), or the Redis client
    (lookups over the network) where the native extension cannot be built."""
    try:
        return LocalPrefixIndex(redis_url, start=False)
    except (RuntimeError, OSError, ImportError) as exc:
        logger.warning("native prefix index unavailable, asking Redis per lookup: %s", exc)
        return PrefixIndex(redis_url)


def _hash_chain(token_ids, block_size: int, root_hash: bytes,
                cache_salt: str | None) -> list[bytes]:
    """``hash_block_chain``, natively where the extension is built."""
    try:
        return block_index.hash_chain(token_ids, block_size, root_hash, cache_salt)
    except (RuntimeError, OSError, ImportError):
        return hash_block_chain(token_ids, block_size, root_hash, cache_salt)
