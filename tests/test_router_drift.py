"""Index drift (issue 31): restarting a router, restarting Redis (empty) and killing a
worker (``kill -9``) leave no stale route after one heartbeat interval.

One cluster for the module, all real: a Redis server, two plain-process decode workers
(``python -m pdserve.decode_worker``, which prefill too) and a router in this process
behind a real HTTP port, restarted by the tests. Which worker caches a prompt's prefix is
read from the router's ``pdserve:routing_decisions`` (the decode worker each request was
sent to): a prompt's second request goes where its first left its KV (KV-aware routing,
docs/architecture.md "A request's path"). Greedy outputs are compared with the first
answer of the same prompt. The tests run in file order; the last one kills a worker.
Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest
from disagg_client import TEST_AUTH, start_worker_process
from inproc_cluster import uvicorn_server

from pdserve.cluster.worker_config import WorkerConfig
from pdserve.engine.demo_model import make_demo_model
from pdserve.entrypoints.redis_server import RedisServer
from pdserve.router.config import RouterConfig
from pdserve.router.http import build_app
from pdserve.router.model_service import ModelService

MAX_MODEL_LEN = 256
REGISTRY_INTERVAL_S = 1.0  # RouterConfig.registry_interval_s
# one heartbeat interval: a dead worker's heartbeat lapses (its TTL), the router reads the
# registry again, and its next Health poll has run; with room for a busy 2-core machine
HEARTBEAT_TTL_S = next(f.default for f in dataclasses.fields(WorkerConfig)
                       if f.name == "heartbeat_ttl_s")
HEARTBEAT_S = HEARTBEAT_TTL_S + REGISTRY_INTERVAL_S + 1.0
PARAMS = {"max_tokens": 8, "temperature": 0.0}


def prompt(topic: str) -> str:
    """A prompt of several KV blocks that no other test sends."""
    return (f"This is a long conversation about {topic}. " * 6
            + "Summarise it in one sentence, please.")


@dataclass
class Drift:
    model: str
    redis: RedisServer
    workers: dict[str, object]  # worker id -> its process
    loop: asyncio.AbstractEventLoop
    url: str = ""
    server: object = None
    serving: object = None
    answers: dict[str, str] = field(default_factory=dict)

    def start_router(self) -> None:
        """Start a new router (a new ``ModelService`` and HTTP port) and wait until it
        sees both decode workers live."""
        router = ModelService(RouterConfig(self.model, self.redis.url,
                                           max_model_len=MAX_MODEL_LEN, auth=TEST_AUTH,
                                           registry_interval_s=REGISTRY_INTERVAL_S))
        self.server = uvicorn_server(build_app(router), 0)
        self.serving = asyncio.run_coroutine_threadsafe(self.server.serve(), self.loop)
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < deadline and not self.serving.done(), "no uvicorn"
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.wait_workers(len(self.workers), 60)

    def stop_router(self) -> None:
        self.server.should_exit = True
        self.serving.result(30)

    def wait_workers(self, num_decode: int, timeout_s: float) -> None:
        """Until the router's ``/health`` shows ``num_decode`` decode workers and Redis
        reachable (its status is ``degraded``: the cluster has no prefill pool)."""
        deadline = time.monotonic() + timeout_s
        state = None
        while time.monotonic() < deadline:
            state = httpx.get(self.url + "/health", timeout=5).json()
            if (state["registry"], state["prefix_index"], state["num_decode_workers"]) == \
                    ("ok", "ok", num_decode):
                return
            time.sleep(0.05)
        raise AssertionError(f"router never saw {num_decode} decode workers: {state}")

    def routed(self) -> dict[str, float]:
        """``pdserve:routing_decisions_total`` of the decode role, by worker id."""
        counts: dict[str, float] = {}
        for line in httpx.get(self.url + "/metrics", timeout=5).text.splitlines():
            if line.startswith("pdserve:routing_decisions_total{") and 'role="decode"' in line:
                worker = line.split('worker="', 1)[1].split('"', 1)[0]
                counts[worker] = counts.get(worker, 0.0) + float(line.rsplit(" ", 1)[1])
        return counts

    def complete(self, text: str) -> tuple[str, str]:
        """Send ``text`` (greedy) through HTTP; (its answer, the decode worker it went
        to). The answer must equal the first one this prompt got."""
        before = self.routed()
        reply = httpx.post(self.url + "/v1/completions", timeout=120, json={
            "model": self.model, "prompt": text, **PARAMS})
        assert reply.status_code == 200, reply.text
        answer = reply.json()["choices"][0]["text"]
        assert self.answers.setdefault(text, answer) == answer
        after = self.routed()
        (worker,) = [w for w in after if after[w] > before.get(w, 0.0)]
        return answer, worker

    def cache(self, text: str) -> str:
        """Send ``text`` once, fresh; the worker that now caches its prefix."""
        _, holder = self.complete(text)
        time.sleep(0.5)  # the worker's KV events reach the index
        return holder

    def cache_on_each(self, topic: str) -> list[tuple[str, str]]:
        """A prompt cached on each worker: [(holder, prompt)], the holders in decreasing
        id order, so that routing by load alone (ties in id order, taking turns) would
        send at least one of them elsewhere."""
        held: dict[str, str] = {}
        for i in range(8):
            text = prompt(f"{topic}, part {i}")
            held.setdefault(self.cache(text), text)
            if len(held) == len(self.workers):
                return sorted(held.items(), reverse=True)
        raise AssertionError(f"8 fresh prompts all went to {sorted(held)}")


@pytest.fixture(scope="module")
def drift(tmp_path_factory):
    folder = tmp_path_factory.mktemp("drift")
    model = str(make_demo_model(folder / "demo"))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    procs = []
    with RedisServer() as redis:
        try:
            workers = {}
            for name in ("a", "b"):
                proc, info = start_worker_process("decode", [
                    "--model", model, "--dtype", "float32",
                    "--max-model-len", str(MAX_MODEL_LEN), "--num-gpu-blocks-override", "128",
                    "--redis-url", redis.url, "--num-threads", "1", "--log-level", "WARNING"],
                    folder / f"{name}.json", timeout_s=240)
                procs.append(proc)
                workers[info["worker_id"]] = proc
            cluster = Drift(model, redis, workers, loop)
            cluster.start_router()
            try:
                yield cluster
            finally:
                cluster.stop_router()
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                proc.wait(timeout=30)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)


def test_a_restarted_router_routes_a_cached_prefix_back_to_its_holder(drift):
    held = drift.cache_on_each("router restarts")
    for holder, text in held:  # KV-aware routing, before the restart
        assert drift.complete(text)[1] == holder
    drift.stop_router()
    drift.start_router()
    time.sleep(HEARTBEAT_S)
    for holder, text in held:
        assert drift.complete(text)[1] == holder


def test_redis_restarted_empty_leaves_no_stale_route(drift):
    held = drift.cache_on_each("an empty Redis")
    drift.redis.restart()
    # the workers register again and republish what they cache; the router reads both
    time.sleep(HEARTBEAT_S)
    drift.wait_workers(len(drift.workers), HEARTBEAT_S)
    for holder, text in held:
        assert drift.complete(text)[1] == holder
    fresh = prompt("what came after the restart")
    assert drift.complete(fresh)[1] in drift.workers


def test_a_killed_worker_gets_no_route_after_one_heartbeat(drift):
    text = prompt("a worker killed")
    holder = drift.cache(text)
    os.kill(drift.workers[holder].pid, signal.SIGKILL)
    drift.workers[holder].wait(timeout=30)
    time.sleep(HEARTBEAT_S)
    (survivor,) = [w for w in drift.workers if w != holder]
    for _ in range(3):  # the prefix the dead worker cached, and a fresh prompt
        assert drift.complete(text)[1] == survivor
    assert drift.complete(prompt("the survivor"))[1] == survivor
