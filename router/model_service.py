"""``ModelService``: the router's request lifecycle for one served model (docs/architecture.md,
A request's path; Lifecycle and failure): admission, routing, Prefill then streaming Decode,
detokenization, stop strings, aborts, retries and migration.

A request's life here::

    admit (503 + Retry-After past the caps, before any work)
      -> route (prefix-index lookup, then ``Router``'s decision over the load arrays)
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
import logging
from collections.abc import AsyncIterator

import numpy as np

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
from pdserve.router.route import ALL_FULL, NO_LIVE, Router
from pdserve.router.routing_policy import NoWorkersError
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
        self.pool.on_worker_removed = self._forget_worker
        self.pool.on_registry_read = self._retain_workers
        self._root_hash = root_block_hash(self.served_model_name, config.block_size,
                                          config.kv_cache_dtype)
        self.routing = RoutingStep(config, self.pool, self.metrics,
                                   _prefix_index(config.redis_url), self._root_hash)
        # NOTE: the pool keeps the routing arrays (router/route.py) and one tie rotation
        # per role; the slots are the in-memory index's, whichever index is current
        self.pool.slot_index = _IndexSlots(self.routing)
        self.pool.root_hash = self._root_hash
        self.pool.members_changed()
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
    def index(self) -> LocalPrefixIndex | PrefixIndex:
        """The prefix index the routing step asks (replaceable)."""
        return self.routing.index

    @index.setter
    def index(self, index: LocalPrefixIndex | PrefixIndex) -> None:
        self.routing.index = index

    @property
    def _index_down(self) -> bool:
        return self.routing.index_down

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

    def check_priority(self, priority: int) -> int:
        """``priority`` if this router's ``scheduling_policy`` takes it (vLLM's rule: any
        int32 under ``priority``, 0 only under ``fcfs``).

        Raises:
            ValueError: a priority other than 0 under ``fcfs``.
        """
        if priority and self.config.scheduling_policy != "priority":
            raise ValueError(f"{priority} is refused: the router schedules first come, first "
                             "served (start it with --scheduling-policy priority)")
        return priority

    def check_available(self, num_sequences: int = 1) -> None:
        """Admit a request of ``num_sequences`` sequences, before any work is done for it.

        Raises:
            RequestError: 503 when no decode worker is live, when ``max_waiting_requests``
                would be passed, or when every live worker of a pool the request needs is
                at its cap (``RouterConfig``). With no live prefill worker at all, prompts
                are prefilled on the decode workers instead.
        """
        router = self.pool.router
        if not len(router.decode.ids):
            raise RequestError("no live decode worker; retry later", status=503)
        self._check_waiting(num_sequences)
        if not np.count_nonzero(self.routing.open(router, "decode", router.decode.live())):
            self.metrics.record_rejection("decode_pool_full")
            raise RequestError("every decode worker is at capacity; retry later", status=503)
        if self._uses_prefill and len(router.prefill.ids) and \
                not np.count_nonzero(self.routing.open(router, "prefill", router.prefill.live())):
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
        num_blocks, counts = await self.routing.prefix_counts(request) if fresh else (0, None)
        router = self.pool.router  # NOTE: no await from here to both choices
        num_tokens = len(request.prompt_token_ids)
        decode, position = self.routing.choose_decode(router, exclude, first, counts, num_tokens)
        decode.num_inflight += 1
        try:
            prefill = None
            if fresh:
                prefill = self.routing.choose_prefill(router, position, exclude, first,
                                                      counts, num_tokens, num_blocks)
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
        """``RoutingStep.prefix_lookup``."""
        return await self.routing.prefix_lookup(request)

    async def _lookup(self, hashes: list[bytes]) -> dict[str, int]:
        """``RoutingStep.lookup``."""
        return await self.routing.lookup(hashes)

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


class RoutingStep:
    """The request path's routing step (docs/architecture.md, A request's path, step 1):
    the prompt's prefix lookup, admission masks, and ``Router``'s decision over the pool's
    arrays, with the 503s, metrics and bookkeeping of the request path. What
    ``ModelService`` calls per attempt; ``benchmarks/router_scale.py`` times it.

    Args:
        config: the router's settings.
        pool: the workers (its ``router`` holds the arrays).
        metrics: where rejections, routing and lookups are counted.
        index: a ``LocalPrefixIndex`` (slot lookups) or a ``PrefixIndex`` (Redis; the
            fallback without the native extension); may be replaced at any time.
        root_hash: the chain's ``h_{-1}`` of the served model.
    """

    def __init__(self, config: RouterConfig, pool: WorkerPool, metrics: RouterMetrics,
                 index: LocalPrefixIndex | PrefixIndex, root_hash: bytes) -> None:
        self.config = config
        self.pool = pool
        self.metrics = metrics
        self.index = index
        self.root_hash = root_hash
        self.index_down = False

    def open(self, router: Router, role: str, live: np.ndarray) -> np.ndarray:
        """The workers of ``live`` (a bool mask over ``router``'s ``role`` arrays) below
        their admission caps (``RouterConfig``; ``WorkerHandle.admission_count``)."""
        config = self.config
        if role == "prefill":
            return live & router.prefill.below_caps(config.prefill_max_inflight)
        return live & router.decode.below_caps(config.decode_max_inflight,
                                               config.decode_max_kv_usage)

    async def prefix_lookup(self, request: GenerateRequest
                            ) -> tuple[list[bytes], dict[str, int]]:
        """The prompt's block hashes and, per worker, how many leading ones it caches
        (the prefix index; ``{}`` while it is down or for a prompt under a block)."""
        if len(request.prompt_token_ids) < self.config.block_size:
            return [], {}
        hashes = _hash_chain(request.prompt_token_ids, self.config.block_size,
                             self.root_hash, request.cache_salt)
        return hashes, await self.lookup(hashes)

    async def prefix_counts(self, request: GenerateRequest) -> tuple[int, object]:
        """The prompt's full blocks and what the index says of them, as ``Router.decide``
        takes it: leading blocks per index slot (int32 array, the in-memory index, no
        per-worker objects), a mapping worker id -> blocks (the Redis index, where the
        native extension is not built), or None (a prompt under a block; index down).
        The lookup is counted in ``pdserve:prefix_index_lookups``."""
        if len(request.prompt_token_ids) < self.config.block_size:
            return 0, None
        index = self.index
        if not isinstance(index, LocalPrefixIndex):
            hashes, overlaps = await self.prefix_lookup(request)
            return len(hashes), overlaps
        try:
            # NOTE: hashes at most one block past the first no worker continues to
            num_blocks, counts = index.lookup_prompt(request.prompt_token_ids,
                                                     self.config.block_size, self.root_hash,
                                                     request.cache_salt)
        except PrefixIndexUnavailable as exc:
            self.index_answered(None, exc)
            return len(request.prompt_token_ids) // self.config.block_size, None
        self.index_answered(self.pool.router.any_overlap(counts))
        return num_blocks, counts

    def index_answered(self, hit: bool | None, exc: Exception | None = None) -> None:
        """Count a lookup (``hit``; None: the index is unreachable, ``exc`` says why) and
        log the index's outages and recoveries once each."""
        if hit is None:
            if not self.index_down:
                logger.warning("prefix index unreachable, routing by load alone: %s", exc)
            self.index_down = True
            self.metrics.record_index_lookup("unavailable")
            return
        if self.index_down:
            logger.info("prefix index reachable again")
        self.index_down = False
        self.metrics.record_index_lookup("hit" if hit else "miss")

    def choose_decode(self, router: Router, exclude: set[str], admit: bool, counts,
                      num_tokens: int) -> tuple[WorkerHandle, int]:
        """The decode worker and its position in ``router.decode``: the one caching most
        of the prompt when that is at least half of it (and more than
        ``local_prefill_threshold`` tokens), else by load (``Router.decide_decode``)."""
        config = self.config
        position = router.route_decode(num_tokens, counts, exclude, admit,
                                       config.decode_max_inflight, config.decode_max_kv_usage)
        if position == ALL_FULL:
            self.metrics.record_rejection("decode_pool_full")
            raise RequestError("every decode worker is at capacity; retry later", status=503)
        if position == NO_LIVE:
            raise RequestError("no live decode worker; retry later", status=503)
        worker_id = router.decode.ids[position]
        self.metrics.record_routing("decode", worker_id)
        return self.pool.workers["decode"][worker_id], position

    def choose_prefill(self, router: Router, position: int, exclude: set[str], admit: bool,
                       counts, num_tokens: int, num_blocks: int) -> WorkerHandle | None:
        """The prefill worker for a prompt whose decode worker is at ``position``, or None
        to prefill on the decode worker (conditional disaggregation,
        ``RouterConfig.disaggregation``; ``Router.decide_prefill``); the choice is
        counted in ``pdserve:prefill_path``.

        Raises:
            RequestError: 503 when ``disaggregation="always"`` and every prefill worker
                is at its cap (in ``"auto"`` the prompt is prefilled locally instead).
        """
        try:
            decision = router.route_prefill(position, num_tokens, num_blocks, counts, exclude,
                                            admit, self.config.prefill_max_inflight)
        except NoWorkersError:
            self.metrics.record_rejection("prefill_pool_full")
            raise RequestError("every prefill worker is at capacity; retry later",
                               status=503) from None
        self.metrics.record_prefill_path(decision.reason)
        if decision.prefill_worker_id is None:
            return None
        worker = self.pool.workers["prefill"][decision.prefill_worker_id]
        worker.num_inflight += 1  # given back by _prefill, called right after
        self.metrics.record_routing("prefill", worker.worker_id)
        return worker

    async def lookup(self, hashes: list[bytes]) -> dict[str, int]:
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
            self.index_answered(None, exc)
            return {}
        self.index_answered(bool(overlaps))
        return overlaps


class _IndexSlots:
    """The routing arrays' view of a service's current prefix index: its worker slots
    (``LocalPrefixIndex.slot_of``), or none for the Redis index (routed by mapping)."""

    def __init__(self, routing: RoutingStep) -> None:
        self.routing = routing

    def slot_of(self, worker_id: str) -> int | None:
        """The worker's slot in the in-memory index, None when it has none."""
        index = self.routing.index
        return index.slot_of(worker_id) if isinstance(index, LocalPrefixIndex) else None

    @property
    def slots_version(self) -> tuple:
        """Changes whenever ``slot_of`` may answer otherwise: the index replaced by another
        in-memory one (``LocalPrefixIndex.instance``: an id() may be a freed index's) or
        by the Redis one, or a slot of it given or freed (``slots_version``). Redis
        indexes answer no slot, so one replacing another changes nothing."""
        index = self.routing.index
        if isinstance(index, LocalPrefixIndex):
            return "local", index.instance, index.slots_version
        return ("redis",)


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
