"""What the router makes of a prompt beyond its text: its log-probabilities (vLLM's
``prompt_logprobs``, and ``echo`` with ``logprobs`` as lm-evaluation-harness asks for
them, through both prefill paths and the gRPC API), ``max_tokens: 0`` with echo,
``truncate_prompt_tokens``, ``add_special_tokens``, ``continue_final_message``, a chat's
``echo``, ``documents`` and own ``chat_template``, ``return_tokens_as_token_ids``,
``stream_options.continuous_usage_stats`` and ``/tokenizer_info``. A real Redis, one prefill and one decode worker in this process on
the demo model; the oracle is ``pdserve.engine.LLM`` on the same checkpoint."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from router_cases import CHAT, MAX_MODEL_LEN, PROMPT, router_cluster

from pdserve.engine.tokenizer import apply_chat_template, encode_prompt
from pdserve.router.config import RouterConfig
from pdserve.router.http import build_app
from pdserve.router.model_service import ModelService


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with router_cluster(tmp_path_factory.mktemp("router_prompts")) as c:
        yield c


def _engine_prompt_logprobs(cluster, prompt_ids: list[int], num_top: int) -> list:
    """The offline engine's prompt logprobs: per position None or {token id: TokenLogprob}."""
    from pdserve.engine import SamplingParams

    out = cluster.oracle.generate([prompt_ids], SamplingParams(
        temperature=0.0, max_tokens=1, prompt_logprobs=num_top))[0]
    return out.prompt_logprobs


@pytest.mark.parametrize("prompt", [PROMPT, "Hi there"], ids=["prefill-worker", "decode-worker"])
def test_echo_with_logprobs_starts_with_the_prompts_logprobs(cluster, prompt):
    """lm-evaluation-harness's loglikelihood request (echo, logprobs=1, one token): the
    prompt's logprobs come from whichever worker prefilled it, equal to the engine's."""
    ids = encode_prompt(cluster.router.tokenizer, prompt)
    assert (len(ids) >= 16) == (prompt == PROMPT)  # a full block: disaggregated
    expected = _engine_prompt_logprobs(cluster, ids, 1)
    for _ in range(2):  # the second would hit the prefix cache without prompt logprobs
        reply = cluster.client().completions.create(
            model=str(cluster.model), prompt=prompt, max_tokens=1, temperature=0, echo=True,
            logprobs=1, extra_body={"ignore_eos": True})
        choice = reply.choices[0]
        assert choice.text.startswith(prompt)
        lp = choice.logprobs
        assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None
        assert lp.top_logprobs[0] is None and lp.text_offset[0] == 0
        for i in range(1, len(ids)):
            token = lp.tokens[i]
            assert lp.token_logprobs[i] == pytest.approx(expected[i][ids[i]].logprob, abs=1e-3)
            best = max(expected[i].items(), key=lambda kv: kv[1].logprob)[0]
            assert token in lp.top_logprobs[i] and len(lp.top_logprobs[i]) <= 2
            assert (best == ids[i]) == (len(lp.top_logprobs[i]) == 1)
        # offsets run on over the prompt's tokens into the generated ones, as vLLM's do
        assert all(lp.text_offset[i] == lp.text_offset[i - 1] + len(lp.tokens[i - 1])
                   for i in range(1, len(lp.tokens)))
        assert lp.token_logprobs[-1] <= 0 and reply.usage.prompt_tokens_details.cached_tokens == 0
    cluster.wait_all_blocks_free()


def test_prompt_logprobs_in_vllms_shape_for_both_apis(cluster):
    client = cluster.client()
    ids = encode_prompt(cluster.router.tokenizer, PROMPT)
    expected = _engine_prompt_logprobs(cluster, ids, 2)
    reply = client.completions.create(model=str(cluster.model), prompt=PROMPT, max_tokens=2,
                                      temperature=0, extra_body={"prompt_logprobs": 2})
    got = reply.choices[0].model_extra["prompt_logprobs"]
    assert reply.choices[0].logprobs is None and len(got) == len(ids) and got[0] is None
    for i in range(1, len(ids)):
        assert set(expected[i]) <= {int(t) for t in got[i]} and len(got[i]) in (2, 3)
        own = got[i][str(ids[i])]
        assert own["logprob"] == pytest.approx(expected[i][ids[i]].logprob, abs=1e-3)
        assert own["rank"] == expected[i][ids[i]].rank
        assert own["decoded_token"] == cluster.router.tokenizer.decode([ids[i]])
    chat_ids = apply_chat_template(cluster.router.tokenizer, CHAT)
    chat = client.chat.completions.create(model=str(cluster.model), messages=CHAT, max_tokens=2,
                                          temperature=0, n=2, extra_body={"prompt_logprobs": 0})
    got = chat.model_extra["prompt_logprobs"]
    expected = _engine_prompt_logprobs(cluster, chat_ids, 0)
    assert len(got) == len(chat_ids) and got[0] is None
    assert [list(g) for g in got[1:]] == [[str(t)] for t in chat_ids[1:]]
    assert all(got[i][str(t)]["logprob"] == pytest.approx(expected[i][t].logprob, abs=1e-3)
               for i, t in enumerate(chat_ids) if i)
    plain = client.completions.create(model=str(cluster.model), prompt=PROMPT, max_tokens=1)
    assert plain.choices[0].model_extra["prompt_logprobs"] is None
    cluster.wait_all_blocks_free()


def test_streamed_echo_carries_the_prompts_logprobs_first(cluster):
    ids = encode_prompt(cluster.router.tokenizer, PROMPT)
    chunks = list(cluster.client().completions.create(
        model=str(cluster.model), prompt=PROMPT, max_tokens=3, temperature=0, echo=True,
        logprobs=0, stream=True, extra_body={"ignore_eos": True}))
    logprobs = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert len(logprobs[0].tokens) == len(ids) + 1 and logprobs[0].token_logprobs[0] is None
    assert sum(len(lp.tokens) for lp in logprobs) == len(ids) + 3
    tokens = [t for lp in logprobs for t in lp.tokens]
    offsets = [o for lp in logprobs for o in lp.text_offset]
    assert all(offsets[i] == offsets[i - 1] + len(tokens[i - 1]) for i in range(1, len(tokens)))
    assert "".join(c.choices[0].text for c in chunks if c.choices).startswith(PROMPT)


@pytest.mark.parametrize(("body", "words"), [
    ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "stream"),
    ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt": "x", "prompt_logprobs": "2"}, "prompt_logprobs"),
])
def test_bad_prompt_logprobs_are_refused(cluster, body, words):
    reply = httpx.post(cluster.url + "/v1/completions", json=body | {"model": str(cluster.model)})
    assert reply.status_code == 400, reply.text
    assert words in reply.json()["error"]["message"] and \
        reply.json()["error"]["param"] == "prompt_logprobs"


def test_grpc_generate_sends_prompt_logprobs_on_its_first_message(cluster):
    import grpc

    from pdserve.proto import common_pb2, router_pb2, router_pb2_grpc
    from pdserve.router.grpc_server import GRPCLimits, start_grpc_server

    def call(coro):
        return asyncio.run_coroutine_threadsafe(coro, cluster.loop).result(30)

    ids = encode_prompt(cluster.router.tokenizer, PROMPT)
    expected = _engine_prompt_logprobs(cluster, ids, 1)
    server, port = call(start_grpc_server(cluster.router, "127.0.0.1", 0, limits=GRPCLimits()))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            params = common_pb2.SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True,
                                               prompt_logprobs=1)
            messages = list(stub.Generate(router_pb2.GenerateRequest(
                text=PROMPT, sampling_params=params), timeout=30))
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.Generate(router_pb2.GenerateRequest(
                    text=PROMPT, sampling_params=common_pb2.SamplingParams(
                        max_tokens=1, prompt_logprobs=21)), timeout=30))
    finally:
        call(server.stop(0))
    first = next(m for m in messages if m.token_ids)
    assert [lp.token_id for lp in first.prompt_logprobs] == ids[1:]
    for i, lp in enumerate(first.prompt_logprobs, start=1):
        assert lp.logprob == pytest.approx(expected[i][ids[i]].logprob, abs=1e-3)
        assert len(lp.top) == 1 and lp.rank == expected[i][ids[i]].rank
    assert not any(m.prompt_logprobs for m in messages if m is not first)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt_logprobs" in refused.value.details()
    cluster.wait_all_blocks_free()


def test_max_tokens_0_with_echo_answers_with_the_prompt_alone(cluster):
    """OpenAI's legacy scoring request, which vLLM answers too: the prompt's text and
    logprobs, no generated token (the engine's one is left out), in full and streamed."""
    ids = encode_prompt(cluster.router.tokenizer, PROMPT)
    client = cluster.client()
    reply = client.completions.create(model=str(cluster.model), prompt=PROMPT, max_tokens=0,
                                      echo=True, logprobs=0, temperature=0)
    choice = reply.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == len(ids) and choice.logprobs.token_logprobs[0] is None
    assert reply.usage.completion_tokens == 0 and reply.usage.prompt_tokens == len(ids)
    chunks = list(client.completions.create(model=str(cluster.model), prompt=PROMPT,
                                            max_tokens=0, echo=True, logprobs=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == PROMPT
    assert [len(c.choices[0].logprobs.tokens) for c in chunks if c.choices] == [len(ids)]
    refused = httpx.post(cluster.url + "/v1/completions", json={
        "model": str(cluster.model), "prompt": PROMPT, "max_tokens": 0})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"
    cluster.wait_all_blocks_free()


def test_tokenizer_info_is_served_only_when_enabled(cluster):
    """vLLM's ``/tokenizer_info`` behind its flag: what lm-evaluation-harness's remote
    tokenizer checks for (``eos_token``) beside ``/tokenize``."""
    from fastapi.testclient import TestClient

    off = httpx.get(cluster.url + "/tokenizer_info")
    assert off.status_code == 404 and "--enable-tokenizer-info-endpoint" in off.text
    db = cluster.redis_url.rsplit("/", 1)[0] + "/6"
    router = ModelService(RouterConfig(str(cluster.model), db, max_model_len=MAX_MODEL_LEN,
                                       enable_tokenizer_info_endpoint=True))
    tokenizer = router.tokenizer
    with TestClient(build_app(router)) as http:
        info = http.get("/tokenizer_info").json()
        assert http.get("/tokenizer_info", params={"model": "nope"}).status_code == 404
        tokens = http.post("/tokenize", json={"prompt": PROMPT, "add_special_tokens": False})
    assert info["eos_token"] == tokenizer.eos_token and info["model_max_length"] == MAX_MODEL_LEN
    assert info["bos_token"] == tokenizer.bos_token and "pad_token" in info
    assert info["chat_template"] == tokenizer.chat_template and info["chat_template"]
    assert info["tokenizer_class"] == type(tokenizer).__name__
    assert tokens.json()["tokens"] == tokenizer.encode(PROMPT, add_special_tokens=False)


def test_continue_final_message_goes_on_the_assistants_last_message(cluster):
    tokenizer = cluster.router.tokenizer
    messages = CHAT + [{"role": "assistant", "content": "The sea is"}]
    ids = apply_chat_template(tokenizer, messages, add_generation_prompt=False,
                              continue_final_message=True)
    assert ids[-len(tokenizer.encode(" is", add_special_tokens=False)):] == \
        tokenizer.encode(" is", add_special_tokens=False)  # no end-of-turn after it
    body = {"model": str(cluster.model), "messages": messages, "max_tokens": 6,
            "temperature": 0, "ignore_eos": True, "add_generation_prompt": False,
            "continue_final_message": True}
    reply = httpx.post(cluster.url + "/v1/chat/completions", json=body).json()
    assert reply["usage"]["prompt_tokens"] == len(ids)
    assert reply["choices"][0]["message"]["content"] == cluster.expected(
        ids, temperature=0.0, max_tokens=6, ignore_eos=True)
    tokens = httpx.post(cluster.url + "/tokenize", json={
        "model": str(cluster.model), "messages": messages, "add_generation_prompt": False,
        "continue_final_message": True}).json()["tokens"]
    assert tokens == ids
    for path in ("/v1/chat/completions", "/tokenize"):
        both = httpx.post(cluster.url + path, json={k: v for k, v in body.items() if k in (
            "model", "messages", "continue_final_message")})  # add_generation_prompt: true
        assert both.status_code == 400 and \
            both.json()["error"]["param"] == "continue_final_message", path


def test_truncate_prompt_tokens_keeps_the_prompts_end(cluster):
    client = cluster.client()
    ids = encode_prompt(cluster.router.tokenizer, PROMPT)
    reply = client.completions.create(
        model=str(cluster.model), prompt=PROMPT, max_tokens=4, temperature=0, echo=True,
        extra_body={"ignore_eos": True, "truncate_prompt_tokens": 6})
    kept = cluster.router.tokenizer.decode(ids[-6:])
    assert reply.usage.prompt_tokens == 6 and reply.choices[0].text.startswith(kept)
    assert reply.choices[0].text == kept + cluster.expected(ids[-6:], temperature=0.0,
                                                            max_tokens=4, ignore_eos=True)
    whole = client.chat.completions.create(model=str(cluster.model), messages=CHAT,
                                           max_tokens=1, extra_body={"truncate_prompt_tokens": -1})
    chat_ids = apply_chat_template(cluster.router.tokenizer, CHAT)
    assert whole.usage.prompt_tokens == len(chat_ids)  # shorter than max_model_len: as is
    short = client.chat.completions.create(model=str(cluster.model), messages=CHAT,
                                           max_tokens=1, extra_body={"truncate_prompt_tokens": 3})
    assert short.usage.prompt_tokens == 3
    for value in (0, -2, "5"):
        refused = httpx.post(cluster.url + "/v1/completions", json={
            "model": str(cluster.model), "prompt": PROMPT, "truncate_prompt_tokens": value})
        assert refused.status_code == 400 and \
            refused.json()["error"]["param"] == "truncate_prompt_tokens", value


def test_add_special_tokens_false_leaves_the_bos_out(cluster):
    tokenizer = cluster.router.tokenizer
    with_bos = encode_prompt(tokenizer, PROMPT)
    bare = tokenizer.encode(PROMPT, add_special_tokens=False)
    assert len(bare) < len(with_bos)  # the demo tokenizer adds a BOS
    reply = cluster.client().completions.create(
        model=str(cluster.model), prompt=PROMPT, max_tokens=4, temperature=0,
        extra_body={"ignore_eos": True, "add_special_tokens": False})
    assert reply.usage.prompt_tokens == len(bare)
    assert reply.choices[0].text == cluster.expected(bare, temperature=0.0, max_tokens=4,
                                                     ignore_eos=True)


def test_the_choices_of_a_prompt_share_its_logprobs_and_a_request_is_bounded(cluster):
    """n choices of one prompt: only the first asks a worker for the prompt's logprobs
    (a full answer), every choice shows them. All a request's prompt logprobs together
    are bounded, as the router holds them in memory."""
    from pdserve.router.protocol.validation import MAX_REQUEST_PROMPT_LOGPROB_ENTRIES

    ids = encode_prompt(cluster.router.tokenizer, PROMPT)
    expected = _engine_prompt_logprobs(cluster, ids, 1)
    reply = cluster.client().completions.create(
        model=str(cluster.model), prompt=[PROMPT, "Hi there"], n=2, max_tokens=2,
        temperature=1.0, seed=3, echo=True, logprobs=1, extra_body={"prompt_logprobs": 1})
    assert len(reply.choices) == 4
    first, second = reply.choices[0], reply.choices[1]
    for choice in (first, second):
        assert choice.logprobs.token_logprobs[1:len(ids)] == pytest.approx(
            [expected[i][ids[i]].logprob for i in range(1, len(ids))], abs=1e-3)
        assert choice.model_extra["prompt_logprobs"] == first.model_extra["prompt_logprobs"]
    hi = reply.choices[3].model_extra["prompt_logprobs"]
    assert hi == reply.choices[2].model_extra["prompt_logprobs"] and hi[0] is None
    assert len(hi) == len(encode_prompt(cluster.router.tokenizer, "Hi there"))
    many = [[5] * 250] * (MAX_REQUEST_PROMPT_LOGPROB_ENTRIES // (250 * 21) + 1)
    refused = httpx.post(cluster.url + "/v1/completions", json={
        "model": str(cluster.model), "prompt": many, "max_tokens": 1, "prompt_logprobs": 20})
    assert refused.status_code == 400 and "per request" in refused.json()["error"]["message"]
    assert refused.json()["error"]["param"] == "prompt_logprobs"
    cluster.wait_all_blocks_free()


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(cluster):
    ids = encode_prompt(cluster.router.tokenizer, PROMPT)
    for path, body in (("/v1/completions", {"prompt": PROMPT}),
                       ("/v1/chat/completions", {"messages": CHAT})):
        with httpx.stream("POST", cluster.url + path, timeout=60, json=body | {
                "model": str(cluster.model), "max_tokens": 4, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True,
                                                   "continuous_usage_stats": True}}) as reply:
            events = [line[6:] for line in reply.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        chunks = [json.loads(e) for e in events]
        assert all(c["usage"] is not None for c in chunks), path
        counts = [c["usage"]["completion_tokens"] for c in chunks]
        assert counts == sorted(counts) and counts[-1] == 4, (path, counts)
        assert chunks[-1]["choices"] == [] and (path == "/v1/chat/completions" or
                                                chunks[0]["usage"]["prompt_tokens"] == len(ids))
    refused = httpx.post(cluster.url + "/v1/completions", json={
        "model": str(cluster.model), "prompt": PROMPT, "stream": True,
        "stream_options": {"include_usage": True, "continuous": True}})
    assert refused.status_code == 400 and "continuous" in refused.json()["error"]["message"]


def test_return_tokens_as_token_ids_names_every_logprob_token_by_its_id(cluster):
    client = cluster.client()
    reply = client.completions.create(
        model=str(cluster.model), prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2,
        echo=True, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    lp = reply.choices[0].logprobs
    ids = encode_prompt(cluster.router.tokenizer, PROMPT)
    assert lp.tokens[:len(ids)] == [f"token_id:{t}" for t in ids]
    assert all(t.startswith("token_id:") for top in lp.top_logprobs[1:] for t in top)
    chat = client.chat.completions.create(
        model=str(cluster.model), messages=CHAT, max_tokens=3, temperature=0, logprobs=True,
        top_logprobs=2, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    content = chat.choices[0].logprobs.content
    assert all(e.token.startswith("token_id:") and e.bytes == list(e.token.encode())
               for e in content)
    assert all(t.token.startswith("token_id:") for e in content for t in e.top_logprobs)


def test_chat_echo_starts_the_reply_with_the_assistants_last_message(cluster):
    messages = CHAT + [{"role": "assistant", "content": "The sea is"}]
    ids = apply_chat_template(cluster.router.tokenizer, messages, add_generation_prompt=False,
                              continue_final_message=True)
    expected = "The sea is" + cluster.expected(ids, temperature=0.0, max_tokens=5,
                                               ignore_eos=True)
    body = {"model": str(cluster.model), "messages": messages, "max_tokens": 5,
            "temperature": 0, "ignore_eos": True, "add_generation_prompt": False,
            "continue_final_message": True, "echo": True}
    full = httpx.post(cluster.url + "/v1/chat/completions", json=body).json()
    assert full["choices"][0]["message"]["content"] == expected
    with httpx.stream("POST", cluster.url + "/v1/chat/completions", timeout=60,
                      json=body | {"stream": True}) as reply:
        chunks = [json.loads(line[6:]) for line in reply.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0]["role"] == "assistant" and deltas[1]["content"] == "The sea is"
    assert "".join(d.get("content") or "" for d in deltas) == expected
    user_last = httpx.post(cluster.url + "/v1/chat/completions", json={
        "model": str(cluster.model), "messages": CHAT, "max_tokens": 3, "temperature": 0,
        "ignore_eos": True, "echo": True}).json()
    assert user_last["choices"][0]["message"]["content"] == cluster.expected(
        CHAT, temperature=0.0, max_tokens=3, ignore_eos=True)  # nothing of the user's


def test_documents_reach_the_chat_template(cluster):
    """vLLM's ``documents`` are the template's ``documents`` variable (retrieval-augmented
    templates list them); a template without them ignores them."""
    from types import SimpleNamespace

    from pdserve.engine.tokenizer import load_tokenizer
    from pdserve.router.http_openai import _chat_prompt
    from pdserve.router.protocol import ChatCompletionRequest

    tokenizer = load_tokenizer(cluster.model)
    tokenizer.chat_template = ("{% for d in documents %}[{{ d.title }}: {{ d.text }}]"
                               "{% endfor %}{% for m in messages %}{{ m.content }}"
                               "{% endfor %}")
    docs = [{"title": "Tide", "text": "the sea rises twice a day"}]
    request = ChatCompletionRequest(messages=CHAT, documents=docs)
    text = tokenizer.decode(_chat_prompt(SimpleNamespace(tokenizer=tokenizer), request))
    assert "[Tide: the sea rises twice a day]" in text and CHAT[1]["content"] in text
    reply = httpx.post(cluster.url + "/v1/chat/completions", json={
        "model": str(cluster.model), "messages": CHAT, "max_tokens": 2, "documents": docs})
    assert reply.status_code == 200, reply.text
    refused = httpx.post(cluster.url + "/v1/chat/completions", json={
        "model": str(cluster.model), "messages": CHAT, "documents": [{"title": 3}]})
    assert refused.status_code == 400 and "documents" in refused.json()["error"]["param"]


def test_a_requests_own_chat_template_is_rendered_only_when_trusted(cluster):
    from types import SimpleNamespace

    from pdserve.router.http_openai import _chat_prompt
    from pdserve.router.protocol import ChatCompletionRequest
    from pdserve.router.protocol.errors import RequestError

    template = "{% for m in messages %}<<{{ m.role }}|{{ m.content }}>>{% endfor %}"
    refused = httpx.post(cluster.url + "/v1/chat/completions", json={
        "model": str(cluster.model), "messages": CHAT, "chat_template": template})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template"
    assert "--trust-request-chat-template" in refused.json()["error"]["message"]
    tokenizer = cluster.router.tokenizer
    trusted = SimpleNamespace(tokenizer=tokenizer,
                              config=SimpleNamespace(trust_request_chat_template=True))
    request = ChatCompletionRequest(messages=CHAT, chat_template=template)
    assert tokenizer.decode(_chat_prompt(trusted, request)) == tokenizer.decode(
        tokenizer.encode("".join(f"<<{m['role']}|{m['content']}>>" for m in CHAT),
                         add_special_tokens=False))
    for template in ("{% for %}", "{{ messages[0].content + 1 }}", "{{ 1 / 0 }}",
                     "{{ messages[0]['no such key'].x }}{{ messages[9] }}{{ {}['k'] }}",
                     "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}"):
        broken = ChatCompletionRequest(messages=CHAT, chat_template=template)
        with pytest.raises(RequestError) as error:
            _chat_prompt(trusted, broken)
        assert error.value.param == "messages" and "chat template" in error.value.message


def test_tokenize_renders_a_chat_as_the_chat_request_is_served(cluster):
    """``/tokenize`` with messages takes the chat request's template inputs (tools, an
    assistant's tool calls, ``chat_template_kwargs``, documents) and gives the ids that
    chat is served with; ``return_token_strs``; chat-only fields on a prompt are refused."""
    tool = {"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    messages = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"}]
    template_dicts = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"}]
    ids = apply_chat_template(cluster.router.tokenizer, template_dicts, tools=[tool])
    assert len(ids) > len(apply_chat_template(cluster.router.tokenizer, CHAT))
    body = {"model": str(cluster.model), "messages": messages, "tools": [tool],
            "chat_template_kwargs": {"unused_by_this_template": 1}}
    reply = httpx.post(cluster.url + "/tokenize", json=body | {"return_token_strs": True})
    assert reply.status_code == 200, reply.text
    assert reply.json()["tokens"] == ids and reply.json()["count"] == len(ids)
    assert reply.json()["token_strs"] == cluster.router.tokenizer.convert_ids_to_tokens(ids)
    served = httpx.post(cluster.url + "/v1/chat/completions",
                        json=body | {"max_tokens": 1, "tool_choice": "none",
                                     "add_special_tokens": False})
    assert served.status_code == 200, served.text
    served = served.json()
    assert served["usage"]["prompt_tokens"] == len(ids)
    plain = httpx.post(cluster.url + "/tokenize", json={"prompt": PROMPT}).json()
    assert plain["token_strs"] is None
    for extra, param in [({"prompt": PROMPT, "tools": [tool]}, "tools"),
                         ({"prompt": PROMPT, "documents": []}, "documents"),
                         ({"messages": CHAT, "add_special_tokens": True}, "add_special_tokens"),
                         ({"messages": CHAT, "chat_template": "{{ 1 }}"}, "chat_template"),
                         ({"messages": CHAT, "chat_template_kwargs": {"tools": []}},
                          "chat_template_kwargs")]:
        bad = httpx.post(cluster.url + "/tokenize", json={"model": str(cluster.model)} | extra)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text


def test_return_token_ids_gives_the_prompt_and_the_generated_ids(cluster):
    """vLLM's ``return_token_ids``: the oracle's greedy tokens and the prompt's ids, in full
    and streamed (the prompt's in the first chunk), through both APIs."""
    from pdserve.engine import SamplingParams

    params = {"temperature": 0, "max_tokens": 5, "ignore_eos": True}
    prompt_ids = encode_prompt(cluster.router.tokenizer, PROMPT)
    want = cluster.oracle.generate([prompt_ids], SamplingParams(
        temperature=0.0, max_tokens=5, ignore_eos=True))[0].outputs[0].token_ids
    body = {"model": str(cluster.model), "prompt": PROMPT, "return_token_ids": True} | params
    choice = httpx.post(cluster.url + "/v1/completions", json=body).json()["choices"][0]
    assert choice["token_ids"] == want and choice["prompt_token_ids"] == prompt_ids
    events = [json.loads(line[6:]) for line in httpx.post(
        cluster.url + "/v1/completions", json=body | {"stream": True}).text.splitlines()
        if line.startswith("data: {")]
    assert events[0]["choices"][0]["prompt_token_ids"] == prompt_ids
    assert all("prompt_token_ids" not in e["choices"][0] for e in events[1:])
    assert [t for e in events for t in e["choices"][0]["token_ids"]] == want
    chat_ids = apply_chat_template(cluster.router.tokenizer, CHAT)
    want = cluster.oracle.generate([chat_ids], SamplingParams(
        temperature=0.0, max_tokens=5, ignore_eos=True))[0].outputs[0].token_ids
    body = {"model": str(cluster.model), "messages": CHAT, "return_token_ids": True} | params
    reply = httpx.post(cluster.url + "/v1/chat/completions", json=body).json()
    assert reply["prompt_token_ids"] == chat_ids and reply["choices"][0]["token_ids"] == want
    events = [json.loads(line[6:]) for line in httpx.post(
        cluster.url + "/v1/chat/completions", json=body | {"stream": True}).text.splitlines()
        if line.startswith("data: {")]
    assert events[0]["prompt_token_ids"] == chat_ids
    assert [t for e in events[1:] for t in e["choices"][0]["token_ids"]] == want
    plain = httpx.post(cluster.url + "/v1/completions", json={
        "model": str(cluster.model), "prompt": PROMPT} | params).json()
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain["choices"][0]


def test_a_clients_request_id_names_the_answer_and_never_collides(cluster):
    """vLLM's ``request_id`` and ``X-Request-Id`` header (which wins) name the answer,
    streamed too; two requests in flight with one id each get their own tokens (the
    workers' ids stay the router's own)."""
    params = {"model": str(cluster.model), "temperature": 0, "max_tokens": 4,
              "ignore_eos": True}
    reply = httpx.post(cluster.url + "/v1/completions",
                       json=params | {"prompt": PROMPT, "request_id": "job-7"}).json()
    assert reply["id"] == "cmpl-job-7"
    chat = httpx.post(cluster.url + "/v1/chat/completions", headers={"X-Request-Id": "hdr"},
                      json=params | {"messages": CHAT, "request_id": "body"}).json()
    assert chat["id"] == "chatcmpl-hdr"

    async def both() -> list[str]:
        async with httpx.AsyncClient(base_url=cluster.url, timeout=60,
                                     headers={"X-Request-Id": "same"}) as http:
            replies = await asyncio.gather(*(http.post("/v1/completions", json=params | {
                "prompt": prompt, "stream": True}) for prompt in (PROMPT, "Hi there")))
        events = [[json.loads(line[6:]) for line in r.text.splitlines()
                   if line.startswith("data: {")] for r in replies]
        assert {e["id"] for stream in events for e in stream} == {"cmpl-same"}
        return ["".join(e["choices"][0]["text"] for e in stream) for stream in events]

    texts = asyncio.run(both())
    for prompt, text in zip((PROMPT, "Hi there"), texts):
        assert text == cluster.expected(prompt, temperature=0.0, max_tokens=4, ignore_eos=True)
    for headers, extra, param in [({"X-Request-Id": "a b"}, {}, "X-Request-Id"),
                                  ({}, {"request_id": ""}, "request_id"),
                                  ({}, {"request_id": "x" * 257}, "request_id")]:
        bad = httpx.post(cluster.url + "/v1/completions", headers=headers,
                         json=params | {"prompt": PROMPT} | extra)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
