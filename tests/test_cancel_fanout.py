"""Cancelled fan-outs free everything at once (issue 29, part 4; docs/architecture.md,
"Lifecycle and failure").

A real disaggregated cluster: Redis, one prefill and one decode worker as plain processes
(KV over a gloo pair channel), the router in this process behind a real HTTP port.
Twelve streaming completions with ``n=8`` are read up to their first chunk and then
closed, as clients that leave: 96 sequences, most of them in their Prefill or pulling
their KV when the connection closes. Within 2 s every worker has all its blocks free,
no KV lease and no request waiting for KV; no clean-up RPC the router sent failed.
Then a decode worker stopped (SIGSTOP) as a client leaves: the router's Abort times out
and is retried, counted and logged, and the worker frees the request by itself.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import threading
import time

import httpx
import pytest
from conftest import random_prompts
from disagg_client import TEST_AUTH, decode_stub, health, prefill_stub, start_worker_process
from inproc_cluster import uvicorn_server

from pdserve.cluster import event_loop
from pdserve.engine.demo_model import make_demo_model
from pdserve.engine.sampling_params import SamplingParams
from pdserve.entrypoints.redis_server import RedisServer
from pdserve.router.config import RouterConfig
from pdserve.router.generate_request import GenerateRequest
from pdserve.router.http import build_app
from pdserve.router.model_service import ModelService

MAX_MODEL_LEN = 512
NUM_STREAMS = 12
N = 8
PROMPT_LEN = 200  # 13 blocks of 16: each sequence holds ~13 blocks on each side
FREE_WITHIN_S = 2.0
TRANSFER_TIMEOUT_S = 30.0  # the default: a pull left to time out shows as ~30 s


def worker_args(model, redis_url: str) -> list[str]:
    return ["--model", str(model), "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
            "--num-gpu-blocks-override", "2048", "--redis-url", redis_url,
            "--num-threads", "1", "--kv-transfer-timeout-s", str(TRANSFER_TIMEOUT_S),
            "--kv-lease-s", "30", "--log-level", "WARNING"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """(router, HTTP url, prefill address, decode address, the router's event loop,
    decode worker process, Redis URL, model)."""
    folder = tmp_path_factory.mktemp("fanout")
    model = make_demo_model(folder / "demo")
    procs = []
    loop = event_loop.new_event_loop()  # NOTE: the router's and workers' own loop
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    with RedisServer() as redis:
        try:
            for role in ("prefill", "decode"):
                procs.append(start_worker_process(role, worker_args(model, redis.url),
                                                  folder / f"{role}.json"))
            router = ModelService(RouterConfig(str(model), redis.url, max_model_len=MAX_MODEL_LEN,
                                         disaggregation="always", registry_interval_s=0.2,
                                         health_interval_s=0.2, auth=TEST_AUTH))
            server = uvicorn_server(build_app(router), 0)
            serving = asyncio.run_coroutine_threadsafe(server.serve(), loop)
            deadline = time.monotonic() + 60
            while not (server.started and len(router.pool.live("prefill")) == 1
                       and len(router.pool.live("decode")) == 1):
                assert time.monotonic() < deadline and not serving.done(), \
                    "the router did not start or never saw both workers"
                time.sleep(0.05)
            port = server.servers[0].sockets[0].getsockname()[1]
            (_, prefill), (_, decode) = procs
            try:
                yield (router, f"http://127.0.0.1:{port}", prefill["grpc_address"],
                       decode["grpc_address"], loop, procs[1][0], redis.url, model)
            finally:
                server.should_exit = True
                serving.result(30)
        finally:
            for proc, _ in procs:
                proc.terminate()
            for proc, _ in procs:
                try:
                    proc.wait(30)
                except Exception:  # noqa: BLE001 - killed below
                    proc.kill()
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)


def is_clean(state) -> bool:
    return (state.num_free_blocks == state.num_total_blocks and state.num_kv_leases == 0
            and state.num_requests_waiting_for_kv == 0 and state.num_running == 0
            and state.num_waiting == 0 and state.num_unowned_blocks == 0)


def summary(state) -> dict:
    return {"worker": state.role, "free": state.num_free_blocks,
            "total": state.num_total_blocks, "leases": state.num_kv_leases,
            "waiting_for_kv": state.num_requests_waiting_for_kv,
            "running": state.num_running, "waiting": state.num_waiting,
            "unowned": state.num_unowned_blocks}


async def first_chunk_then_leave(http: httpx.AsyncClient, prompt: list[int]) -> bool:
    """Stream ``n=8`` completions of ``prompt``; close the connection at the first chunk.
    True if a chunk came."""
    body = {"prompt": prompt, "n": N, "max_tokens": 200, "temperature": 0.8,
            "ignore_eos": True, "stream": True}
    async with http.stream("POST", "/v1/completions", json=body) as reply:
        assert reply.status_code == 200, await reply.aread()
        async for line in reply.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                assert "error" not in json.loads(line[6:]), line
                return True  # leaving the block closes the connection mid-stream
    return False


def cleanup_counts(router: ModelService) -> dict[str, float]:
    """``pdserve:cleanup_rpc_retries`` and ``pdserve:cleanup_rpc_failures`` by
    ``"<metric>/<method>"``."""
    counts = {}
    for metric in router.metrics.registry.collect():
        if metric.name in ("pdserve:cleanup_rpc_retries", "pdserve:cleanup_rpc_failures"):
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    counts[f"{metric.name}/{sample.labels['method']}"] = sample.value
    return counts


def test_cancelled_fanouts_free_every_block_within_2s(cluster):
    """12 ``n=8`` streams closed at their first chunk: within 2 s both workers hold no
    block, lease or pull, and every clean-up RPC the router sent succeeded at once."""
    router, url, prefill_address, decode_address, loop, *_ = cluster
    before = cleanup_counts(router)
    prompts = random_prompts([PROMPT_LEN] * NUM_STREAMS, seed=29)

    async def main():
        stubs = [prefill_stub(prefill_address), decode_stub(decode_address)]
        async with httpx.AsyncClient(base_url=url, timeout=60,
                                     limits=httpx.Limits(max_connections=32)) as http:
            got = await asyncio.gather(*(first_chunk_then_leave(http, p) for p in prompts))
        left = time.monotonic()
        states, trace = [], []
        while time.monotonic() - left < TRANSFER_TIMEOUT_S + 10:
            states = [await health(stub) for stub in stubs]
            trace.append((round(time.monotonic() - left, 2), [summary(s) for s in states]))
            if all(map(is_clean, states)):
                break
            await asyncio.sleep(0.05)
        return got, time.monotonic() - left, states, trace

    got, clean_after_s, states, trace = asyncio.run(main())
    assert all(got)
    assert all(map(is_clean, states)), [summary(s) for s in states]
    assert clean_after_s <= FREE_WITHIN_S, (clean_after_s, trace[:3], trace[-3:])
    # every clean-up RPC has ended (retries included) once the router is idle
    asyncio.run_coroutine_threadsafe(router.calls.wait_idle(router.calls.cleanup_bound_s),
                                     loop).result(router.calls.cleanup_bound_s + 10)
    assert cleanup_counts(router) == before == {
        f"pdserve:cleanup_rpc_{kind}/{method}": 0.0
        for kind in ("retries", "failures") for method in ("Abort", "Release")}


def test_a_cleanup_rpc_that_times_out_is_retried_counted_and_logged(cluster, caplog):
    """A decode worker that stops answering (SIGSTOP) while a client leaves: the router's
    Abort times out, is logged at WARNING with the request id, counted and retried; once
    the worker answers again a retry succeeds. Stopped past every retry, the Abort is
    given up (counted, logged), and the worker still frees the request by itself (the
    cancelled stream), so no block stays held."""
    _, _, _, decode_address, _, decode_proc, redis_url, model = cluster
    router = ModelService(RouterConfig(str(model), redis_url, max_model_len=MAX_MODEL_LEN,
                                 disaggregation="always", control_timeout_s=1.0,
                                 registry_interval_s=0.2, health_interval_s=0.2,
                                 auth=TEST_AUTH))
    prompt = random_prompts([PROMPT_LEN], seed=290)[0]
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

    async def leave_while_stopped(request_id: str, stopped_s: float) -> None:
        stream = router.generate(GenerateRequest(request_id, prompt, params))
        for _ in range(2):  # the prefill's first token, then one the decode worker sent
            await anext(stream)
        os.kill(decode_proc.pid, signal.SIGSTOP)
        try:
            await stream.aclose()  # the client leaves: Abort goes to the stopped worker
            await asyncio.sleep(stopped_s)
        finally:
            os.kill(decode_proc.pid, signal.SIGCONT)
        await router.calls.wait_idle(router.calls.cleanup_bound_s)

    async def main():
        await router.start()
        try:
            deadline = time.monotonic() + 30
            while not all(w.healthy for role in router.pool.workers.values()
                          for w in role.values()) or len(router.pool.live("decode")) != 1:
                assert time.monotonic() < deadline, "the router never saw the workers"
                await asyncio.sleep(0.1)
            counts = [cleanup_counts(router)]
            await leave_while_stopped("stopped-briefly", 1.5)  # the 2nd or 3rd try answers
            counts.append(cleanup_counts(router))
            await leave_while_stopped("stopped-long", router.calls.cleanup_bound_s + 1.0)
            counts.append(cleanup_counts(router))
            stub = decode_stub(decode_address)
            deadline = time.monotonic() + FREE_WITHIN_S + 5  # the worker just woke up
            while not is_clean(state := await health(stub)):
                assert time.monotonic() < deadline, summary(state)
                await asyncio.sleep(0.1)
            return counts
        finally:
            await router.stop()

    with caplog.at_level(logging.WARNING, logger="pdserve.router.attempt"):
        counts = asyncio.run(main())
    retries, failures = "pdserve:cleanup_rpc_retries/Abort", "pdserve:cleanup_rpc_failures/Abort"
    assert counts[0][retries] == counts[0][failures] == 0
    assert counts[1][retries] >= 1 and counts[1][failures] == 0
    assert counts[2][retries] - counts[1][retries] == 2 and counts[2][failures] == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("Abort of request stopped-briefly" in w and "DEADLINE_EXCEEDED" in w
               for w in warnings), warnings
    assert any("Abort of request stopped-long" in w and "after 3 tries" in w
               for w in warnings), warnings
