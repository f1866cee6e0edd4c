"""Incremental detokenization and stop strings for streamed output.

``IncrementalDetokenizer`` turns token ids into text deltas as they arrive without ever
emitting a broken UTF-8 character. It follows the approach of vLLM's
``detokenize_incrementally`` and TGI's ``decode_token``: decode two overlapping windows of
the token ids, ``ids[prefix_offset:read_offset]`` (already emitted, kept as context) and
``ids[prefix_offset:]``, and emit the second's extra text; if that text ends in U+FFFD (a
multi-byte character whose remaining bytes are in tokens still to come) emit nothing and
wait. Decoding a few tokens of context keeps tokenizers that drop a leading space at the
start of a decode (SentencePiece's "▁") correct. Works with any Hugging Face tokenizer.

The windows are decoded by ``fast_decoder``: for a tokenizer backed by the ``tokenizers``
library whose ``decode`` transformers does not override, the Rust ``Tokenizer.decode``
called directly (a fourth of the cost of transformers' Python wrapper around it), with the
same text as ``tokenizer.decode``; for any other tokenizer, ``tokenizer.decode`` itself.

``StopChecker`` applies OpenAI's ``stop`` strings to the text deltas: the returned text
never contains a stop string (unless asked to include it) and never emits text that a
later delta would retract; a suffix that could be the start of a stop string is held back
until the next delta decides it.

Example (stop ``"###"``)::

    checker.process("Hello #")  -> text "Hello ",  holds "#"
    checker.process("# and")    -> text "# and"     ("## and" is not "###")
    checker.process(" ##")      -> text " ",        holds "##"
    checker.process("#!")       -> text "", stopped on "###"
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

# vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET: prompt tokens decoded as context.
_CONTEXT_TOKENS = 5
_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    """Text deltas for one sequence's generated tokens.

    Args:
        tokenizer: any Hugging Face tokenizer (``decode(ids, skip_special_tokens=...)``).
        prompt_token_ids: the prompt; its last few tokens are decoding context only (so
            the first output token keeps a leading space that depends on what precedes it).
        skip_special_tokens: leave special tokens (EOS, chat markers) out of the text.

    ``add_tokens`` returns the new text (maybe ``""`` while a character is incomplete);
    ``flush`` returns what is still held at the end (an incomplete tail decodes to
    U+FFFD then, as ``tokenizer.decode`` gives it). For a byte-level BPE tokenizer, the
    concatenated deltas equal ``tokenizer.decode(output_token_ids)``.
    """

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int] = (), *,
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._decode_ids = fast_decoder(tokenizer, skip_special_tokens)
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._num_context_tokens = len(context)
        self._ids: list[int] = context
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.output_text = ""

    @property
    def output_token_ids(self) -> list[int]:
        """The generated token ids seen so far."""
        return self._ids[self._num_context_tokens:]

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        """Append generated ``token_ids``; return the text they complete (maybe ``""``)."""
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self._ids[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_INCOMPLETE):
            return ""  # an incomplete character, or tokens that decode to nothing yet
        delta = new_text[len(prefix_text):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self._ids)
        self.output_text += delta
        return delta

    def flush(self) -> str:
        """At the end of the sequence: the text still held back (``""`` when none)."""
        prefix_text = self._decode(self._ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self._ids[self.prefix_offset:])
        delta = new_text[len(prefix_text):]
        self.prefix_offset = self.read_offset = len(self._ids)
        self.output_text += delta
        return delta

    def _decode(self, token_ids: list[int]) -> str:
        return self._decode_ids(token_ids) if token_ids else ""


def fast_decoder(tokenizer, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """A function of token ids returning ``tokenizer.decode(ids, skip_special_tokens=...)``.

    For a transformers ``PreTrainedTokenizerFast`` (``TokenizersBackend`` in transformers
    5) whose class keeps transformers' ``decode`` and ``_decode``, those are the ``tokenizers``
    backend's ``decode`` followed, when ``clean_up_tokenization_spaces`` is on, by
    ``clean_up_tokenization`` (which transformers 5 skips for BPE models): the function
    calls the backend directly, and where the clean-up would change its text, which is then
    ambiguous, it asks ``tokenizer.decode``. Any other tokenizer: ``tokenizer.decode``.
    """
    def reference(token_ids: list[int]) -> str:
        return tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    if not _decodes_with_backend(tokenizer):
        return reference
    backend_decode = tokenizer.backend_tokenizer.decode
    if not tokenizer.clean_up_tokenization_spaces:
        return lambda token_ids: backend_decode(token_ids, skip_special_tokens)
    clean_up = tokenizer.clean_up_tokenization

    def decode_and_clean_up(token_ids: list[int]) -> str:
        text = backend_decode(token_ids, skip_special_tokens)
        return text if clean_up(text) == text else reference(token_ids)
    return decode_and_clean_up


def _decodes_with_backend(tokenizer) -> bool:
    """Whether ``tokenizer.decode`` is transformers' own fast-tokenizer decode."""
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return False
    cls = type(tokenizer)
    return (isinstance(tokenizer, PreTrainedTokenizerFast)
            and cls.decode is PreTrainedTokenizerFast.decode
            and cls._decode is PreTrainedTokenizerFast._decode)


@dataclass(frozen=True, slots=True)
class StopResult:
    """What to emit after one delta: ``text`` (safe to send), and once a stop string
    matched, ``stopped`` with the matching ``stop_str``."""

    text: str
    stopped: bool = False
    stop_str: str | None = None


class StopChecker:
    """Finds OpenAI ``stop`` strings in streamed text, across delta boundaries.

    The match taken is the one that completes first in the text (earliest end; at equal
    ends the earliest start), so the outcome does not depend on how the text was split into
    deltas. The text before the match is emitted; the stop string itself only with
    ``include_stop_str_in_output`` (vLLM's option). After a stop, every call returns an
    empty stopped result.

    Args:
        stop: the stop strings; empty strings are refused.
        include_stop_str_in_output: emit the matched stop string too.

    Raises:
        ValueError: a stop string is empty.
    """

    def __init__(self, stop: Sequence[str], *, include_stop_str_in_output: bool = False) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        self.stop = list(dict.fromkeys(stop))
        self.include_stop_str_in_output = include_stop_str_in_output
        self._held = ""
        self.stopped = False
        self.stop_str: str | None = None

    @property
    def held_text(self) -> str:
        """Text held back because it could begin a stop string."""
        return self._held

    def process(self, delta: str) -> StopResult:
        """Take the next text ``delta``; return the text that can be emitted now."""
        if self.stopped:
            return StopResult("", True, self.stop_str)
        text = self._held + delta
        match = self._first_match(text)
        if match is not None:
            start, stop_str = match
            end = start + len(stop_str) if self.include_stop_str_in_output else start
            self._held = ""
            self.stopped, self.stop_str = True, stop_str
            return StopResult(text[:end], True, stop_str)
        keep = self._partial_suffix_len(text)
        self._held = text[len(text) - keep:] if keep else ""
        return StopResult(text[:len(text) - keep])

    def flush(self) -> str:
        """At the end of the sequence (no stop string matched): release the held text."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _first_match(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for stop_str in self.stop:
            start = text.find(stop_str)
            if start >= 0:
                candidate = (start + len(stop_str), start, stop_str)
                best = candidate if best is None else min(best, candidate)
        return None if best is None else (best[1], best[2])

    def _partial_suffix_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        longest = 0
        for stop_str in self.stop:
            for size in range(min(len(stop_str) - 1, len(text)), longest, -1):
                if text.endswith(stop_str[:size]):
                    longest = size
                    break
        return longest
