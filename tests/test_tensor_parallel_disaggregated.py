"""KV transfer between tensor-parallel workers (issue 27, part 2): a prefill worker at TP=2
feeding a decode worker at TP=1, TP=1 feeding TP=2, and TP=2 feeding TP=2, each giving
the tokens of the colocated engine at TP=1, including a request whose prefix the decode
worker already holds (only the missing blocks move); and a layout that cannot be served
refused at once, naming both sides. Real workers (in this process, their ranks
processes of their own), real Redis, gRPC and gloo over 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import signal
import threading
import time

import openai
import pytest
import torch
from conftest import random_prompts, write_tiny_checkpoint
from disagg_client import TEST_AUTH, decode_stub, generate, prefill_stub
from inproc_cluster import uvicorn_server

from pdserve.cluster.worker_config import WorkerConfig
from pdserve.decode_worker.server import DecodeWorker
from pdserve.engine import LLM, EngineConfig, SamplingParams
from pdserve.engine.demo_model import VOCAB_SIZE, make_demo_model
from pdserve.entrypoints.redis_server import RedisServer, free_port
from pdserve.kernels.kv_shards import KVShard, KVShards
from pdserve.kvtransfer import KVPollState, KVReceiver, KVSender, KVTransferError
from pdserve.prefill_worker.server import PrefillWorker
from pdserve.router.config import RouterConfig
from pdserve.router.http import build_app
from pdserve.router.model_service import ModelService

KV_KEY = hashlib.sha256(b"pdserve test cluster: kv").digest()  # both processes

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
# layers * (K, V) * block_size * kv heads * head dim * fp32: every head moves, whatever
# the split on either side
BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4


def engine(path, tp: int) -> EngineConfig:
    return EngineConfig(str(path), dtype="float32", max_model_len=256, load_progress=False,
                        num_gpu_blocks_override=64, num_threads=1, tensor_parallel_size=tp)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Llama (2 layers, 4 heads, 2 KV heads of 16) with the demo model's tokenizer,
    so the router can serve it."""
    root = tmp_path_factory.mktemp("tp-disagg")
    demo = make_demo_model(root / "demo")
    path = write_tiny_checkpoint(root / "llama", "llama", vocab_size=VOCAB_SIZE)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo / name, path / name)
    return path


@pytest.fixture(scope="module")
def workers(checkpoint):
    """Prefill and decode workers at TP=1 and TP=2 each, keyed (role, tp), the function
    that runs a coroutine on their event loop, and that loop."""
    path = checkpoint
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def call(coro, timeout_s: float = 180.0):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout_s)

    started = {}
    with RedisServer() as redis:
        try:
            for role, cls in (("prefill", PrefillWorker), ("decode", DecodeWorker)):
                for tp in (1, 2):
                    worker = cls(WorkerConfig(role, engine(path, tp), redis_url=redis.url,
                                              kv_transfer_timeout_s=10.0, auth=TEST_AUTH))
                    call(worker.start())
                    started[role, tp] = worker
            yield started, call, loop
        finally:
            for worker in started.values():
                call(worker.stop())
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)


@pytest.fixture(scope="module")
def colocated(checkpoint):
    return LLM(str(checkpoint), dtype="float32", max_model_len=256, load_progress=False)


@pytest.mark.parametrize("prefill_tp, decode_tp", [(2, 1), (1, 2), (2, 2)])
def test_disaggregated_across_tensor_parallel_sizes_equals_colocated(
        workers, colocated, prefill_tp, decode_tp):
    started, call, _ = workers
    prefill, decode = started["prefill", prefill_tp], started["decode", decode_tp]
    prompts = random_prompts([7, 40, 90], VOCAB_SIZE, seed=40 + 3 * prefill_tp + decode_tp)
    shared = random_prompts([96], VOCAB_SIZE, seed=50 + 3 * prefill_tp + decode_tp)[0]
    with_prefix = [shared + [1, 2, 3], shared + [4, 5, 6, 7]]

    async def main():
        p, d = prefill_stub(prefill.grpc_address), decode_stub(decode.grpc_address)
        tag = f"{prefill_tp}to{decode_tp}"
        results = await asyncio.gather(*(generate(p, d, f"{tag}-{i}", prompt, GREEDY)
                                         for i, prompt in enumerate(prompts)))
        first = await generate(p, d, f"{tag}-prefix-a", with_prefix[0], GREEDY)
        second = await generate(p, d, f"{tag}-prefix-b", with_prefix[1], GREEDY)
        return [*results, first, second]

    results = call(main())
    expected = colocated.generate(prompts + with_prefix, GREEDY)
    assert [r.tokens for r in results] == [o.outputs[0].token_ids for o in expected]
    first, second = results[-2:]
    assert first.num_transferred_blocks == 7  # 99 tokens: 6 full blocks + 1 partial
    assert first.num_transferred_bytes == 7 * BLOCK_BYTES
    # delta transfer: the decode worker holds the 6 shared blocks on every rank already
    assert second.num_cached_tokens_decode == 96
    assert second.num_transferred_blocks == 1
    assert second.num_transferred_bytes == BLOCK_BYTES
    for worker in (prefill, decode):  # every block back, on every rank's accounting
        engine = worker.runtime.engine
        deadline = time.monotonic() + 10
        while not call(engine.call(lambda e: e.is_idle_and_clean())):
            assert time.monotonic() < deadline, engine.ownership
            time.sleep(0.1)


def test_shards_gather_and_scatter_every_rank_heads():
    """Two ranks of one KV head each, a third replicating rank 1's: the blocks gathered
    are the whole cache's, and a scatter writes each rank's heads (replicas too)."""
    full = torch.randn(2, 2, 8, 4, 2, 16)  # [L, 2, blocks, block_size, heads, dim]
    ranks = [full[..., :1, :].clone(), full[..., 1:, :].clone(), full[..., 1:, :].clone()]
    shards = KVShards([KVShard(ranks[0], 0), KVShard(ranks[1], 1), KVShard(ranks[2], 1)])
    assert tuple(shards.shape) == tuple(full.shape)
    ids = torch.tensor([5, 0, 3])
    out = torch.empty(2, 2, 3, 4, 2, 16)
    shards.gather(ids, out)
    assert torch.equal(out, full[:, :, ids])
    new = torch.randn(2, 2, 3, 4, 2, 16)
    shards.scatter(ids, new)
    assert torch.equal(ranks[0][:, :, ids], new[..., :1, :])
    assert torch.equal(ranks[1][:, :, ids], new[..., 1:, :])
    assert torch.equal(ranks[2][:, :, ids], new[..., 1:, :])
    with pytest.raises(ValueError, match="not 0..2"):
        KVShards([KVShard(ranks[0], 0), KVShard(ranks[1], 2)])


def test_a_layout_that_cannot_be_served_is_refused_within_5_s():
    """A TP=2 prefill worker's two heads against a decode cache of four: the send is
    refused before any channel is made, naming both layouts."""
    sender_shards = KVShards([KVShard(torch.zeros(2, 2, 8, 16, 1, 16), 0),
                              KVShard(torch.zeros(2, 2, 8, 16, 1, 16), 1)])
    receiver = KVReceiver("decode-4-heads", torch.zeros(2, 2, 8, 16, 4, 16), "127.0.0.1:0",
                          kv_key=KV_KEY, timeout_s=5.0, connect_timeout_s=5.0)
    sender = KVSender("prefill-tp2", sender_shards,
                      kv_key=KV_KEY, timeout_s=5.0, connect_timeout_s=5.0)
    try:
        pull = receiver.init("r", "prefill-tp2", [0, 1])
        started = time.monotonic()
        with pytest.raises(KVTransferError, match="KV cache geometries differ"):
            sender.send("r", "decode-4-heads", receiver.address, [3, 4],
                        ticket=pull.ticket_text)
        assert pull.wait(5) == KVPollState.FAILED
        assert time.monotonic() - started < 5.0
        message = str(pull.failure_exception())
        assert "decode worker decode-4-heads holds float32 (2 layers, 16 tokens, 4 kv heads" \
            in message
        assert "prefill worker prefill-tp2 holds float32 (2 layers, 16 tokens, 2 kv heads" \
            in message
        assert not receiver.kv_cache.any()
    finally:
        sender.close()
        receiver.close()


def test_a_decode_rank_killed_mid_stream_migrates_its_streams(workers, colocated,
                                                              checkpoint):
    """kill -9 of rank 1 of the TP=2 decode worker while streams run there: its engine
    stops, the worker reports itself stopped (the router takes it out of routing), and
    every stream finishes on the other decode worker with the colocated text. Runs last:
    it leaves that worker dead."""
    started, _, loop = workers
    victim = started["decode", 2]
    model = str(checkpoint)
    router = ModelService(RouterConfig(model, victim.config.redis_url, max_model_len=256,
                                 auth=TEST_AUTH, disaggregation="always"))
    port = free_port()
    server = uvicorn_server(build_app(router), port)
    serving = asyncio.run_coroutine_threadsafe(server.serve(), loop)
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and not serving.done(), "uvicorn did not start"
        time.sleep(0.02)
    prompts = random_prompts([30 + i for i in range(8)], VOCAB_SIZE, seed=77)
    expected = colocated.generate(prompts, SamplingParams(temperature=0.0, max_tokens=150,
                                                          ignore_eos=True))
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                                max_retries=0, timeout=120)

    async def stream(prompt) -> str:
        text = ""
        response = await client.completions.create(
            model=model, prompt=prompt, stream=True, max_tokens=150, temperature=0.0,
            extra_body={"ignore_eos": True})
        async for chunk in response:
            text += "".join(choice.text for choice in chunk.choices)
        return text

    async def main() -> list[str]:
        jobs = [asyncio.create_task(stream(p)) for p in prompts]
        deadline = time.monotonic() + 60
        while victim.runtime.health().num_running == 0:
            assert time.monotonic() < deadline, "no stream reached the TP=2 decode worker"
            await asyncio.sleep(0.01)
        os.kill(victim.runtime.engine.engine.model_runner.executor.pids[0], signal.SIGKILL)
        return await asyncio.wait_for(asyncio.gather(*jobs), 120)

    try:
        texts = asyncio.run(main())
        assert texts == [o.outputs[0].text for o in expected]
        assert not victim.runtime.engine.alive
        assert victim.runtime.health().status == "stopped"
    finally:
        server.should_exit = True
        serving.result(30)
