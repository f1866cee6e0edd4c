"""Issue 12: no request body may cause a 5xx. A seeded fuzzer sends over 1,000 bodies to a
real router (uvicorn on a loopback port, real Redis, one prefill and one decode worker as
Ray actors, the tiny Llama checkpoint with a byte-level BPE tokenizer) and checks every
answer: below 500, every 4xx an OpenAI error object, streams free of internal errors, and
the router still serving afterwards. The router's gRPC API gets the same bounds."""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
from conftest import stop_cluster
from inproc_cluster import uvicorn_server

from pdserve.cluster.worker_config import WorkerConfig
from pdserve.engine import EngineConfig
from pdserve.engine.demo_model import BOS_TOKEN, CHAT_TEMPLATE, EOS_TOKEN, train_demo_tokenizer
from pdserve.entrypoints.launcher import RayLauncher
from pdserve.entrypoints.redis_server import RedisServer, free_port
from pdserve.proto import common_pb2, router_pb2, router_pb2_grpc
from pdserve.router.config import RouterConfig
from pdserve.router.grpc_server import start_grpc_server
from pdserve.router.http import build_app
from pdserve.router.http_guard import MAX_BODY_BYTES
from pdserve.router.model_service import ModelService
from pdserve.router.protocol import INTERNAL_ERROR

MAX_MODEL_LEN = 128
NUM_CASES = 1200
CONCURRENCY = 4
WORDS = ["the", "sea", "ships", "sail", "far", "and", "quick", "brown", "fox", "jumps", "over",
         "a", "lazy", "dog"]
FIELDS = ["model", "n", "temperature", "top_p", "stream", "stream_options", "stop", "seed",
          "presence_penalty", "frequency_penalty", "user", "top_k", "min_p",
          "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
          "skip_special_tokens", "include_stop_str_in_output", "cache_salt", "max_tokens"]
COMPLETION_FIELDS = FIELDS + ["prompt", "logprobs", "echo"]
CHAT_FIELDS = FIELDS + ["messages", "max_completion_tokens", "logprobs", "top_logprobs",
                        "add_generation_prompt", "chat_template_kwargs"]
# The four causes of issue 12's 500s, and a valid request to follow them.
HISTORICAL = [
    {"prompt": "hi", "max_tokens": 2, "top_k": 2**31},
    {"prompt": "hi", "max_tokens": 2, "stop_token_ids": [2**31]},
    {"prompt": "hi\ud800", "max_tokens": 2},
    {"prompt": "hi", "max_tokens": 2, "cache_salt": "\udfff"},
]
DEEP = b'{"prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}"


@dataclass
class Served:
    url: str
    grpc_address: str
    router: ModelService
    vocab_size: int


def write_tokenizer(model: Path, vocab_size: int) -> None:
    """The demo model's byte-level BPE, trained down to the tiny checkpoint's vocabulary."""
    tokenizer = train_demo_tokenizer(vocab_size)
    tokenizer.save(str(model / "tokenizer.json"))
    special = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN}
    (model / "special_tokens_map.json").write_text(json.dumps(special))
    (model / "tokenizer_config.json").write_text(json.dumps({
        **special, "add_bos_token": True, "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False, "tokenizer_class": "PreTrainedTokenizerFast"}))


@pytest.fixture(scope="module")
def served(tiny_checkpoints, tmp_path_factory):
    model = tmp_path_factory.mktemp("fuzz") / "llama"
    shutil.copytree(tiny_checkpoints["llama"], model)
    vocab_size = json.loads((model / "config.json").read_text())["vocab_size"]
    write_tokenizer(model, vocab_size)
    engine = EngineConfig(str(model), dtype="float32", max_model_len=MAX_MODEL_LEN,
                          load_progress=False, num_gpu_blocks_override=1024)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def call(coro, timeout_s: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout_s)

    redis = RedisServer()
    launcher = None
    try:
        launcher = RayLauncher(num_cpus=2)
        for role in ("prefill", "decode"):
            launcher.launch(WorkerConfig(role, engine, redis_url=redis.url,
                                         kv_transfer_timeout_s=10.0), 1, workers_on_node=2)
        router = ModelService(RouterConfig(str(model), redis.url, max_model_len=MAX_MODEL_LEN,
                                     disaggregation="always"))
        grpc_server, grpc_port = call(start_grpc_server(router, "127.0.0.1", 0))
        server = uvicorn_server(build_app(router), free_port(), log_level="error")
        serving = asyncio.run_coroutine_threadsafe(server.serve(), loop)
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and not serving.done(), "uvicorn did not start"
            time.sleep(0.02)
        port = server.servers[0].sockets[0].getsockname()[1]
        try:
            yield Served(f"http://127.0.0.1:{port}", f"127.0.0.1:{grpc_port}", router,
                         vocab_size)
        finally:
            server.should_exit = True
            serving.result(30)
            call(grpc_server.stop(0))
    finally:
        stop_cluster(launcher, redis, loop, thread)


# ---- the fuzzer ------------------------------------------------------------------------


class Fuzzer:
    """Deterministic request bodies: ``(path, body bytes, note)``. About a quarter are
    valid requests (short generations), the rest invalid in every way issue 12 lists."""

    def __init__(self, seed: int, vocab_size: int) -> None:
        self.rng = random.Random(seed)
        self.vocab_size = vocab_size

    def cases(self, count: int) -> list[tuple[str, bytes, str]]:
        makers = [(self.valid, 25), (self.mutated, 45), (self.hostile_string, 10),
                  (self.structural, 12), (self.sequences, 8)]
        funcs = [m for m, _ in makers]
        weights = [w for _, w in makers]
        return [self.rng.choices(funcs, weights)[0]() for _ in range(count)]

    # -- valid bodies

    def text(self, max_words: int = 24) -> str:
        return " ".join(self.rng.choices(WORDS, k=self.rng.randint(1, max_words)))

    def valid_body(self, chat: bool) -> dict:
        r = self.rng
        body: dict = {"max_tokens": r.choice([1, 2, 4]), "temperature": r.choice([0, 0.7, 1.0])}
        if chat:
            body["messages"] = [{"role": r.choice(["system", "user"]), "content": self.text()},
                                {"role": "user", "content": self.text()}]
        else:
            body["prompt"] = r.choice([
                self.text(), self.text(40), [self.text(), self.text()],
                [r.randrange(self.vocab_size) for _ in range(r.randint(1, 30))]])
        options = [("n", [1, 2]), ("stream", [True, False]), ("seed", [0, 7, 2**63 - 1]),
                   ("top_k", [-1, 0, 5]), ("top_p", [0.5, 1.0]), ("stop", ["the", [" a"]]),
                   ("ignore_eos", [True]), ("cache_salt", ["s1", "ünï"]),
                   ("stop_token_ids", [[0, self.vocab_size - 1]])]
        for name, values in options:
            if r.random() < 0.3:
                body[name] = r.choice(values)
        if body.get("stream") and r.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        return body

    def valid(self) -> tuple[str, bytes, str]:
        chat = self.rng.random() < 0.5
        return self.post(chat, self.valid_body(chat), "valid")

    # -- invalid values

    def weird(self):
        r = self.rng
        return r.choice([
            None, True, False, 0, -1, 1, 2**31 - 1, 2**31, -2**31 - 1, 2**32, 2**63 - 1, 2**63,
            -2**63 - 1, 2**64, 10**30, 1e308, -1e308, 1.5, -0.0, 1e-300, "NaN", "Infinity", "1",
            "", "x" * r.choice([10, 5000, 100_000]), "\ud800", "a\udfffb", "ok", [], [1, 2],
            [2**31], [-1], ["\udc00"], [""], ["stop"] * 17, ["s" * 2000], list(range(300)), {},
            {"a": {"b": [1, {"c": None}]}}, [[[[[]]]]], [[1, 2], []], {"type": "text"},
        ])

    def mutated(self) -> tuple[str, bytes, str]:
        r = self.rng
        chat = r.random() < 0.5
        body = self.valid_body(chat)
        fields = CHAT_FIELDS if chat else COMPLETION_FIELDS
        for _ in range(r.choice([1, 1, 1, 2, 3])):
            name = r.choice(fields + ["unknown_field"])
            body[name] = self.weird()
        if chat and r.random() < 0.3:
            message = r.choice(body["messages"]) if isinstance(body["messages"], list) else {}
            if isinstance(message, dict):
                message[r.choice(["role", "content", "name"])] = self.weird()
        return self.post(chat, body, "mutated")

    def hostile_string(self) -> tuple[str, bytes, str]:
        r = self.rng
        chat = r.random() < 0.5
        body = self.valid_body(chat)
        bad = r.choice(["\ud800", "\udfff", "x\udbff", "\ud83d"])  # lone halves of a pair
        if chat:
            target = r.choice(["content", "name", "stop", "cache_salt", "user", "model", "parts"])
        else:
            target = r.choice(["prompt", "prompts", "stop", "cache_salt", "user", "model"])
        if target in ("content", "name"):
            body["messages"][-1][target] = "hello " + bad
        elif target == "parts":
            body["messages"][-1]["content"] = [{"type": "text", "text": bad}]
        elif target == "prompts":
            body["prompt"] = ["fine", "not " + bad]
        else:
            body[target] = [bad] if target == "stop" and r.random() < 0.5 else bad
        return self.post(chat, body, f"surrogate in {target}")

    def sequences(self) -> tuple[str, bytes, str]:
        """``n`` and prompt-list sizes at and past their limits (short prompts: the decode
        worker prefills them itself, so 256 sequences stay quick)."""
        r = self.rng
        chat = r.random() < 0.5
        body = self.valid_body(chat)
        body.update(n=r.choice([128, 129, 300, 1000, 2**31]), max_tokens=1)
        if chat:
            body["messages"] = [{"role": "user", "content": "hi"}]
        else:
            body["prompt"] = r.choice(["hi", ["hi"] * 2, ["hi"] * 3, ["hi"] * 300])
        return self.post(chat, body, "sequences")

    def structural(self) -> tuple[str, bytes, str]:
        r = self.rng
        path = r.choice(["/v1/completions", "/v1/chat/completions"])
        kind = r.choice(["deep", "truncated", "bytes", "empty", "toplevel", "number",
                         "constant", "duplicate"])
        if kind == "deep":
            depth = r.choice([65, 100, 999, 1000, 5000, 100_000])
            opener, closer = r.choice([(b"[", b"]"), (b'{"a":', b"}")])
            body = b'{"prompt": ' + opener * depth + b"1" + closer * depth + b"}"
            if r.random() < 0.5:
                body = b'{"prompt": "hi", "extra": ' + opener * depth + b"1" + closer * depth + b"}"
        elif kind == "truncated":
            whole = json.dumps(self.valid_body(path.endswith("chat/completions"))).encode()
            body = whole[:r.randrange(len(whole))]
        elif kind == "bytes":
            valid = json.dumps({"prompt": "hello"}).encode()
            body = r.choice([bytes(r.randrange(256) for _ in range(r.randint(1, 64))),
                             valid.replace(b"hello", b"he\xffllo"), b"\xfe\xff" + valid,
                             valid.replace(b"hello", b"\xed\xa0\x80")])  # CESU-8 surrogate
        elif kind == "empty":
            body = b""
        elif kind == "toplevel":
            body = json.dumps(r.choice([[], [1, 2], "prompt", 5, 1.5, None, True])).encode()
        elif kind == "number":
            body = b'{"prompt": "hi", "max_tokens": ' + b"9" * r.choice([4301, 10_000]) + b"}"
        elif kind == "constant":
            body = b'{"prompt": "hi", "temperature": ' + r.choice(
                [b"NaN", b"Infinity", b"-Infinity", b"1e999"]) + b"}"
        else:
            body = b'{"prompt": "hi", "prompt": 5, "max_tokens": 1}'
        return path, body, kind

    @staticmethod
    def post(chat: bool, body: dict, note: str) -> tuple[str, bytes, str]:
        path = "/v1/chat/completions" if chat else "/v1/completions"
        return path, json.dumps(body).encode(), note  # ensure_ascii: "\ud800" stays an escape


def check_reply(status: int, content: bytes, streamed: bool, note: str,
                retry_after: str | None = None) -> None:
    """No 5xx but load shedding; a 4xx is an OpenAI error; a stream holds no internal
    error. Shedding (503 with Retry-After, service_unavailable) is the router's answer
    when the fuzzer's own concurrent requests of up to 256 sequences pass a pool's cap
    of 256 sequences in flight (a timing question): the big request itself, or any
    request that arrives while its sequences fill the pool; the test bounds how many."""
    where = f"{note}: {status} {content[:300]!r}"
    if status == 503 and retry_after:
        assert json.loads(content)["error"]["type"] == "service_unavailable", where
        return
    assert status < 500, where
    if status >= 400:
        error = json.loads(content)["error"]
        assert isinstance(error["message"], str) and error["message"], where
        assert error["code"] == status, where
    elif streamed:
        events = [line[6:] for line in content.decode().split("\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]", where
        for event in events[:-1]:
            assert "error" not in json.loads(event), where
    else:
        assert json.loads(content)["choices"], where


async def send_all(url: str, cases: list[tuple[str, bytes, str]]) -> list[int]:
    limits = httpx.Limits(max_connections=CONCURRENCY)
    gate = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        async def send(path: str, body: bytes, note: str) -> int:
            async with gate:
                reply = await http.post(path, content=body,
                                        headers={"content-type": "application/json"})
            check_reply(reply.status_code, reply.content,
                        reply.headers.get("content-type", "").startswith("text/event-stream"),
                        note, reply.headers.get("retry-after"))
            return reply.status_code

        return await asyncio.gather(*(send(*case) for case in cases))


def test_fuzzed_bodies_never_get_a_5xx(served):
    cases = Fuzzer(seed=12, vocab_size=served.vocab_size).cases(NUM_CASES)
    assert len(cases) >= 1000
    statuses = asyncio.run(send_all(served.url, cases))
    assert statuses.count(200) >= 200  # the valid share really generated
    assert statuses.count(400) >= 500
    assert statuses.count(503) <= 10  # NOTE: shed, rarely, when two big requests overlap
    reply = httpx.post(served.url + "/v1/completions", timeout=30,
                       json={"prompt": "the sea", "max_tokens": 3})
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"] is not None


def local_port(reply: httpx.Response) -> int:
    return reply.extensions["network_stream"].get_extra_info("client_addr")[1]


def test_historical_500s_are_400s_naming_the_field_on_one_connection(served):
    valid = {"prompt": "the sea", "max_tokens": 2}
    with httpx.Client(base_url=served.url, timeout=30,
                      limits=httpx.Limits(max_connections=1)) as http:
        first = http.post("/v1/completions", json=valid)
        assert first.status_code == 200
        params = []
        for body in HISTORICAL:
            reply = http.post("/v1/completions", content=json.dumps(body),
                              headers={"content-type": "application/json"})
            assert reply.status_code == 400, reply.text
            params.append(reply.json()["error"]["param"])
            assert local_port(reply) == local_port(first)
        reply = http.post("/v1/completions", content=DEEP)
        assert reply.status_code == 400 and "nested" in reply.json()["error"]["message"]
        seeded = http.post("/v1/completions", json={**valid, "seed": 2**63 - 1, "n": 3})
        assert seeded.status_code == 200, seeded.text
        assert len(seeded.json()["choices"]) == 3
        last = http.post("/v1/completions", json=valid)
        assert last.status_code == 200 and local_port(last) == local_port(first)
    assert params == ["top_k", "stop_token_ids[0]", "prompt", "cache_salt"]


def test_an_internal_error_is_a_clean_500_and_the_connection_stays(served, monkeypatch):
    def broken(request):
        raise RuntimeError("grpc._channel secret detail")

    valid = {"prompt": "the sea", "max_tokens": 2}
    with httpx.Client(base_url=served.url, timeout=30,
                      limits=httpx.Limits(max_connections=1)) as http:
        first = http.post("/v1/completions", json=valid)
        monkeypatch.setattr(served.router, "generate", broken)
        reply = http.post("/v1/completions", json=valid)
        monkeypatch.undo()
        assert reply.status_code == 500
        assert reply.json()["error"]["message"] == INTERNAL_ERROR
        assert "RuntimeError" not in reply.text and "secret" not in reply.text
        again = http.post("/v1/completions", json=valid)
        assert again.status_code == 200 and local_port(again) == local_port(first)


def test_bodies_over_the_limit_get_413(served):
    def chunks():  # no Content-Length: the limit is applied while reading
        piece = b" " * 2**20
        for _ in range(MAX_BODY_BYTES // len(piece) + 1):
            yield piece

    with httpx.Client(base_url=served.url, timeout=60) as http:
        big = b'{"prompt": "' + b"a" * MAX_BODY_BYTES + b'"}'
        for content in (big, chunks()):
            reply = http.post("/v1/completions", content=content,
                              headers={"content-type": "application/json"})
            assert reply.status_code == 413, reply.text
            assert str(MAX_BODY_BYTES) in reply.json()["error"]["message"]
        assert http.post("/v1/completions", json={"prompt": "a", "max_tokens": 1}
                         ).status_code == 200


# ---- the gRPC API ----------------------------------------------------------------------


def grpc_error(address: str, request) -> grpc.aio.AioRpcError:
    async def run():
        async with grpc.aio.insecure_channel(address) as channel:
            if isinstance(request, bytes):
                call = channel.unary_stream("/pdserve.v1.Router/Generate",
                                            request_serializer=lambda b: b,
                                            response_deserializer=lambda b: b)
                stream = call(request, timeout=30)
            else:
                stream = router_pb2_grpc.RouterStub(channel).Generate(request, timeout=30)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in stream:
                    pass
            return info.value

    return asyncio.run(run())


def test_grpc_generate_applies_the_same_bounds(served):
    vocab = served.vocab_size

    def request(**params) -> router_pb2.GenerateRequest:
        stop = params.pop("stop", [])
        salt = params.pop("cache_salt", None)
        return router_pb2.GenerateRequest(
            text="the sea", stop=stop, cache_salt=salt,
            sampling_params=common_pb2.SamplingParams(max_tokens=2, **params))

    cases = [
        (request(top_k=-5), "top_k"),
        (request(seed=-1), "seed"),
        (request(stop_token_ids=[vocab]), "stop_token_ids"),
        (request(stop_token_ids=list(range(1025))), "stop_token_ids"),
        (request(stop=["a"] * 17), "stop"),
        (request(stop=["s" * 2000]), "stop"),
        (router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=[1, vocab])), "token_ids"),
        (router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=[-1])), "token_ids"),
        (b"\x1a\x03\xed\xa0\x80", "GenerateRequest"),  # text = an encoded lone surrogate
        (b"\x4a\x03\xed\xa0\x80", "GenerateRequest"),  # cache_salt, likewise
        (b"\xff\xff\xff", "GenerateRequest"),
    ]
    for message, words in cases:
        error = grpc_error(served.grpc_address, message)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (message, error.details())
        assert words in error.details(), error.details()
        assert "Error parsing" not in error.details() and "<class" not in error.details()
