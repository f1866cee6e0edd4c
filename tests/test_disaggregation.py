"""Disaggregated serving end to end: real Redis, prefill and decode workers as Ray actors,
KV pulled over torch.distributed (gloo) pair channels, driven by a gRPC client."""

from __future__ import annotations

import asyncio
import time

import pytest
from conftest import random_prompts
from disagg_client import decode_stub, generate, health, prefill_stub

from pdserve.cluster.launcher import RayLauncher
from pdserve.cluster.redis_server import RedisServer
from pdserve.cluster.wire import sampling_params_to_proto
from pdserve.cluster.worker_config import WorkerConfig
from pdserve.engine import LLM, EngineConfig, SamplingParams
from pdserve.proto import decode_pb2, prefill_pb2

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=42, max_tokens=12, ignore_eos=True)


def engine_config(path) -> EngineConfig:
    return EngineConfig(str(path), dtype="float32", max_model_len=256, load_progress=False,
                        num_gpu_blocks_override=96)


@pytest.fixture(scope="module")
def cluster(tiny_checkpoints):
    """Redis + 2 prefill and 2 decode workers as Ray actors."""
    redis = RedisServer()
    launcher = RayLauncher(num_cpus=2)
    try:
        common = dict(engine=engine_config(tiny_checkpoints["llama"]), redis_url=redis.url,
                      kv_transfer_timeout_s=10.0, lease_s=5.0)
        prefill = launcher.launch(WorkerConfig("prefill", **common), 2, workers_on_node=4)
        decode = launcher.launch(WorkerConfig("decode", **common), 2, workers_on_node=4)
        yield launcher, prefill, decode
    finally:
        launcher.shutdown()
        redis.close()


@pytest.fixture(scope="module")
def offline(tiny_checkpoints):
    return LLM(str(tiny_checkpoints["llama"]), dtype="float32", max_model_len=256,
               load_progress=False)


async def wait_all_blocks_free(stub, timeout_s: float = 15.0):
    deadline = time.monotonic() + timeout_s
    while True:
        state = await health(stub)
        if state.num_free_blocks == state.num_total_blocks or time.monotonic() > deadline:
            return state
        await asyncio.sleep(0.1)


def test_greedy_and_seeded_equal_colocated_with_requests_in_flight(cluster, offline):
    _, prefill, decode = cluster
    prompts = random_prompts([7, 40, 90, 17], seed=31)

    async def main():
        p, d = prefill_stub(prefill[0].grpc_address), decode_stub(decode[0].grpc_address)
        jobs = [generate(p, d, f"g{i}", prompt, GREEDY) for i, prompt in enumerate(prompts)]
        jobs += [generate(p, d, f"s{i}", prompt, SEEDED) for i, prompt in enumerate(prompts)]
        results = await asyncio.gather(*jobs)
        return results, await wait_all_blocks_free(p), await wait_all_blocks_free(d)

    results, p_state, d_state = asyncio.run(main())
    expected = [o.outputs[0].token_ids for o in offline.generate(prompts, GREEDY)]
    expected += [o.outputs[0].token_ids for o in offline.generate(prompts, SEEDED)]
    assert [r.tokens for r in results] == expected
    assert all(r.finish_reason == "length" for r in results)
    assert p_state.num_free_blocks == p_state.num_total_blocks
    assert d_state.num_free_blocks == d_state.num_total_blocks


def test_shared_prefix_moves_only_missing_blocks(cluster):
    _, prefill, decode = cluster
    shared = random_prompts([96], seed=32)[0]  # 6 full blocks of 16

    async def main():
        p, d = prefill_stub(prefill[1].grpc_address), decode_stub(decode[1].grpc_address)
        first = await generate(p, d, "prefix-a", shared + [1, 2, 3], GREEDY)
        second = await generate(p, d, "prefix-b", shared + [4, 5, 6, 7], GREEDY)
        return first, second

    first, second = asyncio.run(main())
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # layers * (K, V) * block_size * kv heads * dim * fp32
    assert first.num_transferred_blocks == 7  # 99 tokens: 6 full blocks + 1 partial
    assert first.num_transferred_bytes == 7 * block_bytes
    assert second.num_cached_tokens_prefill == 96  # the prefill worker's own prefix cache
    assert second.num_cached_tokens_decode == 96  # the decode worker already holds 6 blocks
    assert second.num_transferred_blocks == 1  # only the partial last block moves
    assert second.num_transferred_bytes == block_bytes


def test_abort_while_decoding_frees_blocks_on_both_sides(cluster):
    _, prefill, decode = cluster
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    prompt = random_prompts([50], 33)[0]

    async def main():
        p, d = prefill_stub(prefill[0].grpc_address), decode_stub(decode[0].grpc_address)
        params = sampling_params_to_proto(long)
        first = await p.Prefill(prefill_pb2.PrefillRequest(
            request_id="to-abort", prompt_token_ids=prompt, sampling_params=params), timeout=30)
        stream = d.Decode(decode_pb2.DecodeRequest(
            request_id="to-abort", prompt_token_ids=prompt, first_token_id=first.first_token_id,
            sampling_params=params, kv_handle=first.kv_handle), timeout=30)
        tokens, finish = [], ""
        async for message in stream:
            tokens += list(message.token_ids)
            if tokens and not finish and len(tokens) < 10:
                await d.Abort(decode_pb2.AbortRequest(request_id="to-abort"), timeout=10)
            finish = message.finish_reason or finish
        return tokens, finish, await wait_all_blocks_free(p), await wait_all_blocks_free(d)

    tokens, finish, p_state, d_state = asyncio.run(main())
    assert finish == "abort" and len(tokens) < 199
    assert p_state.num_free_blocks == p_state.num_total_blocks
    assert d_state.num_free_blocks == d_state.num_total_blocks


def test_many_requests_over_two_prefill_and_two_decode_workers(cluster, offline):
    _, prefill, decode = cluster
    prompts = random_prompts([5 + 7 * i for i in range(16)], seed=34)

    async def main():
        ps = [prefill_stub(w.grpc_address) for w in prefill]
        ds = [decode_stub(w.grpc_address) for w in decode]
        jobs = [generate(ps[i % 2], ds[(i // 2) % 2], f"many-{i}", prompt, GREEDY)
                for i, prompt in enumerate(prompts)]
        return await asyncio.gather(*jobs)

    results = asyncio.run(main())
    expected = [o.outputs[0].token_ids for o in offline.generate(prompts, GREEDY)]
    assert [r.tokens for r in results] == expected


def test_killed_decode_worker_frees_prefill_blocks(cluster, offline):
    """A decode worker is killed while it pulls or decodes a request: the prefill worker's
    pinned blocks come free (the send fails, or the 5 s lease runs out) and it keeps
    serving the other decode worker."""
    launcher, prefill, decode = cluster
    prompt = random_prompts([120], seed=35)[0]

    async def main():
        p = prefill_stub(prefill[1].grpc_address)
        d_dying = decode_stub(decode[1].grpc_address)
        task = asyncio.create_task(generate(p, d_dying, "dies", prompt, SamplingParams(
            temperature=0, max_tokens=500, ignore_eos=True), timeout_s=20))
        await asyncio.sleep(0.05)
        launcher.kill(3)  # actors: prefill-0, prefill-1, decode-0, decode-1
        await asyncio.gather(task, return_exceptions=True)
        state = await wait_all_blocks_free(p, timeout_s=40)
        survivor = await generate(p, decode_stub(decode[0].grpc_address), "after", prompt,
                                  GREEDY)
        return state, survivor

    state, survivor = asyncio.run(main())
    assert state.num_free_blocks == state.num_total_blocks
    assert survivor.tokens == offline.generate([prompt], GREEDY)[0].outputs[0].token_ids
