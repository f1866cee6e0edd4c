"""Offline API results, shaped like vLLM's ``RequestOutput`` / ``CompletionOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TokenLogprob:
    """One candidate's log-probability, its rank (1 = most likely) and text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence.

    ``logprobs[i]`` maps token id -> ``TokenLogprob`` for output position ``i`` (the sampled
    token and the top alternatives), or is None when logprobs were not asked for.
    ``stop_reason`` is the stop token id that ended generation, if one did.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, TokenLogprob]] | None
    finish_reason: str | None = None
    stop_reason: int | None = None


@dataclass(slots=True)
class RequestOutput:
    """A prompt and its completions; ``num_cached_tokens`` counts prefix-cache hits;
    ``prompt_logprobs[i]`` maps token id -> ``TokenLogprob`` for prompt position ``i`` (the
    prompt's token and the top alternatives; None for the first), when asked for."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, TokenLogprob] | None] | None = None
