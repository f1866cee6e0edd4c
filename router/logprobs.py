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
    PromptLogprob,
)

_CHAT_MIN_LOGPROB = -9999.0  # vLLM's stand-in for -inf, which JSON cannot carry


def completion_logprobs(logprobs: Sequence[Logprob], decode_token: Callable[[int], str],
                        text_offset: int = 0) -> CompletionLogProbs:
    """Completions-API logprobs for generated tokens. ``decode_token`` maps a token id to
    its text; ``text_offset`` is the character offset of the first token in the choice's
    text. ``top_logprobs[i]`` holds the top alternatives plus the sampled token (vLLM)."""
    out = CompletionLogProbs()
    for lp in logprobs:
        text_offset = _add_completion_entry(out, lp.token_id, lp, None, decode_token,
                                            text_offset)
    return out


def completion_prompt_logprobs(prompt_token_ids: Sequence[int],
                               logprobs: Sequence[Logprob | None],
                               decode_token: Callable[[int], str],
                               num_top: int) -> CompletionLogProbs:
    """Completions-API logprobs for the prompt, as ``echo`` puts them before the generated
    tokens' (OpenAI's and vLLM's shape): ``logprobs[i]`` is prompt token ``i``'s (the
    first None, so its ``token_logprobs`` and ``top_logprobs`` entries are null), with up
    to ``num_top`` alternatives; text offsets count from the prompt's start."""
    out = CompletionLogProbs()
    offset = 0
    for token_id, lp in zip(prompt_token_ids, logprobs, strict=True):
        offset = _add_completion_entry(out, token_id, lp, num_top, decode_token, offset)
    return out


def _add_completion_entry(out: CompletionLogProbs, token_id: int, lp: Logprob | None,
                          num_top: int | None, decode_token: Callable[[int], str],
                          text_offset: int) -> int:
    """Append one token to ``out`` (its top alternatives cut to ``num_top`` unless None,
    plus the token itself, as vLLM's); returns the next token's text offset."""
    token = decode_token(token_id)
    out.text_offset.append(text_offset)
    out.tokens.append(token)
    if lp is None:
        out.token_logprobs.append(None)
        out.top_logprobs.append(None)
    else:
        out.token_logprobs.append(_finite(lp.logprob, None))
        items = list(lp.top.items())
        top = {decode_token(t): _finite(v, _CHAT_MIN_LOGPROB)
               for t, v in (items if num_top is None else items[:num_top])}
        top[token] = _finite(lp.logprob, _CHAT_MIN_LOGPROB)
        out.top_logprobs.append(top)
    return text_offset + len(token)


def vllm_prompt_logprobs(logprobs: Sequence[Logprob | None],
                         decode_token: Callable[[int], str],
                         num_top: int) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's ``prompt_logprobs`` response field: per prompt token None (the first) or
    {token id: ``PromptLogprob``} for the prompt token and its ``num_top`` best
    alternatives (ranked 1.. in the model's raw distribution)."""
    out: list[dict[str, PromptLogprob] | None] = []
    for lp in logprobs:
        if lp is None:
            out.append(None)
            continue
        entry = {str(lp.token_id): PromptLogprob(
            logprob=_finite(lp.logprob, _CHAT_MIN_LOGPROB), rank=lp.rank,
            decoded_token=decode_token(lp.token_id))}
        for rank, (t, v) in enumerate(list(lp.top.items())[:num_top], start=1):
            entry.setdefault(str(t), PromptLogprob(logprob=_finite(v, _CHAT_MIN_LOGPROB),
                                                   rank=rank, decoded_token=decode_token(t)))
        out.append(entry)
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
