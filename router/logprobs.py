"""Logprobs in OpenAI's two response formats (completions and chat), from the engine's
``Logprob`` records, as vLLM writes them."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from pdserve.engine.request import Logprob
from pdserve.router.protocol import (
    ChatChoiceLogProbs,
    ChatLogprobEntry,
    ChatTopLogprob,
    CompletionLogProbs,
)

_CHAT_MIN_LOGPROB = -9999.0  # vLLM's stand-in for -inf, which JSON cannot carry


def completion_logprobs(logprobs: Sequence[Logprob], decode_token: Callable[[int], str],
                        text_offset: int = 0) -> CompletionLogProbs:
    """Completions-API logprobs for generated tokens. ``decode_token`` maps a token id to
    its text; ``text_offset`` is the character offset of the first token in the choice's
    text. ``top_logprobs[i]`` holds the top alternatives plus the sampled token (vLLM)."""
    out = CompletionLogProbs()
    for lp in logprobs:
        token = decode_token(lp.token_id)
        out.text_offset.append(text_offset)
        out.tokens.append(token)
        out.token_logprobs.append(_finite(lp.logprob, None))
        top = {decode_token(t): _finite(v, _CHAT_MIN_LOGPROB) for t, v in lp.top.items()}
        top[token] = _finite(lp.logprob, _CHAT_MIN_LOGPROB)
        out.top_logprobs.append(top)
        text_offset += len(token)
    return out


def chat_logprobs(logprobs: Sequence[Logprob], decode_token: Callable[[int], str],
                  num_top: int) -> ChatChoiceLogProbs:
    """Chat-API logprobs: per token its text, logprob (-inf as -9999.0, like vLLM), UTF-8
    bytes and up to ``num_top`` alternatives, best first."""
    content = []
    for lp in logprobs:
        token = decode_token(lp.token_id)
        top = [ChatTopLogprob(token=(t := decode_token(i)), logprob=_finite(v, _CHAT_MIN_LOGPROB),
                              bytes=list(t.encode()))
               for i, v in list(lp.top.items())[:num_top]]
        content.append(ChatLogprobEntry(token=token, logprob=_finite(lp.logprob, _CHAT_MIN_LOGPROB),
                                        bytes=list(token.encode()), top_logprobs=top))
    return ChatChoiceLogProbs(content=content)


def _finite(value: float, fallback: float | None) -> float | None:
    return value if math.isfinite(value) else fallback
