"""vLLM's priority scheduling through the cluster: ``--scheduling-policy priority`` sends
each request's ``priority`` to the workers, whose schedulers serve lower values first
(``engine/scheduler.py``); under the default ``fcfs`` a priority other than 0 is a 400
(``tests/test_router_http.py``).

One in-process cluster for the module (the demo model, a real Redis, real gRPC between
router and workers, the router behind a real HTTP port), its decode worker running one
sequence at a time, so that requests queue there. The last test drives the decode worker's
own KV-pull allocation (``DecodeService._allocate``) against its real engine."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from inproc_cluster import in_process_cluster

MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    one_at_a_time = {"max_num_seqs": 1}
    with in_process_cluster(tmp_path_factory.mktemp("priority"), MAX_MODEL_LEN,
                            scheduling_policy="priority", decode_engine=one_at_a_time,
                            prefill_engine=one_at_a_time) as cluster:
        yield cluster


def wait_waiting(cluster, count: int, timeout_s: float = 30.0) -> None:
    """Until the decode worker's queue holds ``count`` requests."""
    deadline = time.monotonic() + timeout_s
    while cluster.decode.runtime.health().num_waiting < count:
        assert time.monotonic() < deadline, "the requests did not queue at the decode worker"
        time.sleep(0.01)


def test_a_lower_priority_value_is_served_first(cluster):
    """While a long request decodes alone, one of priority 5 queues, then one of -1: the
    later, more urgent one is served first (first come, first served would serve the
    priority-5 one first), and every request completes whole."""
    client = cluster.async_client()
    model = str(cluster.model)
    started: dict[str, float] = {}  # the first chunk (a prefill worker's first token)
    finished: dict[str, float] = {}

    async def stream(name: str, priority: int, max_tokens: int) -> int:
        chunks = await client.completions.create(
            model=model, prompt=f"request {name}", max_tokens=max_tokens, stream=True,
            extra_body={"priority": priority, "ignore_eos": True}, temperature=0)
        tokens = 0
        async for chunk in chunks:
            started.setdefault(name, time.monotonic())
            if chunk.usage is None and chunk.choices:
                tokens += 1
        finished[name] = time.monotonic()
        return tokens

    async def run() -> list[int]:
        long = asyncio.create_task(stream("long", 0, 200))
        while "long" not in started:
            await asyncio.sleep(0.005)
        later = asyncio.create_task(stream("later", 5, 4))
        await asyncio.to_thread(wait_waiting, cluster, 1)
        urgent = asyncio.create_task(stream("urgent", -1, 4))
        await asyncio.to_thread(wait_waiting, cluster, 2)
        assert not finished
        return await asyncio.wait_for(asyncio.gather(long, later, urgent), 120)

    counts = asyncio.run(run())
    assert counts[1:] == [4, 4] and counts[0] >= 100
    assert finished["long"] < finished["urgent"] < finished["later"]
    cluster.wait_all_blocks_free()


@pytest.mark.parametrize("priority, status", [(-7, 200), (2**31 - 1, 200), (2**31, 400),
                                              ("high", 400), (1.5, 400)])
def test_priority_takes_any_int32(cluster, priority, status):
    with httpx.Client(base_url=cluster.url, timeout=60) as http:
        reply = http.post("/v1/completions", json={
            "model": str(cluster.model), "prompt": "x", "max_tokens": 2,
            "priority": priority})
    assert reply.status_code == status, reply.text
    if status == 400:
        assert reply.json()["error"]["param"] == "priority"


def test_grpc_takes_priority_and_a_fcfs_router_refuses_it(cluster):
    """Over the router's gRPC API: a priority is served under this router's ``priority``
    policy; the same request to a router under ``fcfs`` is INVALID_ARGUMENT naming the
    field, and one of priority 0 is served there."""
    import dataclasses

    import grpc

    from pdserve.proto import common_pb2, router_pb2, router_pb2_grpc
    from pdserve.router.grpc_server import GRPCLimits, start_grpc_server

    def call(coro):
        return asyncio.run_coroutine_threadsafe(coro, cluster.loop).result(30)

    def generate(stub, priority: int) -> list:
        return list(stub.Generate(router_pb2.GenerateRequest(
            text="x", priority=priority, sampling_params=common_pb2.SamplingParams(
                temperature=0.0, max_tokens=2, ignore_eos=True)), timeout=30))

    router = cluster.router
    policy = router.config
    server, port = call(start_grpc_server(router, "127.0.0.1", 0, limits=GRPCLimits()))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            served = generate(stub, -3)
            router.config = dataclasses.replace(policy, scheduling_policy="fcfs")
            with pytest.raises(grpc.RpcError) as refused:
                generate(stub, 2)
            also_served = generate(stub, 0)
    finally:
        router.config = policy
        call(server.stop(0))
    assert sum(len(m.token_ids) for m in served) == 2
    assert sum(len(m.token_ids) for m in also_served) == 2
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "priority" in refused.value.details()
    assert "--scheduling-policy priority" in refused.value.details()
    cluster.wait_all_blocks_free()


def test_a_decode_worker_allocates_for_the_more_urgent_kv_pull_first(cluster):
    """Two requests whose KV is to be pulled wait for blocks on the real decode worker
    (its blocks held by requests admitted directly into its engine): when blocks for one
    of them come free, the later, more urgent one (-1) takes them while the earlier one
    (priority 5) keeps waiting; it gets its blocks once those are free again."""
    from pdserve.engine import SamplingParams

    service, loop = cluster.decode.service, cluster.loop
    engine = service.engine

    def call(coro, timeout_s: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout_s)

    def prompt(seed: int, length: int) -> list[int]:
        return [5 + (seed * 7919 + i * 104729) % 200 for i in range(length)]

    def admit(request_id: str, tokens: list[int]):
        return call(engine.call(lambda e: e.add_kv_transfer_request(
            request_id, tokens, 1, SamplingParams(max_tokens=4))))

    def drop(request_id: str) -> None:
        call(engine.call(lambda e: e.finish_kv_transfer(request_id, False)))

    total = engine.engine.num_blocks  # 64 blocks of 16 tokens
    holders = [f"holder-{i}" for i in range(4)]
    for i, name in enumerate(holders):  # 240 tokens each (prompt + first token): 15 blocks
        assert admit(name, prompt(100 + i, 239)) is not None
    assert engine.engine.num_free_blocks() == total - 60

    async def race():
        later = asyncio.create_task(service._allocate(
            "later", prompt(1, 200), SamplingParams(max_tokens=4), None, 1, None, 5))
        while "later" not in service._allocating:
            await asyncio.sleep(0.005)
        urgent = asyncio.create_task(service._allocate(
            "urgent", prompt(2, 200), SamplingParams(max_tokens=4), None, 1, None, -1))
        while "urgent" not in service._allocating:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.1)  # both have tried and wait: 13 blocks each, 4 free
        await engine.call(lambda e: e.finish_kv_transfer(holders[0], False))  # 19 free
        done, _ = await asyncio.wait([later, urgent], timeout=10,
                                     return_when=asyncio.FIRST_COMPLETED)
        first = [t is urgent for t in done]
        await asyncio.sleep(0.1)  # the other keeps waiting: 6 blocks are left
        still_waiting = not later.done()
        await engine.call(lambda e: e.finish_kv_transfer("urgent", False))
        await asyncio.wait_for(later, 10)
        return first, still_waiting

    first, still_waiting = call(race(), 60)
    assert first == [True] and still_waiting
    for name in ["later", *holders[1:]]:
        drop(name)
    assert not service._allocating
    cluster.wait_all_blocks_free()
