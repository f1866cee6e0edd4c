"""Continuous batching with chunked prefill, prefix caching and preemption by recompute.

There is no prefill phase and no decode phase (vLLM v1's scheduler): each request has
``num_computed_tokens`` catching up to ``num_tokens``, and every step hands out at most
``max_num_batched_tokens`` tokens, running requests first (decodes before prefill
chunks), then waiting ones while ``max_num_seqs`` allows. When blocks run out, a running
request is preempted: its blocks are freed and it goes back to the front of the queue to
be recomputed (prefix-cache hits make that cheap).

Order (vLLM's priority scheduling): the queue is kept sorted by ``Request.priority``,
lower first, and in arrival order among equals (a preempted request, or one whose KV has
just arrived, first among its equals); the request preempted is the running one of the
highest priority value, among equals the most recently admitted. With every priority
equal (the default, 0) that is first-come-first-served. The router refuses a priority
other than 0 unless it runs with ``--scheduling-policy priority``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Logprob, Request, RequestStatus


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Batch limits: sequences per step, tokens per step, tokens per sequence."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 2048

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= 1")


@dataclass(slots=True)
class SchedulerOutput:
    """One step's work: ``num_scheduled_tokens[i]`` new tokens of ``requests[i]``."""

    requests: list[Request] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    def add(self, request: Request, num_tokens: int) -> None:
        self.requests.append(request)
        self.num_scheduled_tokens.append(num_tokens)


class Scheduler:
    """Decides each step which requests run and how many tokens of each."""

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 propose: Callable[[Request], list[int]] | None = None,
                 on_finish: Callable[[Request], None] | None = None) -> None:
        self.config = config
        self.kv = kv_cache_manager
        # speculative decoding: a decoding request's proposals (engine/spec_decode.py)
        self.propose = propose
        self.on_finish = on_finish  # told of every request that ends (the proposer's state)
        self.num_drafts_total = 0  # vLLM's spec_decode counters: steps that proposed,
        self.num_draft_tokens_total = 0  # tokens proposed,
        self.num_accepted_tokens_total = 0  # and proposals that stood
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # Decode side: requests whose prompt KV is being pulled into their blocks.
        self.waiting_for_kv: dict[str, Request] = {}
        self.num_preemptions_total = 0
        # vLLM's prefix-cache counters: prompt tokens looked up, and found cached, once
        # per request (its first scheduling, or its KV allocation on a decode worker).
        self.prefix_cache_queries_total = 0
        self.prefix_cache_hits_total = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self._enqueue(request)

    def _enqueue(self, request: Request, front: bool = False) -> None:
        """Queue ``request`` after the waiting requests of its priority or a lower value
        (``front``: before those of its priority or a higher value). O(1) when every
        priority is equal, else O(waiting)."""
        waiting, rank = self.waiting, request.priority
        if front:
            if not waiting or waiting[0].priority >= rank:
                waiting.appendleft(request)
                return
            at = next((i for i, r in enumerate(waiting) if r.priority >= rank), len(waiting))
        else:
            if not waiting or waiting[-1].priority <= rank:
                waiting.append(request)
                return
            at = next(i for i, r in enumerate(waiting) if r.priority > rank)
        waiting.insert(at, request)

    def abort_request(self, request_id: str) -> Request | None:
        """Finish a request wherever it is and free its blocks; None if unknown."""
        request = self.requests.get(request_id)
        if request is not None:
            self.finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End a request. Its blocks are freed, except: a prefill worker's request keeps
        them held for the decode worker, and a request whose KV is still arriving keeps
        them until ``finish_kv_transfer`` (the transfer writes into them)."""
        in_transfer = request.status == RequestStatus.WAITING_FOR_KV
        request.status = status
        request.spec_token_ids = []
        if self.on_finish is not None:
            self.on_finish(request)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.requests.pop(request.request_id, None)
        if in_transfer:
            return
        if status == RequestStatus.FINISHED_REMOTE_DECODE:
            self.kv.hold(request)  # the lease is made in the same step as the hold
        else:
            self.kv.free(request)

    def add_kv_transfer_request(self, request: Request) -> bool:
        """Allocate blocks for a request whose prompt KV comes from a prefill worker.

        Blocks already cached here (matching hashes) are reused; the rest are allocated
        uncached and the request waits in ``WAITING_FOR_KV``. Returns False, adding
        nothing, when too few blocks are free (the caller retries later).
        """
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        hits, num_hit = self.kv.get_computed_blocks(request)
        if not self.kv.allocate_slots(request, request.num_prompt_tokens - num_hit, hits,
                                      cache=False):
            return False
        request.num_cached_tokens = num_hit
        self.prefix_cache_queries_total += request.num_prompt_tokens
        self.prefix_cache_hits_total += num_hit
        request.status = RequestStatus.WAITING_FOR_KV
        self.requests[request.request_id] = request
        self.waiting_for_kv[request.request_id] = request
        return True

    def finish_kv_transfer(self, request_id: str, ok: bool) -> Request | None:
        """The pull for ``request_id`` ended. On success the prompt counts as computed and
        the request queues to decode; on failure, or if it was aborted meanwhile, it ends
        and its blocks are freed. Returns the request, or None if unknown."""
        request = self.waiting_for_kv.pop(request_id, None)
        if request is None:
            return None
        if request.status != RequestStatus.WAITING_FOR_KV or not ok:
            if request.status == RequestStatus.WAITING_FOR_KV:
                self.requests.pop(request_id, None)
                request.status = RequestStatus.FINISHED_ABORTED
            self.kv.free(request)
            return request
        request.num_computed_tokens = request.num_prompt_tokens
        self.kv.cache_blocks(request, request.num_prompt_tokens)
        request.status = RequestStatus.WAITING
        self._enqueue(request, front=True)
        return request

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        # Priority first, then decodes before prefill chunks (a stable sort: admission
        # order within each group), so blocks go to the more urgent requests first.
        for request in sorted(self.running, key=lambda r: (
                r.priority, r.num_tokens - r.num_computed_tokens > 1)):
            if budget == 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            request.spec_token_ids = []
            if num_new == 1 and self.propose is not None:  # NOTE: a decode may speculate
                request.spec_token_ids = self.propose(request)[:budget - 1]
                num_new += len(request.spec_token_ids)
            while not self.kv.allocate_slots(request, num_new):
                victim = self._pick_victim(out, request)
                self._preempt(victim, out)
                if victim is request:
                    num_new = 0
                    request.spec_token_ids = []
                    break
            if num_new:
                out.add(request, num_new)
                budget -= num_new
        return budget

    def _pick_victim(self, out: SchedulerOutput, request: Request) -> Request:
        """Of the running requests not yet scheduled this step, the one of the highest
        priority value, the latest admitted among equals; ``request`` itself when none
        is left or its own priority value is higher still."""
        scheduled = set(map(id, out.requests))
        victim = request
        for candidate in reversed(self.running):  # NOTE: latest admitted first
            if candidate is request or id(candidate) in scheduled:
                continue
            if victim is request or candidate.priority > victim.priority:
                victim = candidate
        return request if request.priority > victim.priority else victim

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.kv.free(request)
        self.running.remove(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self._enqueue(request, front=True)
        out.preempted.append(request)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            imported = request.num_computed_tokens  # > 0 only for KV pulled from a prefill
            if imported:
                hits, num_hit_tokens = [], imported
            else:
                hits, num_hit_tokens = self.kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_hit_tokens, budget)
            if not self.kv.allocate_slots(request, num_new, hits):
                break
            self.waiting.popleft()
            if request.num_preemptions == 0 and not imported:
                request.num_cached_tokens = num_hit_tokens
                self.prefix_cache_queries_total += request.num_tokens
                self.prefix_cache_hits_total += num_hit_tokens
            request.num_computed_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.add(request, num_new)
            budget -= num_new

    def update_from_output(self, out: SchedulerOutput,
                           sampled: dict[str, list[tuple[int, Logprob | None]]]
                           ) -> list[Request]:
        """Advance ``num_computed_tokens``, append sampled tokens and finish stopped
        requests. Returns the requests that got new tokens this step.

        ``sampled[request_id]`` holds one token, or for a request that speculated its
        accepted proposals and the correction (or bonus) token: its computed tokens then
        advance past its last token and the accepted proposals only (the rejected ones'
        KV slots are overwritten later), and the tokens after one that stops it are
        dropped."""
        updated = []
        for request, num_tokens in zip(out.requests, out.num_scheduled_tokens):
            if request.status != RequestStatus.RUNNING:
                continue  # aborted during the step
            tokens = sampled.get(request.request_id)
            proposed = len(request.spec_token_ids)
            request.spec_token_ids = []
            if proposed and tokens is not None:
                num_tokens = len(tokens)  # 1 + the accepted proposals
                self.num_drafts_total += 1
                self.num_draft_tokens_total += proposed
                self.num_accepted_tokens_total += len(tokens) - 1
            request.num_computed_tokens += num_tokens
            if tokens is None:
                continue  # a prefill chunk short of the last prompt token
            for token_id, logprob in tokens:
                request.append_output_token(token_id, logprob)
                status = request.check_stop(self.config.max_model_len)
                if status is not None:
                    self.finish(request, status)
                    break
            updated.append(request)
        return updated
