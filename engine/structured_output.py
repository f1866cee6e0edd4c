"""Structured output: sampling constrained to a JSON schema, any JSON object, a regex, a
list of choices or an EBNF grammar, as vLLM and SGLang offer it.

Built on xgrammar (https://github.com/mlc-ai/xgrammar; Dong et al. 2024,
https://arxiv.org/abs/2411.15100). A request carries a ``StructuredOutputSpec`` in its
``SamplingParams``; the engine compiles it once per distinct spec (xgrammar caches
compiled grammars), gives the request a ``GrammarMatcher`` that follows its output
tokens, and the sampler of whichever worker samples masks every token the grammar forbids
(``apply_grammar_bitmask``), after logit bias and penalties and before the greedy choice or
the draw. The matcher is advanced in ``Request.append_output_token``, so a decode worker's
request, which starts with the prefill worker's first token (or a migrated request's
tokens), resumes the grammar where the other worker left it. A batch without constrained
requests does no extra work; xgrammar is imported on the first constrained request (it
takes seconds to import).

JSON schemas compile with xgrammar's ``strict_mode`` (an object allows no properties its
schema does not name, unless it says ``additionalProperties``) and without free whitespace
(``any_whitespace=False``: the output is written as ``json.dumps`` writes it, ``", "`` and
``": "`` between items), so a model cannot spend its tokens on blanks.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    import xgrammar

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 64 * 1024  # a schema, regex or grammar; all choices together
MAX_CHOICES = 1024
_JSON_OBJECT_SCHEMA = '{"type": "object"}'
# xgrammar's C++ errors start with "[05:25:27] /project/cpp/regex_converter.cc:83: ".
_LABELS = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex",
           "choice": "choice list", "grammar": "grammar"}
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


@dataclass(frozen=True, slots=True)
class StructuredOutputSpec:
    """What the output must match.

    ``kind`` is one of ``KINDS``: ``json`` (``value`` a JSON schema as a string),
    ``json_object`` (any JSON object; ``value`` None), ``regex`` (``value`` a regular
    expression the whole output matches), ``choice`` (``value`` a tuple of strings: the
    output is exactly one of them), ``grammar`` (``value`` an EBNF grammar in xgrammar's
    dialect, GBNF-like, with a ``root`` rule). At most ``MAX_SPEC_CHARS`` characters and
    ``MAX_CHOICES`` choices. Whether the value parses is checked by ``check_spec``.

    Raises:
        ValueError: from ``__post_init__``: an unknown kind, a value of the wrong type,
            too large, or an empty choice list; the message starts with
            ``structured_output``.
    """

    kind: str
    value: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured_output: kind {self.kind!r} must be one of {KINDS}")
        if self.kind == "json_object":
            _require(self.value is None, "json_object takes no value")
        elif self.kind == "choice":
            if isinstance(self.value, list):
                object.__setattr__(self, "value", tuple(self.value))
            _require(isinstance(self.value, tuple) and self.value
                     and all(isinstance(c, str) for c in self.value),
                     "choice must be a non-empty list of strings")
            _require(len(self.value) <= MAX_CHOICES, f"at most {MAX_CHOICES} choices")
        else:
            _require(isinstance(self.value, str) and self.value, f"{self.kind} must be a "
                     "non-empty string")
        _require(self.num_chars <= MAX_SPEC_CHARS, f"the {_LABELS[self.kind]} has {self.num_chars} "
                 f"characters; at most {MAX_SPEC_CHARS}")

    @property
    def num_chars(self) -> int:
        if isinstance(self.value, tuple):
            return sum(len(c) for c in self.value)
        return len(self.value or "")


def _require(ok: Any, rule: str) -> None:
    if not ok:
        raise ValueError(f"structured_output: {rule}")


def preload() -> None:
    """Import xgrammar now (it takes seconds): a service calls this in a worker thread at
    start, so that its first constrained request does not wait for it."""
    import xgrammar  # noqa: F401


def json_schema_spec(schema: dict | bool | str) -> StructuredOutputSpec:
    """The spec that constrains the output to JSON valid against ``schema`` (a JSON
    schema as a dict, a boolean schema, or its JSON text). Tool calling (``tool_choice``
    ``required`` or a named tool) can build its constraint with this and pass it as
    ``SamplingParams(structured_output=...)``; ``check_spec`` then says whether xgrammar
    can compile it.

    Raises:
        ValueError: ``schema`` is not JSON-serialisable, or the spec is too large.
    """
    if isinstance(schema, str):
        return StructuredOutputSpec("json", schema)
    try:
        text = json.dumps(schema, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"structured_output: the JSON schema is not JSON: {exc}") from exc
    return StructuredOutputSpec("json", text)


def _ebnf_of_choices(choices: Sequence[str]) -> str:
    # NOTE: xgrammar's EBNF string literals take JSON's escapes (\", \\, \n, \uXXXX).
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


# NOTE: xgrammar 0.2.8 writes a string with minLength / maxLength as a repetition of
# [^"\\\r\n], which lets raw control characters (U+0000-U+001F) into the string: invalid
# JSON (https://github.com/mlc-ai/xgrammar/issues/800, still open). pdserve narrows that
# class to the one its unbounded strings use; the grammar's text round-trips exactly through
# xgrammar's EBNF parser. (Escapes stay unreachable inside such strings: valid, narrower.)
_LOOSE_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\\r\n]'


def _json_schema_grammar(schema: str, strict_mode: bool) -> xgrammar.Grammar:
    import xgrammar as xgr

    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False,
                                           strict_mode=strict_mode)
    text = str(grammar)
    if _LOOSE_STRING_CHAR not in text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR))


def _grammar(spec: StructuredOutputSpec) -> xgrammar.Grammar:
    import xgrammar as xgr

    if spec.kind == "json":
        return _json_schema_grammar(spec.value, strict_mode=True)
    if spec.kind == "json_object":
        return _json_schema_grammar(_JSON_OBJECT_SCHEMA, strict_mode=False)
    if spec.kind == "regex":
        return xgr.Grammar.from_regex(spec.value)
    if spec.kind == "choice":
        return xgr.Grammar.from_ebnf(_ebnf_of_choices(spec.value))
    return xgr.Grammar.from_ebnf(spec.value)


def check_spec(spec: StructuredOutputSpec) -> None:
    """Parse ``spec`` with xgrammar, without a tokenizer (sub-millisecond for most specs):
    the router's check before a request reaches a worker.

    Raises:
        ValueError: the schema is not JSON or uses a type xgrammar does not know, the regex
            or the grammar does not parse; xgrammar's message, without its C++ location.
    """
    try:
        _grammar(spec)
    except RuntimeError as exc:
        raise ValueError(_xgrammar_message(spec, exc)) from None


def _xgrammar_message(spec: StructuredOutputSpec, exc: Exception) -> str:
    text = _CPP_PREFIX.sub("", str(exc).strip().splitlines()[0] if str(exc).strip() else "")
    return f"the {_LABELS[spec.kind]} cannot be compiled: {text[:300]}"


class GrammarMatcher:
    """One request's position in its grammar (an ``xgrammar.GrammarMatcher``).

    ``accept(token)`` advances it; ``fill_bitmask(bitmask, row)`` writes the tokens
    allowed next into row ``row`` of an int32 bitmask ``[rows, ceil(vocab / 32)]`` (bit
    ``t % 32`` of word ``t // 32`` set: token ``t`` allowed); once the grammar is complete
    only the stop tokens (EOS) are allowed, and accepting one ``terminates`` it.
    """

    __slots__ = ("_matcher",)

    def __init__(self, compiled: xgrammar.CompiledGrammar) -> None:
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled)

    def accept(self, token_id: int) -> bool:
        """Advance over ``token_id``; False (and no move) if the grammar forbids it."""
        return self._matcher.accept_token(token_id)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` ``accept``s (speculative decoding's proposals)."""
        if num_tokens:
            self._matcher.rollback(num_tokens)

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens``, in order, the grammar accepts from here (the matcher
        is left where it was)."""
        count = 0
        for token in tokens:
            if self._matcher.is_terminated() or not self._matcher.accept_token(token):
                break
            count += 1
        self.rollback(count)
        return count

    def fill_bitmasks_along(self, tokens: Sequence[int], bitmask: torch.Tensor) -> None:
        """Rows ``0 .. len(tokens)`` of ``bitmask``: the tokens allowed after each prefix
        ``tokens[:i]`` of proposals the grammar accepts (``valid_prefix``; after a stop
        token that completes it, every token); the matcher is left where it was."""
        for row in range(len(tokens) + 1):
            if self._matcher.is_terminated():  # NOTE: a proposed stop token ended it: the
                bitmask[row] = -1  # rows after are never sampled (the request stops there)
            else:
                self._matcher.fill_next_token_bitmask(bitmask, row)
            if row < len(tokens):
                self._matcher.accept_token(tokens[row])
        self.rollback(len(tokens))

    @property
    def terminated(self) -> bool:
        """True once a stop token was accepted after a complete output."""
        return self._matcher.is_terminated()


class GrammarCompiler:
    """Compiles specs against one tokenizer. The last ``cache_size`` specs compiled stay
    cached (least recently used out first), so a spec in use compiles once and a request
    added on the engine thread finds it compiled. Thread-safe: ``compile`` may run off the
    engine thread.

    Args:
        tokenizer: the checkpoint's Hugging Face tokenizer.
        vocab_size: the model's vocabulary (logits' width), which may exceed the
            tokenizer's; ids past the tokenizer's are never allowed.
        stop_token_ids: the tokens that end a complete output (the engine's EOS ids).
        max_threads: xgrammar's threads per compilation.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int],
                 max_threads: int = 2, cache_size: int = 256) -> None:
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(stop_token_ids))
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads,
                                             cache_enabled=False)
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self._cache: OrderedDict[StructuredOutputSpec, xgrammar.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutputSpec) -> xgrammar.CompiledGrammar:
        """Raises ValueError as ``check_spec`` does."""
        with self._lock:
            compiled = self._cache.get(spec)
            if compiled is not None:
                self._cache.move_to_end(spec)
                return compiled
        try:
            compiled = self._compiler.compile_grammar(_grammar(spec))
        except RuntimeError as exc:
            raise ValueError(_xgrammar_message(spec, exc)) from None
        with self._lock:
            self._cache[spec] = compiled
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, spec: StructuredOutputSpec) -> GrammarMatcher:
        """A fresh matcher at the start of ``spec``'s grammar (compiled, or from the cache).

        Raises:
            ValueError: as ``compile``.
        """
        return GrammarMatcher(self.compile(spec))


def bitmask_width(vocab_size: int) -> int:
    """int32 words per bitmask row: ``ceil(vocab_size / 32)``."""
    return (vocab_size + 31) // 32


def apply_grammar_bitmask(logits: torch.Tensor, matchers: Sequence[GrammarMatcher],
                          rows: Sequence[int], bitmask: torch.Tensor) -> None:
    """Set to -inf, in place, every logit that ``matchers[j]``'s grammar forbids in row
    ``rows[j]`` of ``logits: [N, vocab]`` (fp32/bf16/fp16, any device); other rows are
    not touched. ``bitmask`` is a CPU int32 scratch buffer ``[>= N, ceil(vocab / 32)]``
    (only the rows named are written). The kernel is xgrammar's (C++ on the CPU, CUDA or
    Triton on a GPU)."""
    import xgrammar as xgr

    for matcher, row in zip(matchers, rows):
        matcher.fill_bitmask(bitmask, row)
    mask = bitmask[:logits.shape[0]]  # [N, ceil(vocab / 32)] int32
    if logits.device.type != "cpu":
        mask = mask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=logits.shape[1],
                                    indices=list(rows))
