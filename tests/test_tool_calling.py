"""Tool calling end to end, as agent frameworks use it through the openai SDK: the tools
reach the chat template, ``auto`` replies are read with the llama3_json parser (the demo
model's template writes Llama 3.1's JSON calls), ``required`` and named choices are held
to valid calls by structured decoding even on random weights, streamed deltas assemble
into the same calls, and a whole tool loop (call, result, answer) runs."""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import jsonschema
import pytest
from inproc_cluster import in_process_cluster

from pdserve.engine import SamplingParams
from pdserve.engine.tokenizer import apply_chat_template
from pdserve.router.protocol import ChatCompletionRequest, RequestError
from pdserve.router.tool_calling import ToolCalling
from pdserve.router.tool_parsers import Llama3JsonToolParser

MAX_MODEL_LEN = 1024
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "utc_offset": {"type": "integer", "minimum": -12, "maximum": 14}},
        "required": ["utc_offset"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with in_process_cluster(tmp_path_factory.mktemp("tools"), MAX_MODEL_LEN,
                            local_prefill_threshold=8, disaggregation="always",
                            enable_auto_tool_choice=True,
                            tool_call_parser="llama3_json") as c:
        yield c


def check_call(call) -> None:
    """A call names one of the tools and its arguments validate against its schema."""
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_tools_reach_the_template_and_auto_replies_go_through_the_parser(cluster):
    client = cluster.client()
    plain = client.chat.completions.create(model=cluster.router.served_model_name, messages=ASK, max_tokens=24,
                                           temperature=0)
    auto = client.chat.completions.create(model=cluster.router.served_model_name, messages=ASK, tools=TOOLS,
                                          max_tokens=24, temperature=0)
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens + 40  # the tool list
    tokenizer = cluster.router.tokenizer
    prompt = apply_chat_template(tokenizer, ASK, tools=TOOLS)
    assert auto.usage.prompt_tokens == len(prompt)
    text = cluster.oracle.generate([prompt], SamplingParams(temperature=0, max_tokens=24))[
        0].outputs[0].text
    expected = Llama3JsonToolParser().parse(text, final=True)
    message = auto.choices[0].message
    assert (message.content or "") == expected.content
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls or ()] == [
        (c.name, c.arguments) for c in expected.calls]


@pytest.mark.parametrize("seed", range(4))
def test_a_named_tool_choice_yields_a_valid_call_from_random_weights(cluster, seed):
    reply = cluster.client().chat.completions.create(
        model=cluster.router.served_model_name, messages=ASK, tools=TOOLS, temperature=1.0, seed=seed, max_tokens=200,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"  # OpenAI's answer to a named choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    check_call(call)


def test_required_yields_valid_calls_and_parallel_false_one(cluster):
    client = cluster.client()
    reply = client.chat.completions.create(model=cluster.router.served_model_name, messages=ASK, tools=TOOLS, n=4,
                                           tool_choice="required", temperature=1.0, seed=7,
                                           max_tokens=300)
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            check_call(call)
    single = client.chat.completions.create(model=cluster.router.served_model_name, messages=ASK, tools=TOOLS,
                                            tool_choice="required", temperature=1.0,
                                            seed=3, max_tokens=300,
                                            parallel_tool_calls=False)
    assert len(single.choices[0].message.tool_calls) == 1


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function",
                                                      "function": {"name": "get_time"}}])
def test_streamed_deltas_assemble_into_the_same_calls(cluster, tool_choice):
    client = cluster.client()
    kwargs = {"model": cluster.router.served_model_name, "messages": ASK, "tools": TOOLS, "tool_choice": tool_choice,
              "temperature": 1.0, "seed": 11, "max_tokens": 300}
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or ():
                call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = delta.id or call["id"]
                if delta.function is not None:
                    call["name"] += delta.function.name or ""
                    call["arguments"] += delta.function.arguments or ""
    assert finish == whole.finish_reason
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert all(c["id"].startswith("call_") for c in calls.values())


def test_a_whole_tool_loop_through_the_sdk(cluster):
    client = cluster.client()
    messages = list(ASK)
    first = client.chat.completions.create(model=cluster.router.served_model_name, messages=messages, tools=TOOLS,
                                           tool_choice="required", temperature=1.0, seed=1,
                                           max_tokens=300)
    message = first.choices[0].message
    assert message.tool_calls
    messages.append(message.model_dump(exclude_none=True))  # content null, tool_calls
    for call in message.tool_calls:
        messages.append({"role": "tool", "tool_call_id": call.id,
                         "content": json.dumps({"temperature": 18, "sky": "clear"})})
    answer = client.chat.completions.create(model=cluster.router.served_model_name, messages=messages, tools=TOOLS,
                                            tool_choice="none", max_tokens=16, temperature=0)
    assert answer.choices[0].message.content  # the model answers in text
    assert not answer.choices[0].message.tool_calls
    # The calls and the result reached the prompt, rendered by the template.
    tokenizer = cluster.router.tokenizer
    history = [m if m["role"] != "assistant" else {**m, "tool_calls": [
        {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
        for c in m["tool_calls"]]} for m in messages]
    assert answer.usage.prompt_tokens == len(apply_chat_template(tokenizer, history,
                                                                 tools=TOOLS))
    cluster.wait_all_blocks_free()


BAD = [
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": TOOLS, "messages": [*ASK, {"role": "tool", "content": "x"}]}, "messages"),
    ({"messages": [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]},
     "messages"),
    ({"messages": [*ASK, {"role": "user", "content": None}]}, "messages"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "min_tokens": 2}, "min_tokens"),
    ({"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "nonsense"}}}], "tool_choice": "required"},
     "tools"),
    ({"functions": [{"name": "f"}]}, "functions"),
]


@pytest.mark.parametrize("extra, param", BAD)
def test_bad_tool_requests_are_400_naming_the_field(cluster, extra, param):
    body = {"model": cluster.router.served_model_name, "messages": ASK, "max_tokens": 4, **extra}
    reply = httpx.post(f"{cluster.url}/v1/chat/completions", json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"].startswith(param), reply.text


def test_auto_needs_the_servers_flags():
    request = ChatCompletionRequest(messages=ASK, tools=TOOLS)
    off = SimpleNamespace(enable_auto_tool_choice=False, tool_call_parser=None)
    with pytest.raises(RequestError) as info:
        ToolCalling.of(request, off)
    assert info.value.param == "tool_choice"
    assert ToolCalling.of(ChatCompletionRequest(messages=ASK, tools=TOOLS,
                                                tool_choice="none"), off) is None


def test_chat_template_kwargs_reach_the_template(cluster):
    tokenizer = cluster.router.tokenizer
    saved = tokenizer.chat_template
    tokenizer.chat_template = "{{ bos_token }}{{ greeting }}{{ messages[0]['content'] }}"
    try:
        ids = apply_chat_template(tokenizer, ASK, template_kwargs={"greeting": "Hello! "})
    finally:
        tokenizer.chat_template = saved
    assert tokenizer.decode(ids).endswith("Hello! What is the weather in Paris?")


def test_auto_tool_choice_without_a_parser_stops_serve_before_it_starts():
    import subprocess
    import sys

    from pdserve.entrypoints.redis_server import free_port

    done = subprocess.run([sys.executable, "-m", "pdserve.entrypoints.cli", "serve",
                           "--enable-auto-tool-choice", "--port", str(free_port())],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stderr
    assert "--tool-call-parser" in done.stderr
