"""The decode session (decode.proto ``DecodeSession``): many requests on one stream, one
message per engine step, against a real decode worker in this process (real gRPC, real
Redis), both from the wire and through the router's ``DecodeSession``."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest
from conftest import random_prompts
from disagg_client import TEST_AUTH, decode_stub, health

from pdserve.cluster.wire import sampling_params_to_proto
from pdserve.cluster.worker_config import WorkerConfig
from pdserve.decode_worker.server import DecodeWorker
from pdserve.engine import EngineConfig, SamplingParams
from pdserve.entrypoints.redis_server import RedisServer, free_port
from pdserve.proto import common_pb2, decode_pb2, decode_pb2_grpc
from pdserve.router.session import DecodeSession

SESSION_METHOD = "/pdserve.v1.DecodeWorker/DecodeSession"
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
LONG = dataclasses.replace(GREEDY, max_tokens=200)


@pytest.fixture(scope="module")
def redis_server():
    with RedisServer() as server:
        yield server


def run_with_decode_worker(tiny_checkpoints, redis_server, body):
    """Start a decode worker in this process and run ``body(stub)``."""
    engine = EngineConfig(str(tiny_checkpoints["qwen2"]), dtype="float32", max_model_len=256,
                          load_progress=False, num_gpu_blocks_override=64)

    async def main():
        worker = DecodeWorker(WorkerConfig("decode", engine, redis_url=redis_server.url,
                                           auth=TEST_AUTH))
        await worker.start()
        try:
            return await body(decode_stub(worker.grpc_address))
        finally:
            await worker.stop()

    return asyncio.run(main())


def request(request_id: str, prompt: list[int], params: SamplingParams = GREEDY):
    return decode_pb2.DecodeRequest(request_id=request_id, prompt_token_ids=prompt,
                                    sampling_params=sampling_params_to_proto(params))


async def decode_alone(stub, request_id: str, prompt: list[int],
                       params: SamplingParams = GREEDY) -> list[int]:
    tokens = []
    async for message in stub.Decode(request(request_id, prompt, params), timeout=30):
        tokens += message.token_ids
    return tokens


async def wait_all_free(stub, timeout_s: float = 10.0):
    """The worker's health once every KV block is free again (or at the timeout)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        state = await health(stub)
        if state.num_free_blocks == state.num_total_blocks or \
                asyncio.get_running_loop().time() > deadline:
            return state
        await asyncio.sleep(0.05)


def test_one_stream_carries_many_requests_in_step_messages(tiny_checkpoints, redis_server):
    """Six requests on one stream get the tokens each gets alone, several requests'
    tokens travel in one message, a cancelled request ends CANCELLED at once, a duplicate
    id and bad parameters fail only their own request, and the stream ends when the
    router ends its side and the last request is done, with every block free."""
    prompts = random_prompts([9, 17, 30, 41, 5, 12], 7)

    async def body(stub):
        call = stub.DecodeSession(timeout=60, metadata=TEST_AUTH.rpc_metadata(SESSION_METHOD, None))
        for i, prompt in enumerate(prompts):
            await call.write(decode_pb2.DecodeSessionRequest(decode=request(f"r{i}", prompt)))
        await call.write(decode_pb2.DecodeSessionRequest(
            decode=request("long", prompts[0], LONG)))
        await call.write(decode_pb2.DecodeSessionRequest(decode=request("r0", prompts[1])))
        bad = request("bad", prompts[0])
        bad.sampling_params.temperature = -1.0
        await call.write(decode_pb2.DecodeSessionRequest(decode=bad))
        tokens = {f"r{i}": [] for i in range(len(prompts))} | {"long": []}
        errors, widths, finished, cancelled = {}, [], set(), False
        async for message in call:
            widths.append(len({u.request_id for u in message.updates
                               if u.response.token_ids}))
            for update in message.updates:
                if update.error_code:
                    errors.setdefault(update.request_id, []).append(
                        (grpc.StatusCode.INVALID_ARGUMENT.value[0] == update.error_code,
                         update.error_code, update.error_details))
                    continue
                tokens[update.request_id] += update.response.token_ids
                if update.response.finish_reason:
                    finished.add(update.request_id)
            if tokens["long"] and not cancelled:
                await call.write(decode_pb2.DecodeSessionRequest(cancel_request_id="long"))
                cancelled = True
            if finished == {f"r{i}" for i in range(len(prompts))} and cancelled:
                await call.done_writing()
        alone = [await decode_alone(stub, f"alone{i}", p) for i, p in enumerate(prompts)]
        return tokens, errors, widths, alone, await call.code(), await wait_all_free(stub)

    tokens, errors, widths, alone, code, state = run_with_decode_worker(
        tiny_checkpoints, redis_server, body)
    assert [tokens[f"r{i}"] for i in range(len(prompts))] == alone
    assert all(len(t) == GREEDY.max_tokens for t in alone)
    assert max(widths) >= 2  # one engine step's tokens of several requests, one message
    assert 0 < len(tokens["long"]) < LONG.max_tokens
    assert errors["long"] == [(False, grpc.StatusCode.CANCELLED.value[0], "cancelled")]
    assert len(errors["r0"]) == 1 and errors["r0"][0][0] and "already running" in \
        errors["r0"][0][2]
    assert len(errors["bad"]) == 1 and errors["bad"][0][0] and "temperature" in \
        errors["bad"][0][2]
    assert code == grpc.StatusCode.OK
    assert state.num_free_blocks == state.num_total_blocks and state.num_running == 0


def test_router_session_stall_probe_close_and_reopen(tiny_checkpoints, redis_server):
    """Through the router's ``DecodeSession``: a request silent past the stall interval
    whose worker answers Health goes on to its last token (the probe said alive); when
    Health gets no answer (asked of a port where nothing listens: a worker that stopped
    answering) every request on the stream fails with UNAVAILABLE and the worker, its
    stream dropped, frees their blocks; closing the session fails the requests on it with
    CANCELLED and frees theirs; the next request opens a new stream and is served."""
    prompts = random_prompts([9, 17, 30], 8)

    async def body(stub):
        probes = {"alive": 0, "dead": 0}

        async def health_of(target) -> bool:
            try:
                alive = (await target.Health(common_pb2.HealthRequest(), timeout=2)
                         ).status == "ok"
            except grpc.aio.AioRpcError:
                alive = False
            probes["alive" if alive else "dead"] += 1
            return alive

        def session_with(alive) -> DecodeSession:
            return DecodeSession(stub, lambda: TEST_AUTH.rpc_metadata(SESSION_METHOD, None), "d",
                                 stall_s=0.001, alive=alive)

        # a stall interval far under a decode step's time: a probe per message gap
        slow = [t for m in [m async for m in session_with(lambda: health_of(stub)).start(
            request("slow", prompts[0], LONG))] for t in m.token_ids]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{free_port()}") as nowhere:
            unanswered = decode_pb2_grpc.DecodeWorkerStub(nowhere)
            doomed = session_with(lambda: health_of(unanswered))
            calls = [doomed.start(request(i, prompts[1], LONG)) for i in ("x", "y")]
            codes = []
            for call in calls:
                with pytest.raises(grpc.aio.AioRpcError) as dead:
                    async for _ in call:
                        pass
                codes.append(dead.value.code())
        after_dead = await wait_all_free(stub)
        session = session_with(lambda: health_of(stub))
        first = session.start(request("a", prompts[1], LONG))
        second = session.start(request("b", prompts[2], LONG))
        await anext(first)
        await anext(second)
        session.close()
        for call in (first, second):
            with pytest.raises(grpc.aio.AioRpcError) as closed:
                async for _ in call:
                    pass
            codes.append(closed.value.code())
        after_close = await wait_all_free(stub)
        again = [t for m in [m async for m in session.start(request("c", prompts[0]))]
                 for t in m.token_ids]
        return (slow, await decode_alone(stub, "slow-alone", prompts[0], LONG), probes,
                codes, after_dead, after_close, again,
                await decode_alone(stub, "c-alone", prompts[0]), session.num_requests)

    slow, slow_alone, probes, codes, after_dead, after_close, again, alone, left = \
        run_with_decode_worker(tiny_checkpoints, redis_server, body)
    assert slow == slow_alone and len(slow) == LONG.max_tokens
    assert probes["alive"] > 0 and probes["dead"] >= 1
    assert codes == [grpc.StatusCode.UNAVAILABLE] * 2 + [grpc.StatusCode.CANCELLED] * 2
    assert after_dead.num_free_blocks == after_dead.num_total_blocks
    assert after_close.num_free_blocks == after_close.num_total_blocks
    assert again == alone and len(again) == GREEDY.max_tokens
    assert left == 0
