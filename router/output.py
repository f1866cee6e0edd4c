"""One sequence's output at the router: incremental detokenization and stop strings
applied to the tokens the workers stream, whichever worker (or migration attempt) they
come from."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.request import Logprob
from pdserve.router.detokenizer import IncrementalDetokenizer, StopChecker


@dataclass(slots=True)
class GenerationChunk:
    """What one step added: text (stop strings applied), token ids, logprobs; at the end
    ``finish_reason`` (``stop`` or ``length``) and ``stop_reason`` (token id or string).
    ``num_cached_tokens`` is the prompt's prefix-cache hit (tokens). The first chunk of a
    request that asked for ``prompt_logprobs`` carries them: one per prompt token, the
    first None (nothing predicts it)."""

    text: str
    token_ids: list[int]
    logprobs: list[Logprob]
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[Logprob | None] | None = None


class SequenceOutput:
    """Detokenizes one sequence's tokens and applies its stop strings. One per request,
    kept across migrations, so a resumed stream's text continues where it stopped.

    Args:
        tokenizer: the model's tokenizer.
        prompt_token_ids: the prompt (its last tokens seed the detokenizer's context).
        stop: stop strings; ``include_stop_str_in_output`` keeps the matched one.
        skip_special_tokens: as vLLM's option of that name.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str],
                 include_stop_str_in_output: bool, skip_special_tokens: bool) -> None:
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, prompt_token_ids, skip_special_tokens=skip_special_tokens)
        self.stop = StopChecker(stop, include_stop_str_in_output=include_stop_str_in_output)
        self.num_cached_tokens = 0

    def add(self, token_ids: list[int], logprobs: list[Logprob], finish_reason: str,
            stop_reason: int | None) -> GenerationChunk:
        """The chunk for new tokens; ``finish_reason`` is the worker's (``""`` while
        running; never ``abort``: the router treats a worker's abort as a failure)."""
        text = self.detokenizer.add_tokens(token_ids)
        if finish_reason:
            text += self.detokenizer.flush()
        result = self.stop.process(text)
        chunk = GenerationChunk(result.text, token_ids, logprobs, self.num_cached_tokens)
        if result.stopped:
            chunk.finish_reason, chunk.stop_reason = "stop", result.stop_str
        elif finish_reason:
            chunk.text += self.stop.flush()
            chunk.finish_reason, chunk.stop_reason = finish_reason, stop_reason
        return chunk


def stop_reason_of(message) -> int | None:
    """A worker message's ``stop_reason`` (the stop token id), or None when unset."""
    return message.stop_reason if message.HasField("stop_reason") else None
