"""Two router replicas serve one cluster (issue 31, docs/architecture.md "Router
replicas"): one prefill and one decode worker in this process on the demo model, a real
Redis, and two routers, each behind its own real HTTP port, as N ``pdserve router``
processes behind a Kubernetes Service (or under SLURM) are. The replicas share the Redis
registry and prefix index and never talk to each other: each admits on its own counts plus
the workers' Health.

- concurrent requests split across both replicas all complete, each equal to the offline
  engine's greedy output (and so to what one router gives);
- under a sustained load past the caps, no worker is overloaded by the two not knowing
  each other's admissions beyond one health interval: the decode worker's running +
  waiting never exceeds ``--decode-max-inflight`` plus what the other replica admitted
  within one health interval (plus one request on its way).

Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

import httpx
import openai
import pytest
from inproc_cluster import in_process_cluster, uvicorn_server

from pdserve.router.config import RouterConfig
from pdserve.router.http import build_app
from pdserve.router.model_service import ModelService

MAX_MODEL_LEN = 256
CAP = 4  # --decode-max-inflight of each replica
HEALTH_INTERVAL_S = 0.1  # --health-check-interval-s of each replica
# how long a replica may go without seeing the other's admissions in the decode worker's
# Health: one poll period (interval + the Health call), with room for a busy event loop
HEALTH_WINDOW_S = 4 * HEALTH_INTERVAL_S + 0.3
LONG_TOKENS = 64  # the shortest request outlasts several health intervals
ROUTER = {"decode_max_inflight": CAP, "health_interval_s": HEALTH_INTERVAL_S,
          "max_waiting_requests": 64}
SHORT = ["Hello there", "Short question", "Tell me a story", "Ships at sea",
         "A grey lighthouse", "Night storm"]  # under one block: prefilled on the decode worker
LONG = [("The KV cache of a long prompt is computed once by the prefill worker and then "
         "moved to the decode worker, which pulls only the blocks it lacks"),
        ("Paged attention reads keys and values through a block table, one block at a time, "
         "so a sequence's cache need not be contiguous in memory at all")]


@dataclass
class Replicas:
    cluster: object  # inproc_cluster.Cluster: the first replica, the workers, the oracle
    urls: list[str]
    routers: list[ModelService]
    tokens: dict = field(default_factory=dict)


def wait_ready(url: str, timeout_s: float = 60.0) -> None:
    """Until the router at ``url`` sees a live decode and prefill worker (``/health``)."""
    deadline = time.monotonic() + timeout_s
    state = None
    while time.monotonic() < deadline:
        state = httpx.get(url + "/health", timeout=5).json()
        if state["status"] == "ok" and state["num_prefill_workers"] >= 1:
            return
        time.sleep(0.05)
    raise AssertionError(f"router {url} never saw the workers: {state}")


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    folder = tmp_path_factory.mktemp("replicas")
    with in_process_cluster(folder, MAX_MODEL_LEN, **ROUTER) as cluster:
        second = ModelService(RouterConfig(str(cluster.model), cluster.redis_url,
                                           max_model_len=MAX_MODEL_LEN, **ROUTER))
        server = uvicorn_server(build_app(second), 0)
        serving = asyncio.run_coroutine_threadsafe(server.serve(), cluster.loop)
        deadline = time.monotonic() + 60
        while not server.started:
            assert time.monotonic() < deadline and not serving.done(), "uvicorn did not start"
            time.sleep(0.02)
        port = server.servers[0].sockets[0].getsockname()[1]
        urls = [cluster.url, f"http://127.0.0.1:{port}"]
        try:
            for url in urls:
                wait_ready(url)
            yield Replicas(cluster, urls, [cluster.router, second])
        finally:
            server.should_exit = True
            serving.result(30)


def routed(url: str, role: str) -> float:
    """``pdserve:routing_decisions_total`` of ``role`` on the router at ``url``."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("pdserve:routing_decisions_total{") and f'role="{role}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_concurrent_requests_split_across_both_replicas_are_exact(replicas):
    before = [routed(url, "decode") for url in replicas.urls]
    prompts = [(i, (SHORT + LONG)[i % (len(SHORT) + len(LONG))]) for i in range(12)]

    async def one(i: int, prompt: str) -> str:
        client = openai.AsyncOpenAI(base_url=replicas.urls[i % 2] + "/v1", api_key="none",
                                    max_retries=0)
        async with client:
            for _ in range(400):  # past the caps: 503, retried as a client would
                try:
                    reply = await client.completions.create(
                        model=str(replicas.cluster.model), prompt=prompt, max_tokens=12,
                        temperature=0.0)
                    return reply.choices[0].text
                except openai.APIStatusError as exc:
                    assert exc.status_code == 503, exc
                    await asyncio.sleep(0.05)
        raise AssertionError(f"request {i} refused 400 times")

    async def main():
        return await asyncio.wait_for(
            asyncio.gather(*(one(i, prompt) for i, prompt in prompts)), 180)

    texts = asyncio.run(main())
    for (_, prompt), text in zip(prompts, texts):
        assert text == replicas.cluster.expected(prompt, max_tokens=12, temperature=0.0)
    after = [routed(url, "decode") for url in replicas.urls]
    assert all(a - b >= 6 for a, b in zip(after, before)), (before, after)


@dataclass
class Admission:
    replica: int
    sent: float  # monotonic seconds: the request left the client
    first: float  # its first chunk arrived (it was admitted in between)
    end: float  # its last chunk arrived (the worker had finished it)


def sample_decode_load(cluster, stop: threading.Event, samples: list) -> None:
    """Append (monotonic time, running + waiting) of the decode worker every 5 ms."""
    while not stop.is_set():
        state = cluster.decode.runtime.health()
        samples.append((time.monotonic(), state.num_running + state.num_waiting))
        time.sleep(0.005)


async def keep_busy(url: str, replica: int, model: str, prompt: str, max_tokens: int,
                    done: list, admissions: list[Admission], target: int) -> None:
    """Send ``prompt`` for ``max_tokens`` to ``url`` again and again (a 503 is retried
    after 50 ms) until ``target`` requests are done in all; each admitted request is
    recorded."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    async with client:
        while len(done) < target:
            sent = time.monotonic()
            try:
                stream = await client.completions.create(
                    model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                    stream=True, extra_body={"ignore_eos": True})
                first, text = None, ""
                async for chunk in stream:
                    first = first or time.monotonic()
                    text += chunk.choices[0].text if chunk.choices else ""
            except openai.APIStatusError as exc:
                assert exc.status_code == 503, exc
                await asyncio.sleep(0.05)
                continue
            end = time.monotonic()
            admissions.append(Admission(replica, sent, first or end, end))
            done.append((prompt, max_tokens, text))


def load_bound(admissions: list[Admission], t: float) -> int:
    """The most the decode worker may run + queue at ``t`` under the replicas' contract:
    ``CAP``, plus what one replica admitted, unseen by the other, within one health window
    before the latest admission of those still running (each admission lies between its
    request's send and first chunk), plus one request on its way."""
    active = [a for a in admissions if a.sent <= t <= a.end]
    if not active:
        return CAP
    latest = max(a.first for a in active)
    return CAP + 1 + max(sum(a.replica == r and a.first >= latest - HEALTH_WINDOW_S
                             for a in active) for r in (0, 1))


def test_two_replicas_overload_no_worker_past_one_health_interval(replicas):
    cluster = replicas.cluster
    done, admissions, samples = [], [], []
    stop = threading.Event()
    sampler = threading.Thread(target=sample_decode_load, args=(cluster, stop, samples),
                               daemon=True)
    sampler.start()

    async def main():
        # 3x what both caps together admit; lengths differ, so they end at different steps
        clients = [keep_busy(replicas.urls[i % 2], i % 2, str(cluster.model),
                             SHORT[i % len(SHORT)], LONG_TOKENS + 12 * i, done, admissions,
                             24)
                   for i in range(3 * CAP)]
        await asyncio.wait_for(asyncio.gather(*clients), 240)

    try:
        asyncio.run(main())
    finally:
        stop.set()
        sampler.join(10)
    expected = {}
    for prompt, max_tokens, text in done:
        if (prompt, max_tokens) not in expected:
            expected[prompt, max_tokens] = cluster.expected(
                prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        assert text == expected[prompt, max_tokens]
    assert {a.replica for a in admissions} == {0, 1}
    peak = max(load for _, load in samples)
    over = [(round(t - samples[0][0], 3), load, load_bound(admissions, t))
            for t, load in samples if load > load_bound(admissions, t)]
    assert not over, f"decode worker past cap + one health interval's admissions: {over[:20]}"
    assert peak >= CAP, f"the load never reached the cap ({peak}): the test shows nothing"
    cluster.wait_all_blocks_free()
