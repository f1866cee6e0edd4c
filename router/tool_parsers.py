"""Tool-call parsers: the text a model writes when it calls tools, read as OpenAI tool
calls, whole or while it streams. Chosen with vLLM's ``--tool-call-parser NAME``:

- ``hermes`` (Hermes 2 Pro, Qwen 2.5 and 3): ``<tool_call>{"name": N, "arguments":
  {...}}</tool_call>``, one block per call, after optional text;
- ``llama3_json`` (Llama 3.1, 3.2 and 3.3's JSON tool calling): the reply is ``{"name": N,
  "parameters": {...}}`` (or ``"arguments"``), optionally after ``<|python_tag|>``,
  several calls joined by ``;``;
- ``mistral``: ``[TOOL_CALLS]`` then a JSON list ``[{"name": N, "arguments": {...}}]``
  (tokenizers before v11) or ``N[ARGS]{...}`` per call (v11 and later);
- ``pythonic`` (Llama 3.2's and Llama 4's): the reply is a Python list of calls with
  keyword arguments, ``[get_weather(city="Paris"), get_time()]``, optionally between
  ``<|python_start|>`` and ``<|python_end|>``; the values are Python literals, read
  with ``ast.literal_eval`` (never evaluated). A streamed reply that opens a list is held
  back whole and its calls come with its last chunk: Python's parser reads the list once,
  not once per chunk (a long list, or a deeply nested one, stays linear).

Every parser is a pure function of the text so far, ``parse(text, final)``, and its
answers only grow as the text grows (the content of a shorter text is a prefix of a longer
one's, its calls a prefix of the longer one's calls). ``ToolCallStream`` turns that into
OpenAI's stream deltas, so a stream's deltas assemble into exactly the whole answer.
Text that starts like a call but holds no complete, well-formed call is given back as
content; with at least one call, malformed blocks and text after the calls are dropped.
"""

from __future__ import annotations

import ast
import json
import secrets
from dataclasses import dataclass, field
from typing import ClassVar


@dataclass(frozen=True, slots=True)
class ParsedToolCall:
    """One call: the function's ``name`` and its ``arguments`` as compact JSON text."""

    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ParseResult:
    """``content``: the text outside the calls that is safe to show (while streaming, what
    may still turn out to be a call is held back); ``calls``: the complete calls so far."""

    content: str
    calls: tuple[ParsedToolCall, ...] = ()


def _call(obj, args_keys: tuple[str, ...] = ("arguments",)) -> ParsedToolCall | None:
    """``{"name": str, <args key>: object}`` as a call; None for anything else."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    for key in args_keys:
        if key in obj:
            args = obj[key]
            if isinstance(args, str):  # some models write the arguments as a JSON string
                try:
                    args = json.loads(args)
                except ValueError:
                    return None
            if not isinstance(args, dict):
                return None
            return ParsedToolCall(obj["name"], json.dumps(args, ensure_ascii=False))
    return ParsedToolCall(obj["name"], "{}")


_DECODER = json.JSONDecoder()


def _json_values(text: str, sep: str = "") -> tuple[list, str]:
    """The complete JSON values at the start of ``text`` (separated by whitespace and
    ``sep``), and what follows the last one."""
    values = []
    rest = text.lstrip()
    while rest:
        try:
            value, end = _DECODER.raw_decode(rest)
        except ValueError:
            break
        values.append(value)
        rest = rest[end:].lstrip()
        if sep and rest.startswith(sep):
            rest = rest[len(sep):].lstrip()
    return values, rest


def _held_back(text: str, marker: str) -> str:
    """``text`` without a trailing partial ``marker`` (or trailing whitespace), which more
    text might turn into the start of a call."""
    for cut in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-cut:]):
            return text[:-cut].rstrip()
    return text.rstrip()


class ToolParser:
    """Base of the parsers; ``parse`` is the whole interface."""

    name: ClassVar[str]
    # The format's markers are special tokens: the text must be decoded with them.
    needs_special_tokens: ClassVar[bool] = True

    def parse(self, text: str, final: bool) -> ParseResult:
        """The content and calls in ``text``, everything the model wrote so far; ``final``
        when it has finished (then nothing is held back)."""
        raise NotImplementedError


class HermesToolParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool) -> ParseResult:
        head, found, tail = text.partition(self.START)
        if not found:
            return ParseResult(text if final else _held_back(text, self.START))
        calls = []
        for block in (self.START + tail).split(self.START)[1:]:
            body, closed, _ = block.partition(self.END)
            if not closed and not final:
                break
            values, rest = _json_values(body)
            call = _call(values[0]) if len(values) == 1 and not rest else None
            if call is not None:
                calls.append(call)
        if final and not calls:
            return ParseResult(text)
        return ParseResult(head.rstrip(), tuple(calls))


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    needs_special_tokens = False  # <|python_tag|> is optional: the JSON alone is a call
    PYTHON_TAG = "<|python_tag|>"

    def parse(self, text: str, final: bool) -> ParseResult:
        body = text.lstrip()
        if body.startswith(self.PYTHON_TAG):
            body = body[len(self.PYTHON_TAG):]
        elif not body.startswith("{"):
            if not final and (not body or self.PYTHON_TAG.startswith(body)):
                return ParseResult("")  # may still become a call
            return ParseResult(text if final else text.rstrip())
        values, _ = _json_values(body, sep=";")
        calls = tuple(c for c in (_call(v, ("parameters", "arguments")) for v in values)
                      if c is not None)
        if final and not calls:
            return ParseResult(text)  # no call after all: the model answered in text
        return ParseResult("", calls)


class MistralToolParser(ToolParser):
    name = "mistral"
    START, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def parse(self, text: str, final: bool) -> ParseResult:
        head, found, tail = text.partition(self.START)
        if not found:
            return ParseResult(text if final else _held_back(text, self.START))
        calls: list[ParsedToolCall | None] = []
        if tail.lstrip().startswith("["):  # [{"name": ..., "arguments": ...}, ...]
            values, _ = _json_values(tail)
            if values and isinstance(values[0], list):
                calls = [_call(v) for v in values[0]]
        else:  # NAME[ARGS]{...}[TOOL_CALLS]NAME[ARGS]{...}
            for block in tail.split(self.START):
                name, has_args, args = block.partition(self.ARGS)
                values, _ = _json_values(args)
                if not has_args or not values:
                    if not final:
                        break
                    calls.append(None)
                    continue
                calls.append(_call({"name": name.strip(), "arguments": values[0]}))
        good = tuple(c for c in calls if c is not None)
        if final and not good:
            return ParseResult(text)
        return ParseResult(head.rstrip(), good)


def _python_call(node: ast.expr) -> ParsedToolCall | None:
    """``name(key=literal, ...)`` as a call; None for anything else (positional arguments,
    a value that is not a literal, a name that is not a plain identifier)."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    args = {}
    for keyword in node.keywords:
        if keyword.arg is None:  # **kwargs
            return None
        try:
            args[keyword.arg] = ast.literal_eval(keyword.value)
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return None
    try:
        return ParsedToolCall(node.func.id, json.dumps(args, ensure_ascii=False))
    except (TypeError, ValueError):  # a set, bytes or complex number: not JSON
        return None


def _python_calls(source: str) -> list[ParsedToolCall | None] | None:
    """The elements of the Python list ``source`` as calls (None where one is not a
    call); None when ``source`` is not a list."""
    try:
        tree = ast.parse(source, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree.body, ast.List):
        return None
    return [_python_call(e) for e in tree.body.elts]


class PythonicToolParser(ToolParser):
    name = "pythonic"
    needs_special_tokens = False  # the tags are optional: the list alone is the calls
    START, END = "<|python_start|>", "<|python_end|>"

    def parse(self, text: str, final: bool) -> ParseResult:
        body = text.lstrip()
        if body.startswith(self.START):
            body = body[len(self.START):].lstrip()
        elif not body.startswith("["):
            if not final and (not body or self.START.startswith(body)):
                return ParseResult("")  # may still become a call
            return ParseResult(text if final else text.rstrip())
        if not final:  # NOTE: one parse of the whole list at the end, not one per chunk
            return ParseResult("")
        calls = tuple(c for c in _python_calls(body.split(self.END, 1)[0].rstrip()) or ()
                      if c is not None)
        if not calls:
            return ParseResult(text)  # no call after all: the model answered in text
        return ParseResult("", calls)


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser,
                        PythonicToolParser)}


def tool_call_id() -> str:
    """A new tool call id, ``call_`` and 24 hex digits (OpenAI's shape)."""
    return f"call_{secrets.token_hex(12)}"


@dataclass(slots=True)
class ToolCallStream:
    """One choice's text read through ``parser`` as it streams: ``feed`` returns the new
    content and the calls completed since the last call (each with its id), so that the
    content deltas and call deltas add up to ``parser.parse(whole text, final=True)``.
    ``max_calls`` (1 when ``parallel_tool_calls`` is false) keeps only the first calls."""

    parser: ToolParser
    max_calls: int | None = None
    text: str = ""
    content_sent: int = 0
    calls: list[tuple[str, ParsedToolCall]] = field(default_factory=list)

    def feed(self, delta: str, final: bool) -> tuple[str, list[tuple[str, ParsedToolCall]]]:
        """Add ``delta``; the content to send now and the new ``(id, call)`` pairs."""
        self.text += delta
        result = self.parser.parse(self.text, final)
        content = result.content[self.content_sent:]
        self.content_sent = max(self.content_sent, len(result.content))
        wanted = result.calls[:self.max_calls] if self.max_calls else result.calls
        new = [(tool_call_id(), call) for call in wanted[len(self.calls):]]
        self.calls += new
        return content, new
