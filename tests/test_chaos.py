"""Chaos: the request lifecycle under failure (issue 12, docs/architecture.md "Lifecycle and failure").

One cluster for the module, all real: a Redis server, 2 prefill and 2 decode workers as
Ray actors (separate processes, KV over the pair socket), and the router's HTTP and gRPC APIs on
loopback. Clients are httpx (SSE) and the router's gRPC stub. Every loop is bounded.

- cancel 1,000 streams at random points (before the first token, during the KV pull,
  mid-stream, ``n>1`` fan-outs, gRPC ``Abort``): every worker's blocks come back free,
  no lease or pull is left and the ownership audit stays 0; every stream not cancelled is
  exactly the offline engine's output;
- past the admission caps requests get 503 + ``Retry-After`` at once; below them none
  is lost;
- ``kill -9`` of a prefill worker, then of a decode worker, under concurrent streams:
  every stream completes with exactly its tokens (seeded ones equal an undisturbed run);
- Redis stopped for ``REDIS_OUTAGE_S`` seconds under load: at least 99% of requests
  succeed, short (prefilled on the decode worker) and disaggregated alike; when Redis
  returns, prefix-aware routing resumes without restarting anything.

``PDSERVE_CHAOS_REQUESTS`` and ``PDSERVE_REDIS_OUTAGE_S`` scale the first and the last
(``pytest -m slow`` style runs can raise them).
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import threading
import time
from dataclasses import dataclass, field

import grpc
import httpx
import pytest
from conftest import stop_cluster
from disagg_client import TEST_AUTH
from disagg_client import channel as worker_channel
from router_clients import grpc_abort, grpc_generate, sse

from pdserve.cluster import event_loop
from pdserve.cluster.worker_config import WorkerConfig
from pdserve.engine import LLM, EngineConfig, SamplingParams
from pdserve.engine.demo_model import make_demo_model
from pdserve.engine.tokenizer import encode_prompt, load_tokenizer
from pdserve.entrypoints.launcher import RayLauncher
from pdserve.entrypoints.redis_server import RedisServer, free_port
from pdserve.proto import (
    common_pb2,
    decode_pb2_grpc,
    prefill_pb2_grpc,
    router_pb2_grpc,
)
from pdserve.router.config import RouterConfig
from pdserve.router.grpc_server import start_grpc_server
from pdserve.router.http import build_app
from pdserve.router.http_server import uvicorn_config
from pdserve.router.model_service import ModelService

MAX_MODEL_LEN = 256
LEASE_S = 5.0
NUM_REQUESTS = int(os.environ.get("PDSERVE_CHAOS_REQUESTS", "1000"))
REDIS_OUTAGE_S = float(os.environ.get("PDSERVE_REDIS_OUTAGE_S", "30"))
SENTENCES = [
    "The KV cache of a long prompt is computed once by the prefill worker and then moved",
    "Paged attention reads keys and values through a block table, one block at a time",
    "A router sends each prompt to the worker that already holds most of its prefix",
    "Continuous batching lets new sequences join the running batch at every step",
    "Prefix caching keeps freed blocks findable by their hash until their slot is needed",
    "Short question",
    "Hello there",
    "Tell me a story about ships on a grey sea, with a lighthouse and a storm at night",
]


@dataclass
class Cluster:
    model: str
    redis: RedisServer
    launcher: RayLauncher
    router: ModelService
    url: str
    grpc_address: str
    oracle: LLM
    tokenizer: object
    loop: asyncio.AbstractEventLoop
    servers: list = field(default_factory=list)

    def expected_tokens(self, prompt: list[int], params: SamplingParams) -> list[int]:
        return self.oracle.generate([prompt], params)[0].outputs[0].token_ids

    def resumed_tokens(self, prompt: list[int], params: SamplingParams,
                       generated: list[int]) -> list[int]:
        """The whole output of a request migrated after ``generated``: those tokens,
        then what the engine samples once it has recomputed prompt and tokens in one
        prefill, as the decode worker the request moves to does."""
        engine = self.oracle.engine
        engine.add_request("resumed", prompt, params, resume_token_ids=generated)
        tokens = list(generated)
        while engine.has_unfinished_requests():
            tokens += [t for output in engine.step() for t in output.new_token_ids]
        return tokens

    def expected_text(self, prompt: str, params: SamplingParams) -> str:
        return self.oracle.generate([prompt], params)[0].outputs[0].text

    def call(self, coro, timeout_s: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)


def engine_config(model: str) -> EngineConfig:
    return EngineConfig(model, dtype="float32", max_model_len=MAX_MODEL_LEN,
                        load_progress=False, num_gpu_blocks_override=160, num_threads=1)


async def serve_http(router: ModelService, port: int):
    """Start uvicorn for ``router`` on loopback; returns (server, its serving task)."""
    import uvicorn

    server = uvicorn.Server(uvicorn_config(build_app(router), host="127.0.0.1", port=port,
                                           log_level="warning"))
    task = asyncio.ensure_future(server.serve())
    for _ in range(600):
        if server.started:
            return server, task
        await asyncio.sleep(0.05)
    raise RuntimeError("uvicorn did not start")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    model = str(make_demo_model(tmp_path_factory.mktemp("chaos") / "demo"))
    loop = event_loop.new_event_loop()  # NOTE: the router's and workers' own loop
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    redis = RedisServer()
    launcher = None
    try:
        launcher = RayLauncher(num_cpus=2)
        common = {"engine": engine_config(model), "redis_url": redis.url, "lease_s": LEASE_S,
                  "kv_transfer_timeout_s": 10.0, "auth": TEST_AUTH}
        launcher.launch(WorkerConfig("prefill", **common), 2, workers_on_node=4)
        launcher.launch(WorkerConfig("decode", **common), 2, workers_on_node=4)
        router = ModelService(RouterConfig(model, redis.url, max_model_len=MAX_MODEL_LEN,
                                     health_timeout_s=5.0,
                                     disaggregation="always", auth=TEST_AUTH))
        port = free_port()

        async def start():
            server, task = await serve_http(router, port)  # its lifespan starts the router
            grpc_server, grpc_port = await start_grpc_server(router, "127.0.0.1", 0)
            return server, task, grpc_server, grpc_port

        server, task, grpc_server, grpc_port = asyncio.run_coroutine_threadsafe(
            start(), loop).result(120)
        oracle = LLM(model, dtype="float32", max_model_len=MAX_MODEL_LEN, load_progress=False)
        c = Cluster(model, redis, launcher, router, f"http://127.0.0.1:{port}",
                    f"127.0.0.1:{grpc_port}", oracle, load_tokenizer(model), loop)
        wait_pool(c, 2, 2)
        yield c

        async def stop():
            await grpc_server.stop(1)
            server.should_exit = True
            await asyncio.wait_for(task, 30)

        asyncio.run_coroutine_threadsafe(stop(), loop).result(60)
    finally:
        stop_cluster(launcher, redis, loop, thread)


def wait_pool(cluster: Cluster, num_prefill: int, num_decode: int, timeout_s: float = 120):
    """Until the router sees that many healthy workers of each role."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pool = cluster.router.pool
        healthy = {role: sum(w.healthy for w in workers.values())
                   for role, workers in pool.workers.items()}
        if healthy == {"prefill": num_prefill, "decode": num_decode}:
            return
        time.sleep(0.2)
    raise AssertionError(f"router pool never had {num_prefill}+{num_decode} healthy workers")


async def worker_states(cluster: Cluster) -> list[common_pb2.HealthResponse]:
    infos = await asyncio.to_thread(cluster.launcher.infos)
    states = []
    for info in infos:
        stub_cls = prefill_pb2_grpc.PrefillWorkerStub if info.role == "prefill" else \
            decode_pb2_grpc.DecodeWorkerStub
        async with worker_channel(info.grpc_address) as channel:
            states.append(await stub_cls(channel).Health(common_pb2.HealthRequest(), timeout=5))
    return states


def summary(states) -> list[tuple]:
    """(worker, free, total, running, waiting, leases, pulls, unowned) of each state."""
    return [(s.worker_id, s.num_free_blocks, s.num_total_blocks, s.num_running, s.num_waiting,
             s.num_kv_leases, s.num_requests_waiting_for_kv, s.num_unowned_blocks)
            for s in states]


def is_clean(state: common_pb2.HealthResponse) -> bool:
    return (state.num_free_blocks == state.num_total_blocks and state.num_running == 0
            and state.num_waiting == 0 and state.num_kv_leases == 0
            and state.num_requests_waiting_for_kv == 0 and state.num_unowned_blocks == 0)


async def wait_clean(cluster: Cluster, timeout_s: float) -> list[common_pb2.HealthResponse]:
    """Every worker idle with all its blocks free, no lease, no pull and an audit of 0."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = await worker_states(cluster)
        if all(map(is_clean, states)) or time.monotonic() > deadline:
            return states
        await asyncio.sleep(0.25)


# ---- the tests --------------------------------------------------------------------------


GREEDY = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (3, 8, 16)]
# NOTE: long (SENTENCES[:5] are 16-18 tokens), so that Abort, sent 1-3 messages in,
# usually finds it running; a client that lags may still see its end (then it is whole)
ABORTED = SamplingParams(temperature=0.0, max_tokens=MAX_MODEL_LEN - 40, ignore_eos=True)
CANCEL_KINDS = ("before_first_token", "during_pull", "mid_stream", "n_fanout", "grpc_abort")


def test_cancel_at_random_points_leaves_no_block_held(cluster):
    """``NUM_REQUESTS`` streams, 30% cancelled at random points; then every worker is
    clean within the lease time, and every stream not cancelled is exact."""
    rng = random.Random(12)
    long_prompts = [encode_prompt(cluster.tokenizer, s) for s in SENTENCES[:5]]
    plan = []
    for i in range(NUM_REQUESTS):
        cancel = rng.random() < 0.3
        plan.append((i, CANCEL_KINDS[i % len(CANCEL_KINDS)] if cancel else
                     rng.choice(("http", "http", "http", "grpc")),
                     rng.randrange(len(SENTENCES)), rng.choice(GREEDY)))
    expected_text = {(s, p.max_tokens): cluster.expected_text(SENTENCES[s], p)
                     for s in range(len(SENTENCES)) for p in GREEDY}
    expected_ids = {(s, p.max_tokens): cluster.expected_tokens(long_prompts[s], p)
                    for s in range(len(long_prompts)) for p in GREEDY}
    expected_long = [cluster.expected_tokens(p, ABORTED) for p in long_prompts]
    outcomes: dict[str, int] = {}
    wrong = []

    async def one(http, stub, i, kind, s, params):
        body = {"prompt": SENTENCES[s], "max_tokens": params.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        if kind == "http":
            body["stream_options"] = {"include_usage": True}
            status, texts, finishes, usage = await sse(http, body)
            tokens = usage and usage["completion_tokens"]
            if (status, texts, finishes, tokens) != (
                    200, {0: expected_text[s, params.max_tokens]}, {0: "length"},
                    params.max_tokens):
                wrong.append((i, kind, status, texts, finishes, usage))
        elif kind == "grpc":
            s %= len(long_prompts)
            tokens, finish, _ = await grpc_generate(stub, f"g{i}", long_prompts[s], params)
            if (tokens, finish) != (expected_ids[s, params.max_tokens], "length"):
                wrong.append((i, kind, tokens, finish))
        elif kind in ("before_first_token", "during_pull"):
            delay = rng.uniform(0, 0.01) if kind == "before_first_token" else \
                rng.uniform(0.005, 0.06)
            body["prompt"] = SENTENCES[s % 5]  # long enough to go through a prefill worker
            task = asyncio.ensure_future(sse(http, body))
            await asyncio.sleep(delay)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        elif kind == "mid_stream":
            await sse(http, {**body, "max_tokens": 40}, max_events=rng.randint(1, 4))
        elif kind == "n_fanout":
            await sse(http, {**body, "n": 3, "max_tokens": 40}, max_events=1)
        else:  # grpc_abort
            s %= len(long_prompts)
            kind, bad = await grpc_abort(stub, f"a{i}", long_prompts[s], ABORTED,
                                         expected_long[s], rng.randint(1, 3))
            if bad:
                wrong.append((i, kind, *bad))
        outcomes[kind] = outcomes.get(kind, 0) + 1

    async def main():
        limits = httpx.Limits(max_connections=32)
        async with httpx.AsyncClient(base_url=cluster.url, timeout=120, limits=limits) as http, \
                grpc.aio.insecure_channel(cluster.grpc_address) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            gate = asyncio.Semaphore(24)

            async def bounded(*args):
                async with gate:
                    await one(http, stub, *args)

            await asyncio.gather(*(bounded(*step) for step in plan))
        ended = time.monotonic()
        states = await wait_clean(cluster, timeout_s=LEASE_S + 15)
        return states, time.monotonic() - ended

    states, clean_after_s = asyncio.run(main())
    assert not wrong, wrong[:3]
    assert sum(outcomes.values()) == NUM_REQUESTS
    assert all(outcomes.get(kind, 0) > 0 for kind in CANCEL_KINDS), outcomes  # aborted
    assert all(map(is_clean, states)), summary(states)
    # within the lease time (a lease whose Release overtook its Prefill expires), plus
    # the audit's 0.5 s period and this loop's polling
    assert clean_after_s <= LEASE_S + 2.0, clean_after_s


def test_past_the_caps_requests_get_503_at_once_and_below_none_is_lost(cluster):
    """A router with small caps on the same workers: 24 concurrent streams, of which at
    most ``max_waiting_requests`` may wait for a first token. The refused ones get 503
    with ``Retry-After`` fast; every admitted one completes exactly."""
    caps = ModelService(RouterConfig(cluster.model, cluster.redis.url, max_model_len=MAX_MODEL_LEN,
                               max_waiting_requests=4, prefill_max_inflight=2,
                               decode_max_inflight=6, disaggregation="always",
                               auth=TEST_AUTH))
    port = free_port()
    server, task = cluster.call(serve_http(caps, port))
    params = GREEDY[1]
    expected = cluster.expected_text(SENTENCES[0], params)
    body = {"prompt": SENTENCES[0], "max_tokens": params.max_tokens, "temperature": 0,
            "ignore_eos": True}

    async def one(http):
        started = time.monotonic()
        reply = await http.post("/v1/completions", json=body)
        return reply, time.monotonic() - started

    async def main():
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
            for _ in range(100):  # until the new router sees the workers
                if (await http.get("/ready")).status_code == 200:
                    break
                await asyncio.sleep(0.1)
            burst = await asyncio.gather(*(one(http) for _ in range(24)))
            below = await asyncio.gather(*(one(http) for _ in range(4)))
            return burst, below

    try:
        burst, below = asyncio.run(main())
    finally:
        server.should_exit = True
        cluster.call(asyncio.wait_for(task, 30))
    refused = [(r, t) for r, t in burst if r.status_code == 503]
    served = [r for r, _ in burst if r.status_code == 200]
    assert len(refused) + len(served) == len(burst), [r.status_code for r, _ in burst]
    assert refused and len(served) >= 4
    for reply, seconds in refused:
        assert reply.headers["retry-after"] == "1"
        assert reply.json()["error"]["code"] == 503 and seconds < 2.0
    assert all(r.json()["choices"][0]["text"] == expected for r in served)
    assert [r.status_code for r, _ in below] == [200] * 4
    metrics = httpx.get(cluster.url + "/metrics").text  # the shared router refused nothing
    rejected = re.findall(r"pdserve:requests_rejected_total\{[^}]*\} (\S+)", metrics)
    assert len(rejected) == 3 and all(float(n) == 0 for n in rejected)  # every cap at 0


def decode_routing(router: ModelService) -> dict[str, float]:
    """``pdserve:routing_decisions`` of the decode pool, by worker."""
    return {sample.labels["worker"]: sample.value
            for metric in router.metrics.registry.collect()
            if metric.name == "pdserve:routing_decisions" for sample in metric.samples
            if sample.name.endswith("_total") and sample.labels["role"] == "decode"}


def test_a_chats_turns_go_to_the_decode_worker_holding_its_history(cluster):
    """With two decode workers, each turn of a chat goes to the one that decoded the
    previous turn: it holds the history's KV, the reply's included (KV-aware routing)."""
    messages = [{"role": "user", "content": " ".join(SENTENCES[:4])}]
    chosen = []
    with httpx.Client(base_url=cluster.url, timeout=120) as http:
        for turn in range(3):
            before = decode_routing(cluster.router)
            reply = http.post("/v1/chat/completions", json={
                "model": cluster.model, "messages": messages, "max_tokens": 24,
                "temperature": 0})
            assert reply.status_code == 200, reply.text
            after = decode_routing(cluster.router)
            (worker,) = [w for w, n in after.items() if n > before.get(w, 0)]
            chosen.append(worker)
            messages += [{"role": "assistant",
                          "content": reply.json()["choices"][0]["message"]["content"]},
                         {"role": "user", "content": f"{SENTENCES[5]} ({turn})"}]
            time.sleep(0.3)  # the decode worker publishes its new blocks (50 ms batches)
    assert chosen == [chosen[0]] * 3, chosen


def streams(cluster: Cluster, num_streams: int, max_tokens: int
            ) -> tuple[list[list[int]], list[SamplingParams]]:
    """``run_streams_and_kill``'s prompts and sampling parameters."""
    prompts = [encode_prompt(cluster.tokenizer, SENTENCES[i % 5] + f" number {i}")
               for i in range(num_streams)]
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
              if i % 2 == 0 else SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i,
                                                max_tokens=max_tokens, ignore_eos=True)
              for i in range(num_streams)]
    return prompts, params


def run_streams_and_kill(cluster: Cluster, role: str, num_streams: int, max_tokens: int
                         ) -> tuple[list, list]:
    """Start ``num_streams`` gRPC streams (half greedy, half seeded) on prompts long
    enough to be disaggregated; kill -9 the first ``role`` worker seen holding requests.
    Returns (results, expected)."""
    prompts, params = streams(cluster, num_streams, max_tokens)
    candidates = [info for info in cluster.launcher.infos() if info.role == role]
    stub_cls = prefill_pb2_grpc.PrefillWorkerStub if role == "prefill" else \
        decode_pb2_grpc.DecodeWorkerStub

    async def busy_worker(stubs) -> int | None:
        for i, stub in enumerate(stubs):
            state = await stub.Health(common_pb2.HealthRequest(), timeout=5)
            if state.num_running + state.num_waiting + state.num_kv_leases > 0:
                return i
        return None

    async def main():
        channels = [worker_channel(info.grpc_address) for info in candidates]
        try:
            async with grpc.aio.insecure_channel(cluster.grpc_address) as channel:
                stub = router_pb2_grpc.RouterStub(channel)
                stubs = [stub_cls(c) for c in channels]
                tasks = [asyncio.ensure_future(grpc_generate(stub, f"{role}-kill-{i}", prompt, p))
                         for i, (prompt, p) in enumerate(zip(prompts, params))]
                for _ in range(400):  # until a worker of the role holds requests
                    victim = await busy_worker(stubs)
                    if victim is not None:
                        break
                    await asyncio.sleep(0.01)
                else:
                    raise AssertionError(f"no {role} worker ever held a request")
                os.kill(candidates[victim].pid, signal.SIGKILL)
                return await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            for c in channels:
                await c.close()

    results = asyncio.run(main())
    expected = [(cluster.expected_tokens(prompt, p), "length", None)
                for prompt, p in zip(prompts, params)]
    return results, expected


def test_kill_a_prefill_worker_under_load(cluster):
    results, expected = run_streams_and_kill(cluster, "prefill", 20, 12)
    assert results == expected
    wait_pool(cluster, 2, 2)  # Ray restarted it


def test_redis_outage_under_load_and_prefix_routing_after(cluster):
    """Redis stops for ``REDIS_OUTAGE_S`` seconds while clients keep sending short and
    disaggregated requests; then it comes back empty, the workers register and publish
    again, and a shared prefix is routed to the worker that holds it."""
    short, disaggregated = SENTENCES[6], SENTENCES[7]  # 2-3 tokens; over 16 tokens
    assert len(encode_prompt(cluster.tokenizer, short)) < 16
    assert len(encode_prompt(cluster.tokenizer, disaggregated)) >= 16
    params = GREEDY[0]
    expected = {p: cluster.expected_text(p, params) for p in (short, disaggregated)}
    results = {short: [0, 0], disaggregated: [0, 0]}  # ok, failed

    async def client(http, prompt, until):
        while time.monotonic() < until:
            reply = await http.post("/v1/completions", json={
                "prompt": prompt, "max_tokens": params.max_tokens, "temperature": 0,
                "ignore_eos": True})
            ok = reply.status_code == 200 and \
                reply.json()["choices"][0]["text"] == expected[prompt]
            results[prompt][0 if ok else 1] += 1
            await asyncio.sleep(0.02)

    async def main():
        async with httpx.AsyncClient(base_url=cluster.url, timeout=60) as http:
            until = time.monotonic() + REDIS_OUTAGE_S + 2
            clients = [asyncio.ensure_future(client(http, p, until))
                       for p in (short, disaggregated) * 2]
            await asyncio.sleep(1.0)
            await asyncio.to_thread(cluster.redis.stop)
            await asyncio.sleep(2.0)  # the router's next registry refresh (every 1 s)
            down_health = (await http.get("/health")).json()
            await asyncio.sleep(REDIS_OUTAGE_S - 2.0)
            await asyncio.to_thread(cluster.redis.start)
            await asyncio.gather(*clients)
            return down_health

    down_health = asyncio.run(main())
    for ok, failed in results.values():
        assert ok >= 5 and failed <= 0.01 * (ok + failed), results
    assert down_health["status"] == "degraded" and down_health["registry"] == "unreachable"
    metrics = httpx.get(cluster.url + "/metrics").text
    assert re.search(r"pdserve:registry_outages_total\{[^}]*\} [1-9]", metrics), metrics

    # Redis is back (empty): the workers register again and republish; the router's
    # prefix lookups find blocks again.
    wait_pool(cluster, 2, 2)
    prefix = " ".join(SENTENCES[:3])
    body = {"max_tokens": 2, "temperature": 0}
    deadline = time.monotonic() + 30
    while True:
        first = httpx.post(cluster.url + "/v1/completions",
                           json={**body, "prompt": prefix + " one"}, timeout=60)
        assert first.status_code == 200
        time.sleep(0.5)  # the prefill worker publishes its blocks' hashes
        second = httpx.post(cluster.url + "/v1/completions",
                            json={**body, "prompt": prefix + " two"}, timeout=60)
        cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        health = httpx.get(cluster.url + "/health").json()
        if (cached > 0 and health["status"] == "ok") or time.monotonic() > deadline:
            break
    assert cached >= 32 and health["status"] == "ok", (cached, health)
    metrics = httpx.get(cluster.url + "/metrics").text
    assert re.search(r'pdserve:prefix_index_lookups_total\{[^}]*result="hit"\} [1-9]', metrics)
    assert re.search(r"pdserve:registry_available\{[^}]*\} 1\.0", metrics)


# NOTE: the workers (and the router's log) see a gRPC client's request id with a random
# suffix of 16 hex digits (router/grpc_server.py)
MIGRATION_LOG = re.compile(r"migration of (\S+)-[0-9a-f]{16} after (\d+) tokens")


def test_kill_a_decode_worker_mid_stream(cluster, caplog):
    """40 concurrent streams; one of the two decode workers is killed -9 once busy. All
    40 complete with exactly ``max_tokens`` tokens through migrations, each equal to an
    undisturbed run (per-position seeds) or, for a request migrated after k tokens, to
    what the engine samples after recomputing those k in one prefill: a recomputed KV
    cache rounds differently from the decode steps that first made it (~5e-7 in a
    logprob), so a seeded draw that falls that close to the boundary between two tokens
    can go the other way (2 of 160 resumptions in the offline engine on this model)."""
    before = cluster.router.metrics.request_migrations._value.get()
    caplog.set_level("WARNING", logger="pdserve.router.model_service")
    results, expected = run_streams_and_kill(cluster, "decode", 40, 48)
    # request id -> tokens it had when it last moved
    migrated = {m[1]: int(m[2]) for r in caplog.records
                if (m := MIGRATION_LOG.match(r.getMessage()))}
    assert 0 < len(migrated) <= cluster.router.metrics.request_migrations._value.get() - before
    prompts, params = streams(cluster, 40, 48)
    for i, (result, want) in enumerate(zip(results, expected)):
        if result == want:
            continue
        k = migrated.get(f"decode-kill-{i}")
        assert k is not None, (i, result, want)  # not migrated: nothing may differ
        assert result == (cluster.resumed_tokens(prompts[i], params[i], want[0][:k]),
                          "length"), (i, k, result, want)
    wait_pool(cluster, 2, 2)
    states = asyncio.run(wait_clean(cluster, timeout_s=LEASE_S + 15))
    assert all(map(is_clean, states)), summary(states)
