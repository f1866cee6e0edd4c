"""``pdserve serve`` as a subprocess (Ray workers, router, our own Redis), driven by the
official ``openai`` client over HTTP and by a gRPC client of ``pdserve.v1.Router``."""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from serve_process import serve_process

from pdserve.cluster.wire import sampling_params_to_proto
from pdserve.engine import LLM, SamplingParams
from pdserve.entrypoints.redis_server import RedisServer, free_port
from pdserve.proto import router_pb2, router_pb2_grpc

openai = pytest.importorskip("openai")


@dataclass
class Served:
    """A running ``pdserve serve``, and what it answered the moment it said "serving"."""

    model: Path
    port: int
    grpc_port: int
    redis: RedisServer
    log: str  # its output up to "pdserve serving"
    first_http_status: int  # GET /v1/models, sent right after "pdserve serving"
    first_grpc_models: list[str]  # ListModels, likewise


def ask_at_once(port: int, grpc_port: int) -> tuple[int, list[str]]:
    """One HTTP GET /v1/models and one gRPC ListModels, each tried once."""
    import httpx

    status = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).status_code

    async def list_models():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            reply = await router_pb2_grpc.RouterStub(channel).ListModels(
                router_pb2.ListModelsRequest(), timeout=10, wait_for_ready=False)
            return list(reply.models)

    return status, asyncio.run(list_models())


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A running ``pdserve serve`` with 2 prefill workers and 1 decode worker, which
    speculates (ngram)."""
    grpc_port = free_port()
    with serve_process(tmp_path_factory, [
            "--grpc-port", str(grpc_port), "--prefill-workers", "2", "--decode-workers", "1",
            "--kv-lease-s", "10",
            # NOTE: every worker shares this machine's CPUs, where "auto" keeps prompts on
            # the decode worker; these tests are about the prefill pool
            "--disaggregation", "always",
            # issue 28: the decode worker speculates; greedy replies stay offline's and
            # seeded ones repeat
            "--speculative-config", ('{"method": "ngram", "num_speculative_tokens": 3, '
            '"prompt_lookup_max": 3, "prompt_lookup_min": 1}')]) as serve:
        first_http_status, first_grpc_models = ask_at_once(serve.port, grpc_port)
        yield Served(serve.model, serve.port, grpc_port, serve.redis, serve.log.read_text(),
                     first_http_status, first_grpc_models)


def test_serving_line_comes_after_each_phase_and_means_accepting(served):
    phases = ["pdserve: Redis at", "pdserve: Ray started locally",
              "pdserve: starting 2 prefill and 1 decode workers",
              "pdserve: prefill worker 1/2 ready", "pdserve: prefill worker 2/2 ready",
              "pdserve: decode worker 1/1 ready", "pdserve serving demo on"]
    assert all(phase in served.log for phase in phases)
    assert served.log.index(phases[0]) < served.log.index(phases[3])
    assert served.log.index(phases[-2]) < served.log.index(phases[-1])
    assert served.first_http_status == 200
    assert served.first_grpc_models == ["demo"]


@pytest.fixture(scope="module")
def offline(served):
    return LLM(str(served.model), dtype="float32", max_model_len=512, load_progress=False)


def client(port: int):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=60)


PROMPTS = ["The prefill worker computes", "Paged attention reads keys through a block table",
           "A router sends each prompt to"]


def test_completions_sync_and_stream_equal_offline_greedy(served, offline):
    port = served.port
    api = client(port)
    expected = [o.outputs[0].text for o in offline.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))]
    for prompt, text in zip(PROMPTS, expected):
        reply = api.completions.create(model="demo", prompt=prompt, max_tokens=12,
                                       temperature=0, extra_body={"ignore_eos": True})
        assert reply.choices[0].text == text
        assert reply.choices[0].finish_reason == "length"
        assert reply.usage.completion_tokens == 12
        chunks = api.completions.create(model="demo", prompt=prompt, max_tokens=12,
                                        temperature=0, stream=True,
                                        extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in chunks if c.choices) == text


def test_chat_async_stream_and_seeded_sampling(served, offline):
    port = served.port
    messages = [{"role": "user", "content": "What does a decode worker do?"}]
    expected = offline.chat(messages, SamplingParams(temperature=0, max_tokens=10,
                                                     ignore_eos=True))[0].outputs[0].text

    async def main():
        api = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                                 timeout=60)
        whole = await api.chat.completions.create(model="demo", messages=messages,
                                                  max_tokens=10, temperature=0,
                                                  extra_body={"ignore_eos": True})
        stream = await api.chat.completions.create(model="demo", messages=messages,
                                                   max_tokens=10, temperature=0, stream=True,
                                                   extra_body={"ignore_eos": True})
        streamed = "".join([c.choices[0].delta.content or "" async for c in stream
                            if c.choices])
        seeded = [await api.chat.completions.create(
            model="demo", messages=messages, max_tokens=10, temperature=1.0, seed=7,
            extra_body={"ignore_eos": True}) for _ in range(2)]
        return whole.choices[0].message.content, streamed, [
            s.choices[0].message.content for s in seeded]

    whole, streamed, seeded = asyncio.run(main())
    assert whole == expected and streamed == expected
    assert seeded[0] == seeded[1]


def test_grpc_generate_equals_http(served, offline):
    grpc_port = served.grpc_port
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = offline.generate([PROMPTS[1]], params)[0].outputs[0]

    async def main():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            text, tokens, last = "", [], None
            async for message in stub.Generate(router_pb2.GenerateRequest(
                    model="demo", text=PROMPTS[1],
                    sampling_params=sampling_params_to_proto(params)), timeout=60):
                text += message.text
                tokens += list(message.token_ids)
                last = message
            models = await stub.ListModels(router_pb2.ListModelsRequest(), timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.Generate(router_pb2.GenerateRequest(
                        model="demo", token_ids=router_pb2.TokenIds(ids=[1] * 600)),
                        timeout=10):
                    pass
            return text, tokens, last, models, err.value

    text, tokens, last, models, error = asyncio.run(main())
    assert tokens == expected.token_ids and text == expected.text
    assert last.finish_reason == "length" and last.usage.completion_tokens == 12
    assert list(models.models) == ["demo"]
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "512" in error.details()


def routing_counts(port: int) -> dict[str, float]:
    """pdserve:routing_decisions per prefill worker, from the router's /metrics."""
    import httpx

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    counts = {}
    for line in text.splitlines():
        if line.startswith("pdserve:routing_decisions_total{") and 'role="prefill"' in line:
            worker = re.search(r'worker="([^"]+)"', line).group(1)
            counts[worker] = float(line.rsplit(" ", 1)[1])
    return counts


def test_prefix_routing_picks_the_worker_holding_the_prefix(served):
    port = served.port
    api = client(port)
    shared = " ".join(["the paged KV cache keeps every block of every prompt"] * 12)
    before = routing_counts(port)
    api.completions.create(model="demo", prompt=shared + " first", max_tokens=2)
    time.sleep(1.0)  # the worker's KV events reach Redis
    middle = routing_counts(port)
    second = api.completions.create(model="demo", prompt=shared + " second", max_tokens=2)
    after = routing_counts(port)
    first_worker = next(w for w in middle if middle[w] > before.get(w, 0))
    second_worker = next(w for w in after if after[w] > middle.get(w, 0))
    assert second_worker == first_worker
    assert second.usage.prompt_tokens_details.cached_tokens > 0


def test_bad_input_gets_4xx_and_the_server_keeps_serving(served):
    port = served.port
    api = client(port)
    with pytest.raises(openai.BadRequestError, match="512"):
        api.completions.create(model="demo", prompt="hi " * 600, max_tokens=10)
    with pytest.raises(openai.NotFoundError):
        api.completions.create(model="nope", prompt="hi", max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="n"):
        api.completions.create(model="demo", prompt="hi", max_tokens=4, n=0)
    reply = api.completions.create(model="demo", prompt="still here", max_tokens=3)
    assert reply.usage.completion_tokens >= 1


def test_redis_outage_keeps_serving_and_prefix_routing_resumes(served):
    port, redis = served.port, served.redis
    api = client(port)
    redis.stop()
    try:
        during = api.completions.create(model="demo", prompt="Redis is down", max_tokens=4,
                                        extra_body={"ignore_eos": True})
        assert during.usage.completion_tokens == 4
    finally:
        redis.restart()
    time.sleep(4.0)  # heartbeats re-register, publishers republish their caches
    shared = " ".join(["after the restart the index is rebuilt from the workers"] * 12)
    api.completions.create(model="demo", prompt=shared + " one", max_tokens=2)
    time.sleep(1.0)
    again = api.completions.create(model="demo", prompt=shared + " two", max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_the_decode_worker_counts_its_speculation_on_metrics(served):
    """Through the router's service discovery: the speculating decode worker's vLLM
    acceptance counters, after the replies above (equal to offline greedy) were made."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    targets = httpx.get(f"http://127.0.0.1:{served.port}/metrics/targets", timeout=10).json()
    decode = [g for g in targets if g["labels"]["__meta_pdserve_role"] == "decode"]
    text = httpx.get(f"http://{decode[0]['targets'][0]}/metrics", timeout=10).text
    values = {s.name: s.value for f in text_string_to_metric_families(text)
              for s in f.samples if s.name.startswith("vllm:spec_decode_")}
    assert values["vllm:spec_decode_num_drafts_total"] > 0
    assert 0 <= values["vllm:spec_decode_num_accepted_tokens_total"] <= \
        values["vllm:spec_decode_num_draft_tokens_total"]
