"""The tool-call parsers (router/tool_parsers.py) on each format's text, whole and
streamed in every split: the stream's deltas assemble into the whole answer."""

from __future__ import annotations

import json
import random

import pytest

from pdserve.router.tool_parsers import TOOL_PARSERS, ParsedToolCall, ToolCallStream

WEATHER = ParsedToolCall("get_weather", json.dumps({"city": "Paris", "unit": "c"}))
TIME = ParsedToolCall("get_time", json.dumps({"tz": "Europe/Paris"}))

CASES = [
    # parser, text, content, calls
    ("hermes", ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
     '{"city": "Paris", "unit": "c"}}\n</tool_call>'), "Let me check.", [WEATHER]),
    ("hermes", ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
     '"c"}}</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"tz": '
     '"Europe/Paris"}}</tool_call>'), "", [WEATHER, TIME]),
    ("hermes", "Just text, < and <tool no call.", "Just text, < and <tool no call.", []),
    ("hermes", "Broken <tool_call>{not json}</tool_call>",
     "Broken <tool_call>{not json}</tool_call>", []),
    ("hermes", 'unfinished <tool_call>{"name": "get_weather", "argu',
     'unfinished <tool_call>{"name": "get_weather", "argu', []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}',
     "", [WEATHER]),
    ("llama3_json", ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", '
     '"unit": "c"}}; {"name": "get_time", "arguments": {"tz": "Europe/Paris"}}'), "",
     [WEATHER, TIME]),
    ("llama3_json", "The weather is fine.", "The weather is fine.", []),
    ("llama3_json", "{ not a call", "{ not a call", []),
    ("llama3_json", '{"city": "Paris"}', '{"city": "Paris"}', []),
    ("mistral", ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", '
     '"unit": "c"}}, {"name": "get_time", "arguments": {"tz": "Europe/Paris"}}]'), "",
     [WEATHER, TIME]),
    ("mistral", ('Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "c"}'
     '[TOOL_CALLS]get_time[ARGS]{"tz": "Europe/Paris"}'), "Sure.", [WEATHER, TIME]),
    ("mistral", "[TOOL plain", "[TOOL plain", []),
    ("pythonic", '[get_weather(city="Paris", unit=\'c\'), get_time(tz="Europe/Paris")]', "",
     [WEATHER, TIME]),
    ("pythonic", ('<|python_start|>[get_weather(city="Paris", unit="c")]<|python_end|>'),
     "", [WEATHER]),
    ("pythonic", "[no_args(), get_time(tz='Europe/Paris')]", "",
     [ParsedToolCall("no_args", "{}"), TIME]),
    ("pythonic", ('[f(x={"a": [1, 2.5, None, True]}, s="a ) ] \\" quote")]'), "",
     [ParsedToolCall("f", json.dumps({"x": {"a": [1, 2.5, None, True]},
                                      "s": 'a ) ] " quote'}))]),
    ("pythonic", '[get_weather(city="Paris", unit="c"), broken(',
     '[get_weather(city="Paris", unit="c"), broken(', []),
    ("pythonic", "[f(x=" + "[" * 5000 + "]" * 5000 + ")]",
     "[f(x=" + "[" * 5000 + "]" * 5000 + ")]", []),
    ("pythonic", "[get_weather(\"Paris\"), os.system(cmd='x'), f(y=__import__('os'))]",
     "[get_weather(\"Paris\"), os.system(cmd='x'), f(y=__import__('os'))]", []),
    ("pythonic", "[1, 2, 3]", "[1, 2, 3]", []),
    ("pythonic", "The weather is fine.", "The weather is fine.", []),
]


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_whole_text(name, text, content, calls):
    result = TOOL_PARSERS[name]().parse(text, final=True)
    assert result.content == content
    assert list(result.calls) == calls


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_streamed_deltas_assemble_into_the_whole_answer(name, text, content, calls):
    rng = random.Random(0)
    splits = [list(range(1, len(text)))]  # every character its own delta
    splits += [sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 8))))
               for _ in range(30)]
    for cuts in splits:
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        stream = ToolCallStream(TOOL_PARSERS[name]())
        got_content, got_calls = "", []
        for i, piece in enumerate(pieces):
            delta, new = stream.feed(piece, final=i == len(pieces) - 1)
            got_content += delta
            got_calls += [call for _, call in new]
        assert (got_content, got_calls) == (content, calls), cuts


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = CASES[1][1]
    stream = ToolCallStream(TOOL_PARSERS["hermes"](), max_calls=1)
    _, calls = stream.feed(text, final=True)
    assert [c for _, c in calls] == [WEATHER]
    assert calls[0][0].startswith("call_") and len(calls[0][0]) == 29
