"""What an engine hands back: each step's new tokens per request (``EngineOutput``), where a
pulled prompt's KV goes (``KVTransferAllocation``), the KV ownership audit
(``BlockOwnership``) and the tokens per step (``TokenHistogram``)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from pdserve.engine.request import Logprob


@dataclass(slots=True)
class KVTransferAllocation:
    """Where a decode worker puts pulled KV: prompt block ``block_indices[i]`` (its
    position in the prompt's block list) goes into local block ``block_ids[i]``.
    ``num_cached_tokens`` prompt tokens were already cached here and are not pulled.
    ``bindings[i]``: what block ``block_indices[i]`` must hold (``block_hash.block_bindings``
    of the prompt), which the KV path's block tags are checked against."""

    request_id: str
    block_indices: list[int]
    block_ids: list[int]
    num_cached_tokens: int
    bindings: list[bytes]


@dataclass(slots=True)
class EngineOutput:
    """What one step produced for one request (token counts in tokens)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[Logprob]
    finished: bool
    finish_reason: str | None
    stop_reason: int | None
    num_prompt_tokens: int
    num_cached_tokens: int
    prompt_logprobs: list[Logprob | None] | None = None  # on the first output, if asked


@dataclass(frozen=True, slots=True)
class BlockOwnership:
    """A worker's KV ownership audit (docs/architecture.md, Lifecycle and failure): requests whose KV
    is being pulled, leases and the blocks they pin, and blocks owned by nothing (a leak;
    always 0)."""

    num_requests_waiting_for_kv: int
    num_leases: int
    num_leased_blocks: int
    num_unowned_blocks: int


class TokenHistogram:
    """Tokens scheduled per engine step, in vLLM's ``vllm:iteration_tokens_total`` buckets
    (upper bounds, tokens). ``observe`` runs on the engine thread; ``snapshot`` from any
    thread gives cumulative counts consistent with their total (taken from one copy)."""

    BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

    def __init__(self) -> None:
        self._counts = [0] * (len(self.BUCKETS) + 1)  # the last: above every bound
        self._sum = 0

    def observe(self, num_tokens: int) -> None:
        self._counts[bisect.bisect_left(self.BUCKETS, num_tokens)] += 1
        self._sum += num_tokens

    def snapshot(self) -> tuple[list[tuple[float, int]], int]:
        """``([(upper bound, cumulative count), ..., (inf, total)], sum of tokens)``."""
        counts, total = list(self._counts), self._sum
        cumulative, running = [], 0
        for bound, count in zip((*self.BUCKETS, float("inf")), counts):
            running += count
            cumulative.append((float(bound), running))
        return cumulative, total
