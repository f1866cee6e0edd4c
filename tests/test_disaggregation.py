"""Disaggregated serving end to end: real Redis, prefill and decode workers as Ray actors,
KV pulled over the pair channels (pdserve's authenticated socket on CPU), driven by a gRPC client."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time

import grpc
import pytest
from conftest import random_prompts, write_tiny_checkpoint
from disagg_client import (
    TEST_AUTH,
    decode_stub,
    generate,
    health,
    lease_for,
    prefill_stub,
    start_worker_process,
)

from pdserve.cluster.wire import sampling_params_to_proto
from pdserve.cluster.worker_config import WorkerConfig
from pdserve.engine import LLM, EngineConfig, SamplingParams
from pdserve.entrypoints.launcher import RayLauncher
from pdserve.entrypoints.redis_server import RedisServer
from pdserve.prefill_worker.server import PrefillWorker
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
    launcher = None
    try:
        launcher = RayLauncher(num_cpus=2)
        common = {"engine": engine_config(tiny_checkpoints["llama"]), "redis_url": redis.url,
                  "kv_transfer_timeout_s": 10.0, "lease_s": 5.0, "auth": TEST_AUTH}
        prefill = launcher.launch(WorkerConfig("prefill", **common), 2, workers_on_node=4)
        decode = launcher.launch(WorkerConfig("decode", **common), 2, workers_on_node=4)
        yield launcher, prefill, decode
    finally:
        if launcher is not None:
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
        clean = (state.num_free_blocks == state.num_total_blocks and state.num_kv_leases == 0
                 and state.num_requests_waiting_for_kv == 0 and state.num_unowned_blocks == 0)
        if clean or time.monotonic() > deadline:
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
            request_id="to-abort", prompt_token_ids=prompt, sampling_params=params, **await lease_for(d)), timeout=30)
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


# A checkpoint whose KV is big and cheap to compute: 16 layers x 8 KV heads x head_dim 256
# in fp32 is 256 KiB per token, so a 320-token prompt's payload (20 blocks of 16) is 80 MiB,
# far more than loopback socket buffers hold (tcp_wmem max 4 MiB + what the receiver's
# window has grown to): a sender whose receiver stops reading blocks mid-payload.
BIG_KV = {"num_hidden_layers": 16, "num_attention_heads": 8, "num_key_value_heads": 8,
          "head_dim": 256, "max_position_embeddings": 1024}
BIG_KV_PROMPT_TOKENS = 320
BIG_KV_MAX_LEN = 384
BIG_KV_BLOCKS = BIG_KV_MAX_LEN // 16  # per worker: one sequence (20 blocks) fits


def start_decode_process(checkpoint, redis_url: str, ready_file) -> tuple[subprocess.Popen, dict]:
    """``python -m pdserve.decode_worker`` serving the big-KV checkpoint; waits (60 s at
    most) for its ready file and returns the process and its addresses."""
    return start_worker_process("decode", [
        "--model", str(checkpoint), "--dtype", "float32", "--max-model-len",
        str(BIG_KV_MAX_LEN), "--num-gpu-blocks-override", str(BIG_KV_BLOCKS), "--redis-url",
        redis_url, "--num-threads", "1", "--kv-transfer-timeout-s", "30", "--log-level",
        "WARNING"], ready_file, timeout_s=60)


async def wait_transfer_in_flight(stub, task: asyncio.Task, timeout_s: float) -> bool:
    """Poll ``stub``'s Health until it reports a KV transfer in flight (True), or
    ``task`` ends or ``timeout_s`` passes first (False)."""
    deadline = time.monotonic() + timeout_s
    while not task.done() and time.monotonic() < deadline:
        if (await health(stub)).num_kv_transfers_in_flight > 0:
            return True
    return False


async def wait_no_transfer_in_flight(stub, timeout_s: float) -> bool:
    """Poll ``stub``'s Health until no KV transfer is in flight (True) or ``timeout_s``
    passes (False)."""
    deadline = time.monotonic() + timeout_s
    while (await health(stub)).num_kv_transfers_in_flight > 0:
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def kill_decode_mid_transfer(prefill, dying, proc: subprocess.Popen,
                                   sampling: SamplingParams, max_tries: int):
    """Send fresh prompts through ``prefill`` to the decode worker whose stub is ``dying``
    and whose process is ``proc``, until one kill lands mid-payload: once a transfer is seen in
    flight the process is stopped (SIGSTOP); still in flight a second later (the sender
    blocks on a full socket), it is killed (SIGKILL), else resumed (SIGCONT) for the next
    try. Returns ``(tries, landed)``: per try (seen in flight, killed, the request's
    outcome or exception), and the try whose kill landed (request ``dies-<try>``), or
    None after ``max_tries`` misses."""
    tries, landed = [], None
    for attempt in range(max_tries):
        # an earlier try's send has ended: a transfer seen in flight is this one's
        idle = await wait_no_transfer_in_flight(prefill, timeout_s=60)
        assert idle, f"a send of an earlier try never ended: {tries}"
        # a fresh prompt per try, so that the decode worker caches none of it
        prompt = random_prompts([BIG_KV_PROMPT_TOKENS], seed=350 + attempt)[0]
        task = asyncio.ensure_future(generate(prefill, dying, f"dies-{attempt}", prompt,
                                              sampling, timeout_s=60))
        seen = await wait_transfer_in_flight(prefill, task, timeout_s=60)
        if seen:
            os.kill(proc.pid, signal.SIGSTOP)
            await asyncio.sleep(1.0)  # an unblocked 80 MiB send takes ~50 ms
            if (await health(prefill)).num_kv_transfers_in_flight > 0:
                landed = attempt
                os.kill(proc.pid, signal.SIGKILL)
                await asyncio.to_thread(proc.wait, 30)
            else:
                os.kill(proc.pid, signal.SIGCONT)
        outcome = (await asyncio.gather(task, return_exceptions=True))[0]
        tries.append((seen, landed == attempt, outcome))
        if landed is not None:
            break
    return tries, landed


def test_decode_worker_killed_mid_transfer_frees_prefill_blocks(tiny_checkpoints, tmp_path):
    """A decode worker (a plain process) dies while the payload moves: it is stopped
    (SIGSTOP) once the prefill worker reports the transfer in flight, the transfer is seen
    still in flight a second later (the sender blocks on a full socket: the kill provably
    lands mid-payload), then it is killed (SIGKILL). The prefill worker's blocks all come
    free, and it serves the next request through the other decode worker, right tokens."""
    checkpoint = write_tiny_checkpoint(tmp_path / "big-kv", "mistral", **BIG_KV)
    config = EngineConfig(str(checkpoint), dtype="float32", max_model_len=BIG_KV_MAX_LEN,
                          load_progress=False, num_gpu_blocks_override=BIG_KV_BLOCKS)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    max_tries = 8

    async def main(redis_url: str, procs: list, infos: list):
        prefill = PrefillWorker(WorkerConfig("prefill", config, redis_url=redis_url,
                                             lease_s=60.0, kv_transfer_timeout_s=30.0,
                                             auth=TEST_AUTH))
        await prefill.start()
        try:
            p = prefill_stub(prefill.grpc_address)
            dying, survivor = decode_stub(infos[1]["grpc_address"]), decode_stub(
                infos[0]["grpc_address"])
            tries, landed = await kill_decode_mid_transfer(p, dying, procs[1], greedy,
                                                           max_tries)
            # A failed send leaves its lease standing, so that another decode worker may
            # pull the same KV; the router releases it when it gives the KV up.
            await wait_no_transfer_in_flight(p, timeout_s=60)
            leased = await health(p)
            if landed is not None:
                released = await p.Release(
                    prefill_pb2.ReleaseRequest(request_id=f"dies-{landed}"), timeout=10)
                assert released.released
            state = await wait_all_blocks_free(p, timeout_s=30)
            after = random_prompts([BIG_KV_PROMPT_TOKENS], seed=349)[0]
            served = await generate(p, survivor, "after", after, greedy, timeout_s=60)
            # NOTE: the sender's thread ends its send just after the decode side has the
            # bytes (and may stream tokens), so the gauge drops to 0 shortly after
            idle = await wait_no_transfer_in_flight(p, timeout_s=30)
            return (tries, landed, state, after, served, idle, await health(p),
                    prefill.service.sender.counters(), leased)
        finally:
            await prefill.stop()

    procs, infos = [], []
    with RedisServer() as redis:
        try:
            for i in range(2):
                proc, info = start_decode_process(checkpoint, redis.url, tmp_path / f"d{i}.json")
                procs.append(proc)
                infos.append(info)
            tries, landed, state, after, served, idle, final, sends, leased = asyncio.run(
                main(redis.url, procs, infos))
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                proc.wait(timeout=30)

    assert landed is not None, f"no kill landed mid-transfer in {max_tries} tries: {tries}"
    killed = tries[landed][2]
    assert isinstance(killed, grpc.aio.AioRpcError), tries  # its Decode stream broke
    assert procs[1].returncode == -signal.SIGKILL
    assert (leased.num_kv_leases, leased.num_unowned_blocks) == (1, 0)
    assert state.num_free_blocks == state.num_total_blocks
    assert state.num_kv_leases == 0 and state.num_unowned_blocks == 0
    assert idle and final.num_kv_transfers_in_flight == 0, tries
    # the killed send failed (its lease stood until released); the missed tries' sends
    # and the last request's succeeded
    assert (sends.num_failed, sends.num_transfers) == (1, landed + 1)
    expected = LLM(str(checkpoint), dtype="float32", max_model_len=BIG_KV_MAX_LEN,
                   load_progress=False, num_gpu_blocks_override=BIG_KV_BLOCKS).generate(
                       [after], greedy)
    assert served.tokens == expected[0].outputs[0].token_ids
    assert served.num_transferred_blocks == BIG_KV_PROMPT_TOKENS // 16
