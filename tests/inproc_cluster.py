"""One prefill and one decode worker in this process on the demo model, a real Redis, and
a router behind a real uvicorn port; ``pdserve.engine.LLM`` on the same checkpoint is the
oracle. Shared by the router's end-to-end tests (one cluster per module)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai

from pdserve.cluster import event_loop
from pdserve.cluster.auth import ClusterAuth
from pdserve.cluster.worker_config import WorkerConfig
from pdserve.decode_worker.server import DecodeWorker
from pdserve.engine import LLM, EngineConfig, SamplingParams
from pdserve.engine.demo_model import make_demo_model
from pdserve.entrypoints.redis_server import RedisServer, free_port
from pdserve.prefill_worker.server import PrefillWorker
from pdserve.router.config import HTTPLimits, RouterConfig
from pdserve.router.http import build_app
from pdserve.router.http_server import uvicorn_config
from pdserve.router.model_service import ModelService


@dataclass
class Cluster:
    model: Path
    url: str
    redis_url: str
    prefill: PrefillWorker
    decode: DecodeWorker
    router: ModelService
    oracle: LLM
    app: Any = None  # the router's FastAPI app
    loop: asyncio.AbstractEventLoop | None = None  # where the workers, router and app run

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)

    def expected(self, prompt, **params) -> str:
        sp = SamplingParams(**params)
        if isinstance(prompt, list) and isinstance(prompt[0], dict):
            return self.oracle.chat(prompt, sp)[0].outputs[0].text
        return self.oracle.generate([prompt], sp)[0].outputs[0].text

    def prefill_paths(self) -> dict[str, float]:
        """``pdserve:prefill_path`` by path (``remote``, ``local``)."""
        counts: dict[str, float] = {}
        for metric in self.router.metrics.registry.collect():
            if metric.name == "pdserve:prefill_path":
                for sample in metric.samples:
                    if sample.name.endswith("_total"):
                        path = sample.labels["path"]
                        counts[path] = counts.get(path, 0) + sample.value
        return counts

    def wait_all_blocks_free(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            states = [w.runtime.health() for w in (self.prefill, self.decode)]
            if all(s.num_free_blocks == s.num_total_blocks for s in states):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"blocks still in use: {states}")
            time.sleep(0.05)


@contextlib.contextmanager
def in_process_cluster(folder: Path, max_model_len: int, *, model: Path | None = None,
                       oracle: LLM | None = None, num_gpu_blocks: int = 64,
                       http_timeouts: HTTPLimits | None = None,
                       prefill_engine: dict | None = None, decode_engine: dict | None = None,
                       auth: ClusterAuth | None = None, **router_kwargs) -> Iterator[Cluster]:
    """The cluster on ``model`` (default: the demo model, written under ``folder``), each
    worker with ``num_gpu_blocks`` KV blocks; ``oracle`` (default: a new ``LLM``) is the
    offline engine to compare with; ``http_timeouts`` go to ``build_app``;
    ``prefill_engine`` / ``decode_engine``: ``EngineConfig`` fields that differ in that
    worker (e.g. ``kv_cache_dtype``); ``auth``: the cluster's secret (default: none,
    no authentication anywhere); ``router_kwargs`` go to ``RouterConfig``."""
    model = model or make_demo_model(folder / "demo")
    engine = EngineConfig(str(model), dtype="float32", max_model_len=max_model_len,
                          load_progress=False, num_gpu_blocks_override=num_gpu_blocks,
                          num_threads=1)
    loop = event_loop.new_event_loop()  # NOTE: the router's and workers' own loop
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def call(coro, timeout_s: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout_s)

    with RedisServer() as redis:
        prefill = PrefillWorker(WorkerConfig(
            "prefill", dataclasses.replace(engine, **(prefill_engine or {})),
            redis_url=redis.url, kv_transfer_timeout_s=10.0, auth=auth))
        decode = DecodeWorker(WorkerConfig(
            "decode", dataclasses.replace(engine, **(decode_engine or {})),
            redis_url=redis.url, kv_transfer_timeout_s=10.0, auth=auth))
        call(prefill.start())
        call(decode.start())
        router = ModelService(RouterConfig(str(model), redis.url, max_model_len=max_model_len,
                                     auth=auth, **router_kwargs))
        port = free_port()
        app = build_app(router, http_timeouts=http_timeouts)
        server = uvicorn_server(app, port)
        serving = asyncio.run_coroutine_threadsafe(server.serve(), loop)
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and not serving.done(), "uvicorn did not start"
            time.sleep(0.02)
        oracle = oracle or LLM(str(model), dtype="float32", max_model_len=max_model_len,
                               load_progress=False)
        try:
            yield Cluster(model, f"http://127.0.0.1:{port}", redis.url, prefill, decode,
                          router, oracle, app, loop)
        finally:
            server.should_exit = True
            serving.result(30)
            call(prefill.stop())
            call(decode.stop())
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)


def uvicorn_server(app, port: int, log_level: str = "warning"):
    """A uvicorn server for ``app`` (from ``build_app``) on 127.0.0.1:``port`` (0: any),
    configured as the router serves it (its request deadlines), not started."""
    import uvicorn

    return uvicorn.Server(uvicorn_config(app, host="127.0.0.1", port=port,
                                         log_level=log_level))
