"""The router end to end: the official ``openai`` client against a real uvicorn port, a
real Redis, and one prefill and one decode worker in this process on the demo model.
The oracle is ``pdserve.engine.LLM`` on the same checkpoint."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from router_cases import CHAT, LOCAL_THRESHOLD, MAX_MODEL_LEN, PROMPT, router_cluster

from pdserve.cluster.prefix_index import PrefixIndex
from pdserve.cluster.registry import WorkerRecord, WorkerRegistry
from pdserve.engine.tokenizer import apply_chat_template, encode_prompt
from pdserve.entrypoints.redis_server import free_port
from pdserve.router.config import RouterConfig
from pdserve.router.http import build_app
from pdserve.router.model_service import ModelService
from pdserve.router.routing_policy import WorkerLoad


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with router_cluster(tmp_path_factory.mktemp("router")) as c:
        yield c


def test_greedy_completion_matches_llm_with_usage_and_cache_hit(cluster):
    client = cluster.client()
    expected = cluster.expected(PROMPT, temperature=0.0, max_tokens=12, ignore_eos=True)
    num_prompt_tokens = len(encode_prompt(cluster.router.tokenizer, PROMPT))
    assert num_prompt_tokens >= 16  # one full block: disaggregated, and cacheable
    replies = [client.completions.create(model=str(cluster.model), prompt=PROMPT, max_tokens=12,
                                         temperature=0, extra_body={"ignore_eos": True})
               for _ in range(2)]
    for reply in replies:
        assert reply.choices[0].text == expected
        assert reply.choices[0].finish_reason == "length"
        assert reply.usage.prompt_tokens == num_prompt_tokens
        assert reply.usage.completion_tokens == 12
        assert reply.usage.total_tokens == num_prompt_tokens + 12
    assert replies[0].usage.prompt_tokens_details.cached_tokens == 0
    assert replies[1].usage.prompt_tokens_details.cached_tokens == 16
    metrics = httpx.get(cluster.url + "/metrics").text
    assert 'pdserve:routing_decisions_total{model_name' in metrics and 'role="prefill"' in metrics
    cluster.wait_all_blocks_free()


def test_short_prompt_is_prefilled_on_the_decode_worker(cluster):
    prompt = "Hi there"
    assert len(encode_prompt(cluster.router.tokenizer, prompt)) < LOCAL_THRESHOLD
    reply = cluster.client().completions.create(model=str(cluster.model), prompt=prompt,
                                                max_tokens=6, temperature=0,
                                                extra_body={"ignore_eos": True})
    assert reply.choices[0].text == cluster.expected(prompt, temperature=0.0, max_tokens=6,
                                                     ignore_eos=True)


def test_streaming_chat_matches_llm_async(cluster):
    expected = cluster.expected(CHAT, temperature=0.0, max_tokens=10, ignore_eos=True)
    prompt_len = len(apply_chat_template(cluster.router.tokenizer, CHAT))

    async def run():
        client = cluster.async_client()
        stream = await client.chat.completions.create(
            model=str(cluster.model), messages=CHAT, max_tokens=10, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        chunks = [chunk async for chunk in stream]
        full = await client.chat.completions.create(
            model=str(cluster.model), messages=CHAT, max_completion_tokens=10, temperature=0,
            extra_body={"ignore_eos": True})
        await client.close()
        return chunks, full

    chunks, full = asyncio.run(run())
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == prompt_len == full.usage.prompt_tokens
    assert full.choices[0].finish_reason == "length"


def test_streaming_completion_matches_sync(cluster):
    stream = cluster.client().completions.create(
        model=str(cluster.model), prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
        extra_body={"ignore_eos": True})
    text = "".join(chunk.choices[0].text for chunk in stream)
    assert text == cluster.expected(PROMPT, temperature=0.0, max_tokens=8, ignore_eos=True)


def test_seeded_sampling_repeats_and_n_uses_seed_plus_i(cluster):
    client = cluster.client()

    def sample(n: int, seed: int):
        reply = client.completions.create(model=str(cluster.model), prompt=PROMPT, max_tokens=8,
                                          temperature=1.0, seed=seed, n=n,
                                          extra_body={"ignore_eos": True})
        return [c.text for c in sorted(reply.choices, key=lambda c: c.index)]

    pair = sample(2, 1234)
    assert pair == sample(2, 1234)
    assert pair[1] == sample(1, 1235)[0]
    assert pair[0] == cluster.expected(PROMPT, temperature=1.0, max_tokens=8, seed=1234,
                                       ignore_eos=True)


def test_stop_string_cuts_text_and_frees_the_request(cluster):
    expected = cluster.expected(PROMPT, temperature=0.0, max_tokens=40, ignore_eos=True)
    stop = expected[12:15]
    assert stop.strip() and expected.find(stop) >= 1
    reply = cluster.client().completions.create(
        model=str(cluster.model), prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop],
        extra_body={"ignore_eos": True})
    assert reply.choices[0].text == expected[:expected.find(stop)]
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens < 40
    cluster.wait_all_blocks_free()


def test_client_disconnect_mid_stream_frees_every_block(cluster):
    with httpx.stream("POST", cluster.url + "/v1/completions", timeout=30, json={
            "prompt": PROMPT * 3, "max_tokens": 150, "temperature": 0, "stream": True,
            "ignore_eos": True}) as response:
        assert response.status_code == 200
        events = 0
        for line in response.iter_lines():
            events += line.startswith("data:")
            if events >= 3:
                break
        busy = [w.runtime.health() for w in (cluster.prefill, cluster.decode)]
    assert busy[1].num_free_blocks < busy[1].num_total_blocks  # it was mid-decode
    cluster.wait_all_blocks_free()
    assert cluster.decode.runtime.health().num_running == 0
    metrics = httpx.get(cluster.url + "/metrics").text
    assert 'vllm:request_success_total{finished_reason="abort"' in metrics


BAD_INPUTS = [  # (path, body, status, words the message must hold)
    ("/v1/completions", b"{not json", 400, "JSON"),
    ("/v1/completions", b"[1, 2]", 400, "JSON object"),
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10000}, 400, "maximum context length"),
    ("/v1/completions", {"prompt": "x", "temperature": 5}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": 5}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "seed": -1}, 400, "seed"),
    ("/v1/completions", {"prompt": [], "max_tokens": 1}, 400, "prompt"),
    ("/v1/completions", {"prompt": [5, 99999]}, 400, "vocabulary"),
    ("/v1/completions", {"prompt": "word " * 300}, 400, "maximum context length"),
    ("/v1/completions", {"prompt": "x", "model": "nope"}, 404, "nope"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 9, "max_tokens": 2}, 400, "min_tokens"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "presence_penalty": 9}, 400, "presence_penalty"),
    # accepted-and-ignored is a defect: a field pdserve does not implement is refused
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"five": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"99999": 1}}, 400, "vocabulary"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, 400, "best_of"),
    ("/v1/completions", {"prompt": "x", "priority": 1}, 400, "priority"),
    ("/v1/completions", {"prompt": "x", "frobnicate": True}, 400, "frobnicate"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "add_special_tokens": True}, 400, "add_special_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": "auto"}, 400, "--enable-auto-tool-choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema", "json_schema": {
                                  "name": "x", "schema": {"type": "foo"}}}}, 400,
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}]}, 400,
     "tool_calls"),
    ("/v1/nowhere", {}, 404, "no such route"),
]


def test_bad_inputs_get_openai_errors_and_serving_goes_on(cluster):
    with httpx.Client(base_url=cluster.url, timeout=30) as http:
        for path, body, status, words in BAD_INPUTS:
            kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
            reply = http.post(path, headers={"content-type": "application/json"}, **kwargs)
            assert reply.status_code == status, (path, body, reply.text)
            error = reply.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, reply.text
            assert words.lower() in error["message"].lower() + str(error["param"]).lower(), \
                (body, error)
        assert http.get("/v1/completions").status_code == 405
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        cluster.client().completions.create(model=str(cluster.model), prompt="x",
                                            max_tokens=-3)
    reply = cluster.client().completions.create(model=str(cluster.model), prompt=PROMPT,
                                                max_tokens=3, extra_body={"priority": 0})
    assert reply.usage.completion_tokens <= 3


def test_vllm_utility_endpoints(cluster):
    """``/tokenize`` gives the ids a completion is served with (and the chat template's
    for messages), ``/detokenize`` turns them back, ``/v1/models/{id}`` and ``/version``."""
    from pdserve import __version__
    from pdserve.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(cluster.model)
    with httpx.Client(base_url=cluster.url, timeout=30) as http:
        assert http.get("/version").json() == {"version": __version__}
        card = http.get(f"/v1/models/{cluster.model}").json()
        assert card["id"] == str(cluster.model) and card["object"] == "model"
        missing = http.get("/v1/models/nope")
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"

        ids = encode_prompt(tokenizer, PROMPT)
        reply = http.post("/tokenize", json={"prompt": PROMPT}).json()
        assert reply == {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids,
                         "token_strs": None}
        bare = http.post("/tokenize", json={"prompt": PROMPT, "add_special_tokens": False})
        assert bare.json()["tokens"] == tokenizer.encode(PROMPT, add_special_tokens=False)
        chat = http.post("/tokenize", json={"messages": CHAT}).json()
        assert chat["tokens"] == apply_chat_template(tokenizer, CHAT,
                                                     add_generation_prompt=True)
        back = http.post("/detokenize", json={"tokens": bare.json()["tokens"]}).json()
        assert back == {"prompt": PROMPT}
        completion = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert completion.json()["usage"]["prompt_tokens"] == len(ids)

        for path, body, param in [
                ("/tokenize", {}, "prompt"),
                ("/tokenize", {"prompt": "x", "messages": CHAT}, "prompt"),
                ("/tokenize", {"prompt": "x", "model": "nope"}, "model"),
                ("/tokenize", {"prompt": "x", "truncate": 3}, "truncate"),
                ("/detokenize", {"tokens": [1, 10**6]}, "tokens[1]"),
                ("/detokenize", {"tokens": "12"}, "tokens")]:
            bad = http.post(path, json=body)
            assert bad.status_code in (400, 404), (path, body, bad.text)
            assert bad.json()["error"]["param"] == param, (path, body, bad.text)


def test_logit_bias_reaches_the_sampler_of_both_pools(cluster):
    """Through the prefill worker (first token) and the decode worker (the rest), and
    through the prefill-on-decode path of a short prompt."""
    from pdserve.engine.tokenizer import load_tokenizer

    token = load_tokenizer(cluster.model).decode([42])
    for prompt in (PROMPT, "Hi"):
        reply = cluster.client().completions.create(
            model=str(cluster.model), prompt=prompt, max_tokens=5, temperature=0, logprobs=0,
            extra_body={"ignore_eos": True, "logit_bias": {"42": 100}})
        assert reply.usage.completion_tokens == 5
        assert reply.choices[0].logprobs.tokens == [token] * 5, reply.choices[0].text


def test_models_and_health(cluster):
    models = cluster.client().models.list()
    assert [m.id for m in models.data] == [str(cluster.model)]
    assert httpx.get(cluster.url + "/health").status_code == 200


def test_no_workers_is_503_with_retry_after(cluster):
    from fastapi.testclient import TestClient

    empty_db = cluster.redis_url.rsplit("/", 1)[0] + "/5"
    router = ModelService(RouterConfig(str(cluster.model), empty_db, max_model_len=MAX_MODEL_LEN))
    with TestClient(build_app(router)) as http:
        reply = http.post("/v1/completions", json={"prompt": PROMPT})
        assert reply.status_code == 503 and reply.headers["retry-after"] == "1"
        assert "no live" in reply.json()["error"]["message"]
        health = http.get("/health")  # liveness: the router itself is fine
        assert health.status_code == 200 and health.json()["status"] == "unavailable"
        assert http.get("/ready").status_code == 503


def test_logprobs_in_both_formats(cluster):
    client = cluster.client()
    reply = client.completions.create(model=str(cluster.model), prompt=PROMPT, max_tokens=4,
                                      temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    logprobs = reply.choices[0].logprobs
    assert "".join(logprobs.tokens) == reply.choices[0].text
    assert len(logprobs.token_logprobs) == 4 and all(lp <= 0 for lp in logprobs.token_logprobs)
    assert all(2 <= len(top) <= 3 for top in logprobs.top_logprobs)
    chat = client.chat.completions.create(model=str(cluster.model), messages=CHAT, max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(entry.top_logprobs) == 2 for entry in content)
    assert "".join(entry.token for entry in content) == chat.choices[0].message.content


def test_unavailable_worker_is_retried_and_an_index_outage_routes_by_load(cluster):
    """A registered prefill worker that does not answer gets the request (it looks idle);
    the router retries on the real one. The prefix index's Redis is gone meanwhile."""
    from fastapi.testclient import TestClient

    ghost = WorkerRegistry(cluster.redis_url)
    ghost.register(WorkerRecord.new("prefill-ghost", "prefill", f"127.0.0.1:{free_port()}",
                                    "127.0.0.1:1", str(cluster.model)))
    router = ModelService(RouterConfig(str(cluster.model), cluster.redis_url,
                                 max_model_len=MAX_MODEL_LEN, registry_interval_s=60,
                                 health_interval_s=60, disaggregation="always"))
    try:
        with TestClient(build_app(router)) as http:
            prefills = router.pool.workers["prefill"]
            assert set(prefills) == {"prefill-ghost", cluster.prefill.worker_id}
            prefills["prefill-ghost"].healthy = True
            prefills[cluster.prefill.worker_id].load = WorkerLoad(cluster.prefill.worker_id,
                                                                  num_waiting=1000)
            router.index.close()
            router.index = PrefixIndex(f"redis://127.0.0.1:{free_port()}/0")
            reply = http.post("/v1/completions", json={
                "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True})
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["text"] == cluster.expected(
                PROMPT, temperature=0.0, max_tokens=5, ignore_eos=True)
            metrics = http.get("/metrics").text
    finally:
        ghost.deregister()
        ghost.close()
    name = f'model_name="{cluster.model}"'
    assert f"pdserve:request_retries_total{{{name}}} 1.0" in metrics
    assert f"pdserve:prefix_index_available{{{name}}} 0.0" in metrics
    cluster.wait_all_blocks_free()


def test_streaming_n2_with_stop_and_prompt_lists(cluster):
    expected = cluster.expected(CHAT, temperature=0.0, max_tokens=30, ignore_eos=True)
    stop = expected[8:11]
    assert stop.strip() and expected.find(stop) >= 1
    stream = cluster.client().chat.completions.create(
        model=str(cluster.model), messages=CHAT, max_tokens=30, temperature=0, n=2, stop=stop,
        stream=True, extra_body={"ignore_eos": True})
    texts, finishes = ["", ""], [None, None]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert texts == [expected[:expected.find(stop)]] * 2 and finishes == ["stop", "stop"]
    prompts = [PROMPT, "Hi there"]
    reply = cluster.client().completions.create(model=str(cluster.model), prompt=prompts,
                                                max_tokens=4, temperature=0, echo=True,
                                                extra_body={"ignore_eos": True})
    for choice, prompt in zip(sorted(reply.choices, key=lambda c: c.index), prompts):
        assert choice.text == prompt + cluster.expected(prompt, temperature=0.0, max_tokens=4,
                                                        ignore_eos=True)
    assert reply.usage.completion_tokens == 8
    token_ids = list(range(5, 25))
    reply = cluster.client().completions.create(model=str(cluster.model), prompt=token_ids,
                                                max_tokens=4, temperature=0,
                                                extra_body={"ignore_eos": True})
    assert reply.choices[0].text == cluster.expected(token_ids, temperature=0.0, max_tokens=4,
                                                     ignore_eos=True)
    assert reply.usage.prompt_tokens == 20
    cluster.wait_all_blocks_free()



def test_allowed_token_ids_reach_the_sampler_of_both_pools(cluster):
    """The prefill worker's first token and the decode worker's rest (and a short
    prompt's, prefilled on the decode worker) are all among ``allowed_token_ids``."""
    allowed = [42, 77, 101]
    for prompt in (PROMPT, "Hi"):
        reply = cluster.client().completions.create(
            model=str(cluster.model), prompt=prompt, max_tokens=6, temperature=1.0, seed=5,
            logprobs=0, extra_body={"ignore_eos": True, "allowed_token_ids": allowed,
                                    "return_tokens_as_token_ids": True})
        tokens = [int(t.removeprefix("token_id:")) for t in reply.choices[0].logprobs.tokens]
        assert len(tokens) == 6 and set(tokens) <= set(allowed), tokens
    for bad in ([], [99999], "42"):
        refused = httpx.post(cluster.url + "/v1/completions", json={
            "model": str(cluster.model), "prompt": "x", "allowed_token_ids": bad})
        assert refused.status_code == 400 and \
            refused.json()["error"]["param"].startswith("allowed_token_ids"), refused.text


def test_bad_words_keep_their_tokenizations_out_of_the_reply(cluster):
    from pdserve.engine.tokenizer import bad_word_sequences

    def ids(reply):
        return [int(t.removeprefix("token_id:")) for t in reply.choices[0].logprobs.tokens]

    body = {"model": str(cluster.model), "prompt": PROMPT, "max_tokens": 12, "temperature": 0,
            "logprobs": 0, "extra_body": {"ignore_eos": True,
                                          "return_tokens_as_token_ids": True}}
    plain = cluster.client().completions.create(**body)
    word = cluster.router.tokenizer.decode(ids(plain)[1:3]).strip()
    banned = bad_word_sequences(cluster.router.tokenizer, [word])
    body["extra_body"]["bad_words"] = [word]
    reply = cluster.client().completions.create(**body)
    tokens = ids(reply)
    assert tokens != ids(plain) and len(tokens) == 12
    assert not any(tokens[i:i + len(s)] == s for s in banned for i in range(len(tokens)))
    for bad in (["w"] * 129, ["word " * 80], "word"):
        refused = httpx.post(cluster.url + "/v1/completions", json={
            "model": str(cluster.model), "prompt": "x", "bad_words": bad})
        assert refused.status_code == 400 and \
            refused.json()["error"]["param"].startswith("bad_words"), refused.text
