"""Client authentication with API keys (``router/api_keys.py``), end to end: a real Redis, one
prefill and one decode worker in this process on the demo model, and two routers that
find them through Redis:

- ``pdserve serve``'s router, built from its parsed flags (``--api-key`` twice,
  ``--api-key-file`` and ``--admin-api-key-file``) by the code ``pdserve serve`` runs
  (``_make_router``, ``run_router``: HTTP and gRPC on one event loop), with a
  ``PoolScaler`` that owns the two workers (so ``/admin/scale`` answers);
- ``python -m pdserve.router`` as a subprocess on 0.0.0.0, its key from ``VLLM_API_KEY``,
  ``--public-endpoints ''`` and no admin key (admin endpoints for loopback clients only).

The keys as the flags and the environment give them, with no cluster, are
``test_api_auth_flags.py``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
from disagg_client import TEST_AUTH, TEST_SECRET

from pdserve.cluster import event_loop
from pdserve.cluster.auth import SECRET_ENV
from pdserve.cluster.wire import sampling_params_to_proto
from pdserve.cluster.worker_config import WorkerConfig
from pdserve.decode_worker.server import DecodeWorker
from pdserve.engine import EngineConfig, SamplingParams
from pdserve.engine.demo_model import make_demo_model
from pdserve.entrypoints.cli import build_parser
from pdserve.entrypoints.redis_server import RedisServer, free_port
from pdserve.entrypoints.scaling import PoolScaler
from pdserve.entrypoints.serve import Interrupts, _ServeRun
from pdserve.prefill_worker.server import PrefillWorker
from pdserve.proto import common_pb2, router_pb2, router_pb2_grpc
from pdserve.router.api_keys import ApiKeyAuth, is_loopback
from pdserve.router.grpc_server import start_grpc_server
from pdserve.router.http import build_app
from pdserve.router.serving import bind_listener, run_router

openai = pytest.importorskip("openai")

MAX_MODEL_LEN = 256
KEY, SECOND_KEY, FILE_KEY = "sk-first-0123456789abcdef", "sk-second", "sk-from-the-file"
VLLM_KEY = "sk-vllm-env-key"
ADMIN_KEY = "sk-admin-from-the-file"
PROMPT = "The quick brown fox jumps over the lazy dog and then it runs far away"
START_TIMEOUT_S = 60
# counters that move as soon as the router routes a request
ROUTED = ("pdserve:routing_decisions_total", "pdserve:prefix_index_lookups_total",
          "vllm:prompt_tokens_total", "vllm:request_success_total")


def unauthorized(message: str) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "param": None,
                      "code": "invalid_api_key"}}


MISSING = unauthorized("Missing API key: send it in the Authorization header as "
                       "'Bearer <key>'.")
MALFORMED = unauthorized("Malformed Authorization header: it must be 'Bearer <key>', "
                         "given once.")
INVALID = unauthorized("Invalid API key.")


class RouterThread:
    """``run_router`` under ``asyncio.run`` in a thread, as ``pdserve serve`` runs it;
    ``stop()`` cancels it, and ``asyncio.run`` then ends the app's lifespan."""

    def __init__(self, router, app) -> None:
        self.router = router
        self.http_sock = bind_listener("127.0.0.1", 0, "test HTTP")
        self.grpc_sock = bind_listener("127.0.0.1", 0, "test gRPC")
        self.url = f"http://127.0.0.1:{self.http_sock.getsockname()[1]}"
        self.grpc_address = f"127.0.0.1:{self.grpc_sock.getsockname()[1]}"
        self.serving = threading.Event()
        self.loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._thread = threading.Thread(target=asyncio.run, args=(self._main(app),),
                                        daemon=True)
        self._thread.start()
        if not self.serving.wait(START_TIMEOUT_S):
            raise RuntimeError("run_router did not start serving")

    async def _main(self, app) -> None:
        self.loop, self._task = asyncio.get_running_loop(), asyncio.current_task()
        with self.http_sock, contextlib.suppress(asyncio.CancelledError):
            await run_router(self.router, app, "127.0.0.1", self.http_sock, self.grpc_sock,
                             on_serving=self.serving.set)

    def call(self, coro, timeout_s: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self._task.cancel)
        self._thread.join(30)


@dataclass
class Cluster:
    model: Path
    served: RouterThread  # pdserve serve's router: KEY, SECOND_KEY, FILE_KEY; ADMIN_KEY
    plain_url: str  # python -m pdserve.router on 0.0.0.0: VLLM_KEY, no public endpoint
    plain_port: int
    plain_log: Path
    redis_url: str

    def client(self, api_key: str, url: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=(url or self.served.url) + "/v1", api_key=api_key,
                             max_retries=0, timeout=60)

    def routed(self) -> list[str]:
        """The router's counters of routed requests, as exposed."""
        return [line for line in self.served.router.metrics.exposition().decode().splitlines()
                if line.startswith(ROUTED)]


KEY_VARIABLES = ("PDSERVE_API_KEY", "VLLM_API_KEY", "PDSERVE_ADMIN_API_KEY", "OPENAI_API_KEY")


def start_plain_router(model: Path, redis_url: str, log: Path,
                       api_key: str | None = VLLM_KEY) -> tuple[subprocess.Popen, str, int]:
    """``python -m pdserve.router`` on every address (0.0.0.0), with no admin key and
    ``api_key`` (None: no key) in ``VLLM_API_KEY``."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in KEY_VARIABLES}
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve.router", "--redis-url", redis_url,
             "--model", str(model), "--max-model-len", str(MAX_MODEL_LEN),
             "--host", "0.0.0.0", "--port", str(port), "--grpc-port", str(free_port()),
             "--public-endpoints", "",
             "--log-level", "info"],
            stdout=out, stderr=subprocess.STDOUT,
            env={**env, **({"VLLM_API_KEY": api_key} if api_key else {}),
                 SECRET_ENV: TEST_SECRET})
    return proc, f"http://127.0.0.1:{port}", port


def wait_ready(proc: subprocess.Popen, url: str, log: Path) -> None:
    """Until the router at ``url`` answers ``/ready`` with 200 (it sees the workers)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url + "/ready", timeout=1, headers={
                    "Authorization": f"Bearer {VLLM_KEY}"}).status_code == 200:
                return
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"python -m pdserve.router did not get ready:\n"
                               f"{log.read_text()[-3000:]}")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("api_auth")
    model = make_demo_model(root / "demo")
    key_file = root / "keys.txt"
    key_file.write_text(f"\n  {FILE_KEY}  \n\n")
    admin_file = root / "admin-keys.txt"
    admin_file.write_text(f"{ADMIN_KEY}\n")
    engine = EngineConfig(str(model), dtype="float32", max_model_len=MAX_MODEL_LEN,
                          load_progress=False, num_gpu_blocks_override=64, num_threads=1)
    loop = event_loop.new_event_loop()  # NOTE: the router's and workers' own loop
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def call(coro, timeout_s: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout_s)

    with RedisServer() as redis:
        plain, plain_url, plain_port = start_plain_router(model, redis.url,
                                                          root / "router.log")
        workers = [PrefillWorker(WorkerConfig("prefill", engine, redis_url=redis.url,
                                              auth=TEST_AUTH)),
                   DecodeWorker(WorkerConfig("decode", engine, redis_url=redis.url,
                                             auth=TEST_AUTH))]
        served = None
        try:
            for worker in workers:
                call(worker.start())
            args = build_parser().parse_args(
                ["serve", "--model", str(model), "--dtype", "float32", "--max-model-len",
                 str(MAX_MODEL_LEN), "--redis-url", redis.url, "--api-key", KEY,
                 "--api-key", SECOND_KEY, "--api-key-file", str(key_file),
                 "--admin-api-key-file", str(admin_file)])
            run = _ServeRun(args, Interrupts())
            # NOTE: pdserve serve's scaler, owning this module's two workers (no launcher:
            # /admin/scale to the sizes they have starts and stops nothing)
            scaler = PoolScaler(None, {"prefill": None, "decode": None}, 1, 1.0)
            for worker in workers:
                scaler.adopt(worker.config.role, worker, worker.worker_id)
            router, background = run._make_router(run.models[0], redis.url, TEST_AUTH,
                                                  scaler)
            served = RouterThread(router, build_app(
                router, api_auth=run.api_auth, admin_auth=run.admin_auth, scaler=scaler,
                background=background))
            wait_ready(plain, plain_url, root / "router.log")
            yield Cluster(model, served, plain_url, plain_port, root / "router.log", redis.url)
        finally:
            plain.terminate()
            plain.wait(30)
            if served is not None:
                served.stop()
            for worker in workers:
                call(worker.stop())
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)


COMPLETION = {"prompt": PROMPT, "max_tokens": 4}


@pytest.mark.parametrize("headers, body", [
    ({}, MISSING),
    ({"Authorization": "Bearer wrong-key"}, INVALID),
    ({"Authorization": f"Bearer {KEY}x"}, INVALID),
    ({"Authorization": f"Bearer {KEY[:-1]}"}, INVALID),
    ({"Authorization": f"Basic {KEY}"}, MALFORMED),
    ({"Authorization": KEY}, MALFORMED),
    ({"Authorization": "Bearer"}, MALFORMED),
    ({"Authorization": f"Bearer {KEY} {KEY}"}, INVALID),
    ([("Authorization", f"Bearer {KEY}"), ("Authorization", f"Bearer {KEY}")], MALFORMED),
], ids=["missing", "wrong", "longer", "shorter", "basic", "no-scheme", "no-key", "two-words",
        "twice"])
def test_a_request_without_an_accepted_key_gets_401(cluster, headers, body):
    for path in ("/v1/completions", "/v1/chat/completions"):
        reply = httpx.post(cluster.served.url + path, json=COMPLETION, headers=headers)
        assert reply.status_code == 401
        assert reply.json() == body
        assert reply.headers["www-authenticate"] == "Bearer"
    assert httpx.get(cluster.served.url + "/v1/models", headers=headers).status_code == 401


def test_a_refused_request_reaches_no_worker(cluster):
    url, request = cluster.served.url + "/v1/completions", {**COMPLETION, "max_tokens": 2}
    before = cluster.routed()
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": f"Basic {KEY}"}):
        assert httpx.post(url, json=request, headers=headers).status_code == 401
    assert cluster.routed() == before
    assert httpx.post(url, json=request, headers={"Authorization": f"Bearer {KEY}"}
                      ).status_code == 200
    assert cluster.routed() != before  # the counters do see a routed request


def test_401_is_sent_before_the_body_is_read(cluster):
    host, port = cluster.served.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        # 10 MB announced (under the 16 MiB limit), nothing sent: only an answer that does
        # not wait for the body can arrive
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 10000000\r\n\r\n")
        start = time.monotonic()
        reply = b""
        while b"}}" not in reply:  # the end of the JSON error body
            data = sock.recv(65536)
            assert data, f"connection closed after {reply!r}"
            reply += data
        assert time.monotonic() - start < 2.0
    head, body = reply.decode("latin-1").split("\r\n\r\n", 1)
    assert head.startswith("HTTP/1.1 401")
    assert "\r\nwww-authenticate: bearer" in head.lower()
    assert json.loads(body) == MISSING


def test_unknown_paths_need_the_key_too(cluster):
    for path in ("/v1/no-such-thing", "/docs", "/health/", "/openapi.json"):
        reply = httpx.get(cluster.served.url + path)
        assert (reply.status_code, reply.json()) == (401, MISSING)
    reply = httpx.get(cluster.served.url + "/v1/no-such-thing",
                      headers={"Authorization": f"Bearer {KEY}"})
    assert reply.status_code == 404


def test_public_endpoints_are_open_by_default(cluster):
    for path in ("/health", "/ready", "/metrics"):
        reply = httpx.get(cluster.served.url + path)
        assert reply.status_code == 200, (path, reply.text)
    assert "vllm:prompt_tokens" in httpx.get(cluster.served.url + "/metrics").text


@pytest.mark.parametrize("key", [KEY, SECOND_KEY, FILE_KEY])
def test_each_key_serves_completions_with_the_openai_sdk(cluster, key):
    reply = cluster.client(key).completions.create(
        model=str(cluster.model), prompt=PROMPT, max_tokens=6, temperature=0,
        extra_body={"ignore_eos": True})
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 6


def test_chat_and_streams_with_the_key(cluster):
    client = cluster.client(KEY)
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    reply = client.chat.completions.create(model=str(cluster.model), messages=messages,
                                           max_tokens=5, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 5
    chunks = list(client.chat.completions.create(
        model=str(cluster.model), messages=messages, max_tokens=5, temperature=0,
        stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        reply.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    expected = client.completions.create(model=str(cluster.model), prompt=PROMPT,
                                         max_tokens=5, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text
    chunks = list(client.completions.create(
        model=str(cluster.model), prompt=PROMPT, max_tokens=5, temperature=0, stream=True,
        extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert len(chunks) > 1 and chunks[-1].choices[0].finish_reason == "length"


def test_the_openai_sdk_with_a_wrong_key_gets_authentication_error(cluster):
    with pytest.raises(openai.AuthenticationError) as info:
        cluster.client("sk-wrong").completions.create(model=str(cluster.model),
                                                      prompt=PROMPT, max_tokens=2)
    assert info.value.status_code == 401
    assert info.value.code == "invalid_api_key"
    assert info.value.body == INVALID["error"]


def test_a_refusal_keeps_the_connection_usable(cluster):
    with httpx.Client(base_url=cluster.served.url) as http:
        assert http.post("/v1/completions", json=COMPLETION).status_code == 401
        reply = http.post("/v1/completions", json={**COMPLETION, "model": str(cluster.model)},
                          headers={"Authorization": f"bearer {KEY}"})  # any case of Bearer
        assert reply.status_code == 200


def generate_request(max_tokens: int = 6) -> router_pb2.GenerateRequest:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return router_pb2.GenerateRequest(text=PROMPT, sampling_params=sampling_params_to_proto(params))


async def grpc_calls(address: str, metadata) -> dict[str, object]:
    """Each Router method once with ``metadata``: its reply, or its status code."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        calls = {
            "Generate": lambda: _collect(stub.Generate(generate_request(), metadata=metadata,
                                                       timeout=60)),
            "Abort": lambda: stub.Abort(router_pb2.RouterAbortRequest(request_id="x"),
                                        metadata=metadata, timeout=10),
            "Health": lambda: stub.Health(common_pb2.HealthRequest(), metadata=metadata,
                                          timeout=10),
            "ListModels": lambda: stub.ListModels(router_pb2.ListModelsRequest(),
                                                  metadata=metadata, timeout=10),
        }
        results = {}
        for name, call in calls.items():
            try:
                results[name] = await call()
            except grpc.aio.AioRpcError as exc:
                results[name] = (exc.code(), exc.details())
        return results


async def _collect(stream) -> list:
    return [message async for message in stream]


REFUSED = {"": (grpc.StatusCode.UNAUTHENTICATED, MISSING["error"]["message"]),
           "wrong": (grpc.StatusCode.UNAUTHENTICATED, INVALID["error"]["message"]),
           "basic": (grpc.StatusCode.UNAUTHENTICATED, MALFORMED["error"]["message"])}


@pytest.mark.parametrize("metadata, refusal", [
    ((), REFUSED[""]), ((("authorization", "Bearer sk-wrong"),), REFUSED["wrong"]),
    ((("authorization", f"Basic {KEY}"),), REFUSED["basic"])], ids=["none", "wrong", "basic"])
def test_grpc_without_an_accepted_key_is_unauthenticated_but_health(cluster, metadata, refusal):
    results = asyncio.run(grpc_calls(cluster.served.grpc_address, metadata))
    assert results.pop("Health").status == "ok"  # /health is public, so is Health
    assert results == dict.fromkeys(["Generate", "Abort", "ListModels"], refusal)


def test_grpc_with_the_key_generates(cluster):
    results = asyncio.run(grpc_calls(cluster.served.grpc_address,
                                     (("authorization", f"Bearer {FILE_KEY}"),)))
    messages = results["Generate"]
    assert sum(len(m.token_ids) for m in messages) == 6
    assert messages[-1].finish_reason == "length" and messages[-1].usage.completion_tokens == 6
    assert results["Abort"].aborted is False
    assert list(results["ListModels"].models) == [str(cluster.model)]


def test_grpc_unknown_methods_need_the_key_too(cluster):
    async def call(metadata):
        async with grpc.aio.insecure_channel(cluster.served.grpc_address) as channel:
            method = channel.unary_unary("/pdserve.v1.Router/NoSuchMethod")
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await method(b"", metadata=metadata, timeout=10)
            return info.value.code()

    assert asyncio.run(call(())) == grpc.StatusCode.UNAUTHENTICATED
    assert asyncio.run(call((("authorization", f"Bearer {KEY}"),))) == \
        grpc.StatusCode.UNIMPLEMENTED


def test_grpc_health_is_protected_when_health_is_not_public(cluster):
    auth = ApiKeyAuth.of([KEY], public_paths=["/metrics"])
    server, port = cluster.served.call(
        start_grpc_server(cluster.served.router, "127.0.0.1", 0, api_auth=auth))
    try:
        refused = asyncio.run(grpc_calls(f"127.0.0.1:{port}", ()))
        assert refused["Health"] == REFUSED[""]
        accepted = asyncio.run(grpc_calls(f"127.0.0.1:{port}",
                                          (("authorization", f"Bearer {KEY}"),)))
        assert accepted["Health"].status == "ok"
    finally:
        cluster.served.call(server.stop(1))


def test_plain_router_takes_vllm_api_key_and_protects_every_path(cluster):
    url = cluster.plain_url
    for path in ("/health", "/ready", "/metrics", "/v1/models"):
        reply = httpx.get(url + path)
        assert (reply.status_code, reply.json()) == (401, MISSING), path
        assert httpx.get(url + path, headers={"Authorization": f"Bearer {VLLM_KEY}"}
                         ).status_code == 200, path
    reply = cluster.client(VLLM_KEY, url).completions.create(
        model=str(cluster.model), prompt=PROMPT, max_tokens=3, extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 3
    with pytest.raises(openai.AuthenticationError):
        cluster.client(KEY, url).models.list()


# Operators apart from clients: the admin endpoints.

ADMIN_PATHS = (("POST", "/admin/scale", {"prefill_workers": 1, "decode_workers": 1}),
               ("GET", "/admin/pools", None), ("GET", "/metrics/targets", None))
NEEDS_ADMIN = {"error": {"message": "This endpoint needs an admin API key "
                         "(--admin-api-key); a client API key is not accepted here.",
                         "type": "permission_error", "param": None,
                         "code": "admin_key_required"}}


def admin_call(url: str, method: str, path: str, body, headers=None) -> httpx.Response:
    return httpx.request(method, url + path, json=body, headers=headers or {}, timeout=30)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize("key", [KEY, SECOND_KEY, FILE_KEY])
def test_a_client_key_gets_403_on_the_admin_endpoints(cluster, key):
    before = cluster.served.router.pool.metrics_targets(cluster.served.router.served_model_name)
    for method, path, body in ADMIN_PATHS:
        reply = admin_call(cluster.served.url, method, path, body, bearer(key))
        assert (reply.status_code, reply.json()) == (403, NEEDS_ADMIN), path
    assert before  # the refused call changed nothing, and the targets do exist


@pytest.mark.parametrize("headers, body", [
    ({}, MISSING), (bearer("sk-wrong"), INVALID), (bearer(ADMIN_KEY + "x"), INVALID),
    ({"Authorization": f"Basic {ADMIN_KEY}"}, MALFORMED)], ids=["none", "wrong", "longer",
                                                                "basic"])
def test_no_or_an_unknown_key_gets_401_on_the_admin_endpoints(cluster, headers, body):
    for method, path, request in ADMIN_PATHS:
        reply = admin_call(cluster.served.url, method, path, request, headers)
        assert (reply.status_code, reply.json()) == (401, body), path
        assert reply.headers["www-authenticate"] == "Bearer"


def test_the_admin_key_gets_200_on_the_admin_endpoints(cluster):
    headers = bearer(ADMIN_KEY)
    sizes = {"prefill_workers": 1, "decode_workers": 1}
    scaled = admin_call(cluster.served.url, "POST", "/admin/scale", sizes, headers)
    assert (scaled.status_code, scaled.json()) == (200, sizes)
    pools = admin_call(cluster.served.url, "GET", "/admin/pools", None, headers)
    assert (pools.status_code, pools.json()) == (200, sizes)
    targets = admin_call(cluster.served.url, "GET", "/metrics/targets", None, headers)
    assert targets.status_code == 200
    roles = sorted(t["labels"]["__meta_pdserve_role"] for t in targets.json())
    assert roles == ["decode", "prefill"]


def test_the_admin_key_is_a_client_key_too_over_http_and_grpc(cluster):
    reply = cluster.client(ADMIN_KEY).completions.create(
        model=str(cluster.model), prompt=PROMPT, max_tokens=2, extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 2
    results = asyncio.run(grpc_calls(cluster.served.grpc_address,
                                     (("authorization", f"Bearer {ADMIN_KEY}"),)))
    assert list(results["ListModels"].models) == [str(cluster.model)]


def non_loopback_ipv4() -> str | None:
    """One of this machine's IPv4 addresses that is not loopback: the default route's
    source address, else one its host name resolves to; None when it has none."""
    candidates = []
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))  # TEST-NET-1: nothing is sent, the route is looked up
        candidates.append(s.getsockname()[0])
    with contextlib.suppress(OSError):
        candidates += [info[4][0] for info in socket.getaddrinfo(
            socket.gethostname(), None, socket.AF_INET, socket.SOCK_STREAM)]
    return next((a for a in candidates if a != "0.0.0.0" and not is_loopback(a)), None)


def test_without_an_admin_key_only_loopback_reaches_the_admin_endpoints(cluster):
    address = non_loopback_ipv4()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address to connect through")
    remote = f"http://{address}:{cluster.plain_port}"
    key = bearer(VLLM_KEY)
    assert httpx.get(remote + "/v1/models", headers=key, timeout=30).status_code == 200
    for method, path, body in ADMIN_PATHS:
        for headers in ({}, key):  # whatever key a remote client sends
            reply = admin_call(remote, method, path, body, headers)
            assert reply.status_code == 403, (path, reply.text)
            assert reply.json()["error"]["code"] == "admin_loopback_only"
            assert "loopback" in reply.json()["error"]["message"]
    local = admin_call(cluster.plain_url, "GET", "/metrics/targets", None)
    assert local.status_code == 200 and len(local.json()) == 2
    # a router run alone owns no workers: its answer, past the loopback check
    assert admin_call(cluster.plain_url, "GET", "/admin/pools", None).status_code == 501
    # through a proxy on this machine, a client is not a loopback one
    proxied = admin_call(cluster.plain_url, "GET", "/metrics/targets", None,
                         {"X-Forwarded-For": "127.0.0.1"})
    assert proxied.status_code == 403
    log = cluster.plain_log.read_text()
    assert "admin endpoints (/admin/*, /metrics/targets) answer loopback clients only" in log
    assert "THE API IS OPEN" not in log  # it has a client key


def test_an_open_api_on_every_address_is_a_start_up_warning(cluster, tmp_path):
    log = tmp_path / "open-router.log"
    proc, _, _ = start_plain_router(cluster.model, cluster.redis_url, log, api_key=None)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while "THE API IS OPEN" not in log.read_text():
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
    finally:
        proc.terminate()
        proc.wait(30)
    (line,) = [line for line in log.read_text().splitlines() if "THE API IS OPEN" in line]
    assert " WARNING pdserve.router.flags: " in line
    assert "no client API key" in line and "listens on 0.0.0.0, port(s)" in line


def scale_cli(url: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in KEY_VARIABLES}
    return subprocess.run([sys.executable, "-m", "pdserve.entrypoints.cli", "scale", "--url",
                           url, *args], capture_output=True, text=True, timeout=120,
                          env={**clean, **env}, check=False)


def test_pdserve_scale_sends_only_the_admin_key(cluster, tmp_path):
    url = cluster.served.url
    # client keys in the variables an OpenAI client reads: never sent, so no key at all
    for env in ({"OPENAI_API_KEY": KEY}, {"PDSERVE_API_KEY": KEY, "OPENAI_API_KEY": KEY}):
        refused = scale_cli(url, env)
        assert refused.returncode == 1
        assert refused.stderr.strip() == f"pdserve scale: 401: {MISSING['error']['message']}"
    wrong = scale_cli(url, {}, "--admin-api-key", KEY)  # a client key, given as admin
    assert wrong.returncode == 1 and "403: This endpoint needs an admin API key" in wrong.stderr
    sizes = '{"prefill_workers": 1, "decode_workers": 1}'
    from_env = scale_cli(url, {"PDSERVE_ADMIN_API_KEY": ADMIN_KEY, "OPENAI_API_KEY": KEY})
    assert (from_env.returncode, from_env.stdout.strip()) == (0, sizes), from_env.stderr
    key_file = tmp_path / "admin"
    key_file.write_text(ADMIN_KEY + "\n")
    from_file = scale_cli(url, {}, "--admin-api-key-file", str(key_file), "--prefill", "1")
    assert (from_file.returncode, from_file.stdout.strip()) == (0, sizes), from_file.stderr
    empty = scale_cli(url, {"PDSERVE_ADMIN_API_KEY": ""})
    assert empty.returncode == 2 and "PDSERVE_ADMIN_API_KEY: the API key is empty" in \
        empty.stderr


def test_pdserve_scale_needs_no_key_on_loopback_without_an_admin_key(cluster):
    reply = scale_cli(cluster.plain_url, {"OPENAI_API_KEY": VLLM_KEY})
    assert reply.returncode == 1  # past the loopback check: a router alone has no scaler
    assert reply.stderr.startswith("pdserve scale: 501:"), reply.stderr
