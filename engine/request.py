"""A request's state inside one engine: tokens, progress and status (STYLE.md, one model).

A request has ``num_computed_tokens`` catching up to ``num_tokens``; it is in prefill while
``num_computed_tokens < num_tokens - 1`` would leave more than the last token to compute.
Chunked prefill, prefix-cache hits, imported KV and recompute after preemption are all
the same path: they only move ``num_computed_tokens``.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.structured_output import GrammarMatcher


class RequestStatus(enum.Enum):
    """Where a request is in its life; the ``FINISHED_*`` members are final."""

    WAITING = enum.auto()
    WAITING_FOR_KV = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    # Prefill done here, first token sampled; decoding continues on a decode worker.
    FINISHED_REMOTE_DECODE = enum.auto()

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_REMOTE_DECODE)

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's ``finish_reason``: ``stop``, ``length``, ``abort`` or None."""
        return {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                RequestStatus.FINISHED_ABORTED: "abort"}.get(self)


@dataclass(slots=True)
class Logprob:
    """The sampled token's log-probability, its rank (1 = most likely) in the model's raw
    distribution, and the top alternatives (token id -> logprob, best first)."""

    token_id: int
    logprob: float
    rank: int
    top: dict[int, float] = field(default_factory=dict)


@dataclass(slots=True, eq=False)
class Request:
    """One sequence being generated. Token counts are in tokens.

    ``max_tokens`` is the resolved output budget (``SamplingParams.max_tokens`` capped by
    ``max_model_len``); ``stop_reason`` holds the stop token id that ended it, if any.
    ``remote_decode`` marks a prefill worker's request: it ends after its first token
    (unless that token already finishes it) and its blocks stay held for the decode worker.
    ``kv_consumer`` names the one decode worker that lease may be sent to (None: any).
    ``priority`` (vLLM's): lower is served first; among equals, earlier arrival
    (``engine/scheduler.py``).
    ``grammar`` follows the output through a structured output's grammar (None when
    unconstrained): every appended token advances it, so tokens generated elsewhere (the
    prefill worker's first token, a migrated request's) put it where that worker left it.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    max_tokens: int
    cache_salt: str | None = None
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[Logprob] = field(default_factory=list)
    # prompt_logprobs asked for: entry i for prompt token i (None for the first)
    prompt_logprobs: list[Logprob | None] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    stop_reason: int | None = None
    remote_decode: bool = False
    kv_consumer: str | None = None
    grammar: GrammarMatcher | None = None
    # speculative decoding: the tokens proposed after the last one, scheduled this step
    # beside it and verified by its logits (``engine/spec_decode.py``); [] otherwise
    spec_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens, the length ``num_computed_tokens`` catches up to."""
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int, logprob: Logprob | None = None) -> None:
        """Append a generated token (and advance the grammar over it).

        Raises:
            ValueError: the request's grammar forbids ``token_id``; nothing is appended.
        """
        if self.grammar is not None and not self.grammar.accept(token_id):
            raise ValueError(f"token {token_id} does not follow request {self.request_id}'s "
                             f"structured output grammar after {self.num_output_tokens} "
                             "output tokens")
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if logprob is not None:
            self.output_logprobs.append(logprob)

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """The finished status the last appended token causes, or None to continue."""
        params = self.sampling_params
        last = self.output_token_ids[-1]
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if last in params.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if self.grammar is not None and self.grammar.terminated:  # EOS under ignore_eos
            return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        if self.remote_decode:
            return RequestStatus.FINISHED_REMOTE_DECODE
        return None
