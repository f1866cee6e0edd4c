"""The smallest served stack: one decode worker (which prefills too) in this process, a
real Redis, and a router behind real HTTP and gRPC ports. One engine, so a real model's
tests stay fast; the router shares the worker's tokenizer (read once)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
from inproc_cluster import uvicorn_server

from pdserve.cluster import event_loop
from pdserve.cluster.worker_config import WorkerConfig
from pdserve.decode_worker.server import DecodeWorker
from pdserve.engine import EngineConfig
from pdserve.entrypoints.redis_server import RedisServer
from pdserve.router.config import RouterConfig
from pdserve.router.grpc_server import start_grpc_server
from pdserve.router.http import build_app
from pdserve.router.model_service import ModelService


@dataclass
class Served:
    url: str  # http://127.0.0.1:PORT
    grpc_address: str  # 127.0.0.1:PORT
    router: ModelService
    decode: DecodeWorker

    @property
    def engine(self):
        """The decode worker's ``LLMEngine``."""
        return self.decode.runtime.engine.engine

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)


@contextlib.contextmanager
def decode_only_cluster(model: Path | str, max_model_len: int, *, engine: dict | None = None,
                        router: dict | None = None) -> Iterator[Served]:
    """Serve ``model``: ``engine`` are more ``EngineConfig`` fields, ``router`` more
    ``RouterConfig`` fields (the model's path is both's ``model``)."""
    config = EngineConfig(str(model), max_model_len=max_model_len, load_progress=False,
                          **{"dtype": "float32", **(engine or {})})
    loop = event_loop.new_event_loop()  # NOTE: the router's and workers' own loop
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def call(coro, timeout_s: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout_s)

    with RedisServer() as redis:
        decode = DecodeWorker(WorkerConfig("decode", config, redis_url=redis.url))
        call(decode.start())
        the_router = ModelService(RouterConfig(str(model), redis.url, max_model_len=max_model_len,
                                         **(router or {})),
                            tokenizer=decode.runtime.engine.engine.tokenizer)
        grpc_server, grpc_port = call(start_grpc_server(the_router, "127.0.0.1", 0))
        server = uvicorn_server(build_app(the_router), 0)
        serving = asyncio.run_coroutine_threadsafe(server.serve(), loop)
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and not serving.done(), "uvicorn did not start"
            time.sleep(0.02)
        port = server.servers[0].sockets[0].getsockname()[1]
        try:
            yield Served(f"http://127.0.0.1:{port}", f"127.0.0.1:{grpc_port}", the_router,
                         decode)
        finally:
            server.should_exit = True
            serving.result(30)
            call(grpc_server.stop(1))
            call(decode.stop())
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)
