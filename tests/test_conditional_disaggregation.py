"""Conditional disaggregation (``RouterConfig.disaggregation="auto"``) on a real cluster:
Redis, a prefill and a decode worker as plain processes pinned to different CPUs, the
router in this process. Each rule of ``routing.choose_prefill_path`` is met by a real
request, counted in ``pdserve:prefill_path``, and every output equals the offline
engine's, whichever path it took."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from conftest import random_prompts
from disagg_client import TEST_AUTH, start_worker_process

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.demo_model import make_demo_model
from pdserve.entrypoints.redis_server import RedisServer
from pdserve.router.config import RouterConfig
from pdserve.router.generate_request import GenerateRequest
from pdserve.router.model_service import ModelService

MAX_MODEL_LEN = 256
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2,
                                reason="pins the prefill and the decode worker apart")


def worker_args(model, redis_url: str) -> list[str]:
    return ["--model", str(model), "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
            "--num-gpu-blocks-override", "96", "--redis-url", redis_url, "--num-threads", "1",
            "--log-level", "WARNING"]


def path_counts(router: ModelService) -> dict[str, float]:
    """``pdserve:prefill_path`` by reason."""
    counts = {}
    for metric in router.metrics.registry.collect():
        if metric.name == "pdserve:prefill_path":
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    counts[sample.labels["reason"]] = sample.value
    return counts


async def run(router: ModelService, request_id: str, prompt: list[int],
              cached: dict[str, int] | None = None) -> list[int]:
    """The request's tokens; ``cached[request_id]``: the prefix-cache hit it reported."""
    tokens = []
    async for chunk in router.generate(GenerateRequest(request_id, prompt, GREEDY)):
        tokens += chunk.token_ids
        if cached is not None:
            cached[request_id] = max(cached.get(request_id, 0), chunk.num_cached_tokens)
    return tokens


async def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


def test_each_rule_decides_a_real_request(tmp_path):
    """Apart: a long prompt goes to the prefill pool (``remote``), a short one stays on the
    decode worker (``short_prompt``), and a long prompt whose prefix the decode worker
    holds from the first request, its reply included, stays there too
    (``cached_on_decode``, reporting the hit). Then the only prefill worker left computes
    on the decode worker's CPU: ``shared_compute``."""
    model = make_demo_model(tmp_path / "demo")
    cpus = sorted(os.sched_getaffinity(0))
    long_prompt, short_prompt, other = random_prompts([90, 10, 90], 5)
    offline = LLM(str(model), dtype="float32", max_model_len=MAX_MODEL_LEN, load_progress=False)
    reply = offline.generate([long_prompt], GREEDY)[0].outputs[0].token_ids
    # 102 tokens: the decode worker computed the prompt and 7 of the 8 reply tokens, so it
    # holds 6 full blocks (96 tokens), the last one half reply.
    follow_up = long_prompt + reply + [7, 8, 9, 10]
    expected = [o.outputs[0].token_ids for o in offline.generate(
        [long_prompt, short_prompt, follow_up, other], GREEDY)]
    cached: dict[str, int] = {}
    procs = []
    with RedisServer() as redis:
        try:
            args = worker_args(model, redis.url)
            for role, name, cpu in (("prefill", "apart", cpus[0]), ("decode", "d", cpus[1]),
                                    ("prefill", "beside", cpus[1])):
                procs.append(start_worker_process(role, args, tmp_path / f"{name}.json",
                                                  cpus={cpu})[0])
            router = ModelService(RouterConfig(str(model), redis.url, max_model_len=MAX_MODEL_LEN,
                                         registry_interval_s=0.2, health_interval_s=0.1,
                                         auth=TEST_AUTH))

            async def main():
                await router.start()
                try:
                    async def pool_is(num_prefill: int) -> bool:
                        return len(router.pool.live("prefill")) == num_prefill and \
                            len(router.pool.live("decode")) == 1 and \
                            all(w.healthy for r in router.pool.workers.values()
                                for w in r.values())

                    await wait_for(lambda: pool_is(2), 30, "both prefill workers")
                    got = [await run(router, "long", long_prompt),
                           await run(router, "short", short_prompt)]
                    counts = [path_counts(router)]
                    decode_id = next(iter(router.pool.workers["decode"]))

                    async def decode_holds_prefix() -> bool:
                        overlaps = await router._lookup(router_hashes(router, follow_up))
                        return overlaps.get(decode_id, 0) >= 6

                    await wait_for(decode_holds_prefix, 10, "the decode worker's blocks")
                    got.append(await run(router, "follow-up", follow_up, cached))
                    counts.append(path_counts(router))
                    procs[0].send_signal(signal.SIGTERM)  # the prefill worker apart leaves
                    await wait_for(lambda: pool_is(1), 30, "the apart worker to leave")
                    got.append(await run(router, "other", other))
                    counts.append(path_counts(router))
                    return got, counts
                finally:
                    await router.stop()

            got, counts = asyncio.run(main())
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                proc.wait(30)
    assert got == expected
    assert counts[0] == {"remote": 1, "short_prompt": 1}
    assert counts[1] == {"remote": 1, "short_prompt": 1, "cached_on_decode": 1}
    assert counts[2] == {"remote": 1, "short_prompt": 1, "cached_on_decode": 1,
                         "shared_compute": 1}
    assert cached == {"follow-up": 96}  # reported from the decode worker's own cache


def router_hashes(router: ModelService, prompt: list[int]) -> list[bytes]:
    from pdserve.engine.block_hash import hash_block_chain

    return hash_block_chain(prompt, router.config.block_size, router._root_hash, None)
