"""How one chat request's tools are called, as vLLM does it (``tool_choice``):

- ``none``: the tools are in the prompt (the chat template renders them) but the reply is
  plain text;
- ``auto``: the model decides; its text is read with the server's ``--tool-call-parser``
  (``router/tool_parsers.py``), which needs ``--enable-auto-tool-choice``;
- ``required``: structured decoding makes the model write a JSON list of calls,
  ``[{"name": ..., "parameters": {...}}, ...]``, each against its tool's parameters schema;
- a named function: structured decoding makes the model write that function's arguments,
  a JSON object valid against its parameters schema.

A reply with calls ends with ``finish_reason`` ``tool_calls``, except for a named function,
where OpenAI answers ``stop``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pdserve.engine.structured_output import StructuredOutputSpec, check_spec, json_schema_spec
from pdserve.router.protocol import ChatCompletionRequest, ChatTool, RequestError
from pdserve.router.tool_parsers import (
    TOOL_PARSERS,
    ParsedToolCall,
    ParseResult,
    ToolCallStream,
    ToolParser,
)

_ANY_OBJECT: dict[str, Any] = {"type": "object"}


class NamedFunctionParser(ToolParser):
    """The reply of a named ``tool_choice``: the function's arguments, a JSON object."""

    name = "named_function"
    needs_special_tokens = False

    def __init__(self, function: str) -> None:
        self.function = function

    def parse(self, text: str, final: bool) -> ParseResult:
        if not final:
            return ParseResult("")
        try:
            args = json.loads(text)
        except ValueError:
            args = None
        if not isinstance(args, dict):  # cut short (finish_reason "length"): the text
            return ParseResult(text)
        return ParseResult("", (ParsedToolCall(self.function,
                                               json.dumps(args, ensure_ascii=False)),))


class RequiredParser(ToolParser):
    """The reply of ``tool_choice: required``: ``[{"name": ..., "parameters": {...}}]``."""

    name = "required"
    needs_special_tokens = False

    def parse(self, text: str, final: bool) -> ParseResult:
        if not final:
            return ParseResult("")
        try:
            items = json.loads(text)
        except ValueError:
            items = None
        calls = tuple(ParsedToolCall(item["name"], json.dumps(item["parameters"],
                                                              ensure_ascii=False))
                      for item in items or () if isinstance(item, dict)
                      and isinstance(item.get("name"), str)
                      and isinstance(item.get("parameters"), dict)) \
            if isinstance(items, list) else ()
        return ParseResult("", calls) if calls else ParseResult(text)


def _spec(schema: dict[str, Any]) -> StructuredOutputSpec:
    """The structured output spec of ``schema``, checked.

    Raises:
        RequestError: 400 naming ``tools``: a tool's parameters do not compile.
    """
    try:
        spec = json_schema_spec(schema)
        check_spec(spec)
    except ValueError as exc:
        raise RequestError(f"a tool's parameters are not a usable JSON schema: {exc}",
                           "tools") from exc
    return spec


def required_schema(tools: list[ChatTool], parallel: bool) -> dict[str, Any]:
    """The JSON schema of a ``required`` reply: a list of at least one call (at most one
    without ``parallel_tool_calls``), each naming one of ``tools`` with valid parameters."""
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "properties": {
            "name": {"type": "string", "enum": [t.function.name]},
            "parameters": t.function.parameters or _ANY_OBJECT},
         "required": ["name", "parameters"], "additionalProperties": False}
        for t in tools]}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


@dataclass(frozen=True, slots=True)
class ToolCalling:
    """A request's tool calling: the parser its replies are read with, at most
    ``max_calls`` calls per reply, the structured output ``spec`` (a JSON schema) the
    reply is held to (``required`` and named choices; applied in the sampler of whichever
    worker samples, engine/structured_output.py), and whether a reply with calls
    finishes with ``tool_calls``."""

    parser: ToolParser
    max_calls: int | None = None
    spec: StructuredOutputSpec | None = None
    finish_as_tool_calls: bool = True

    @classmethod
    def of(cls, request: ChatCompletionRequest, config) -> ToolCalling | None:
        """The request's tool calling under the router's ``config`` (``RouterConfig``);
        None when its replies are plain text.

        Raises:
            RequestError: 400 naming the field: ``tool_choice`` ``auto`` on a router
                without ``--enable-auto-tool-choice``; ``required`` or a named function
                beside another structured output constraint or ``min_tokens``; a tool's
                ``parameters`` that xgrammar cannot compile.
        """
        choice = request.effective_tool_choice()
        if not request.tools or choice == "none":
            return None
        max_calls = None if request.parallel_tool_calls else 1
        if choice == "auto":
            if not config.enable_auto_tool_choice:
                raise RequestError('"auto" tool choice requires --enable-auto-tool-choice '
                                   'and --tool-call-parser to be set', "tool_choice")
            return cls(TOOL_PARSERS[config.tool_call_parser](), max_calls)
        if request.structured_output_spec() is not None:
            raise RequestError("tool_choice 'required' or a named function is itself a "
                               "structured output: drop response_format / "
                               "structured_outputs / guided_*", "tool_choice")
        if request.min_tokens:
            raise RequestError("min_tokens cannot be combined with tool_choice 'required' "
                               "or a named function", "min_tokens")
        if choice == "required":
            return cls(RequiredParser(), max_calls, _spec(
                required_schema(request.tools, request.parallel_tool_calls)))
        (tool,) = [t for t in request.tools if t.function.name == choice.function.name]
        return cls(NamedFunctionParser(tool.function.name), 1,
                   _spec(tool.function.parameters or _ANY_OBJECT), finish_as_tool_calls=False)

    @property
    def needs_special_tokens(self) -> bool:
        """The parser's markers are special tokens: decode the reply with them."""
        return self.parser.needs_special_tokens

    def stream(self) -> ToolCallStream:
        """A reader for one choice's reply."""
        return ToolCallStream(self.parser, self.max_calls)
