"""The request path's routing arrays (router/workers.py -> router/route.py): the pool's
handles write through to them, admission masks agree with ``admission_count``, members
joining, leaving or changing their record (same epoch) rebuild them. No workers: a fake
registry and channels that are never used."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools

import pytest

from pdserve.cluster.registry import WorkerRecord
from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.config import RouterConfig
from pdserve.router.generate_request import GenerateRequest
from pdserve.router.metrics import RouterMetrics
from pdserve.router.model_service import RoutingStep
from pdserve.router.protocol import RequestError
from pdserve.router.routing_policy import WorkerLoad, choose_decode_worker
from pdserve.router.workers import WorkerPool


class FakeRegistry:
    def __init__(self, records: list[WorkerRecord]) -> None:
        self.records = records
        self.rejected_ids: set[str] = set()

    def list_live(self) -> list[WorkerRecord]:
        return list(self.records)


def record(worker_id: str, role: str, compute: str = "") -> WorkerRecord:
    return WorkerRecord(worker_id, role, "127.0.0.1:1", "127.0.0.1:2", 7, "m", 0.0,
                        compute=compute)


def make_pool(records, **config) -> tuple[WorkerPool, FakeRegistry]:
    registry = FakeRegistry(records)
    pool = WorkerPool(registry, RouterConfig("m", "redis://127.0.0.1:1/0", **config))
    return pool, registry


def run(coro):
    return asyncio.run(coro)


def test_handles_write_through_and_routed_counts_read_back():
    async def main():
        pool, _ = make_pool([record(f"d{i}", "decode") for i in range(3)])
        await pool.refresh()
        router, handles = pool.router, pool.workers["decode"]
        for i, handle in enumerate(handles.values()):
            handle.healthy = True
            handle.load = WorkerLoad(handle.worker_id, num_running=i, num_waiting=0,
                                     kv_cache_usage=0.1 * i)
        handles["d0"].load = WorkerLoad("d0", 5, 0, 0.5)  # d1 is now the least loaded
        position = router.decide_decode(10, None, router.decode.live())
        assert router.decode.ids[position] == "d1"
        assert handles["d1"].num_routed == 1  # the decision counted itself
        handles["d1"].num_routed = 0  # a Health answer
        assert router.decode.routed.tolist() == [0, 0, 0]
        handles["d1"].healthy = False
        assert router.decode.live().tolist() == [True, False, True]
        assert router.decode.live({"d0", "d2"}).tolist() == [False, True, False]
        await pool.close()

    run(main())


def test_admission_masks_agree_with_admission_count():
    async def main():
        pool, _ = make_pool([record(f"d{i}", "decode") for i in range(6)])
        await pool.refresh()
        arrays = pool.router.decode
        for i, handle in enumerate(pool.workers["decode"].values()):
            handle.load = WorkerLoad(handle.worker_id, i, i % 3, 0.2 * i)
            handle.num_inflight = i % 4
            handle.num_inflight_at_health = i % 2
        for cap, kv in itertools.product(range(8), (None, 0.5, 1.0)):
            expected = [w.admission_count() < cap and (kv is None or w.load.kv_cache_usage < kv)
                        for w in pool.workers["decode"].values()]
            assert arrays.below_caps(cap, kv).tolist() == expected
        await pool.close()

    run(main())


def test_joining_and_leaving_rebuild_the_arrays_and_keep_state():
    async def main():
        pool, registry = make_pool([record("d1", "decode"), record("p1", "prefill")])
        await pool.refresh()
        pool.workers["decode"]["d1"].load = WorkerLoad("d1", 3, 1, 0.25)
        pool.workers["decode"]["d1"].num_routed = 2
        registry.records.append(record("d0", "decode"))
        await pool.refresh()
        arrays = pool.router.decode
        assert arrays.ids == ["d0", "d1"]
        assert arrays.table[:, 1].tolist() == [0.25, 3, 1, 2]
        registry.records = [r for r in registry.records if r.worker_id != "d1"]
        await pool.refresh()  # d1 never answered Health: it leaves
        assert pool.router.decode.ids == ["d0"]
        await pool.close()

    run(main())


def test_a_new_record_in_the_same_epoch_is_picked_up():
    """A worker's compute after a CPU re-split (``WorkerRegistry.update``): the pool
    keeps the new record, and the routing arrays see the new placement."""
    async def main():
        pool, registry = make_pool([record("d", "decode", "cpu@h:0-3"),
                                    record("p", "prefill", "cpu@h:2-5")],
                                   disaggregation="auto", local_prefill_threshold=1)
        await pool.refresh()
        handle = pool.workers["prefill"]["p"]
        assert pool.router.apart.tolist() == [[0]]  # shares cpus 2-3 with the decode worker
        decision = pool.router.decide(64, 4, None)
        assert decision.reason == "shared_compute"
        registry.records[1] = dataclasses.replace(registry.records[1], compute="cpu@h:4-7")
        await pool.refresh()
        assert pool.workers["prefill"]["p"] is handle  # same worker, same channel
        assert handle.record.compute == "cpu@h:4-7"
        assert pool.router.apart.tolist() == [[1]]
        decision = pool.router.decide(64, 4, None)
        assert (decision.prefill_worker_id, decision.reason) == ("p", "remote")
        await pool.close()

    run(main())


def test_rotation_goes_on_across_rebuilds():
    """Ties take turns through a rebuild, as they did with one counter per service."""
    async def main():
        pool, registry = make_pool([record("d0", "decode"), record("d1", "decode")])
        await pool.refresh()
        loads = [WorkerLoad("d0"), WorkerLoad("d1")]
        got = [pool.router.decode.ids[pool.router.decide_decode(4, None, None)]]
        pool.workers["decode"]["d0"].num_routed = 0
        pool.workers["decode"]["d1"].num_routed = 0
        registry.records.append(record("p", "prefill"))
        await pool.refresh()
        got.append(pool.router.decode.ids[pool.router.decide_decode(4, None, None)])
        assert got == [choose_decode_worker(loads, rotation=r) for r in range(2)]
        await pool.close()

    run(main())


def test_the_python_scoring_agrees_where_the_extension_is_missing(monkeypatch):
    from pdserve.router import route

    async def main():
        pool, _ = make_pool([record(f"d{i}", "decode") for i in range(4)]
                            + [record(f"p{i}", "prefill") for i in range(4)])
        await pool.refresh()
        for known in pool.workers.values():
            for i, handle in enumerate(known.values()):
                handle.load = WorkerLoad(handle.worker_id, i % 2, 0, 0.0)
        overlaps = {"p2": 3, "d3": 4}
        pool._rotation.update(prefill=itertools.count(), decode=itertools.count())
        native = [pool.router.decide(64, 4, overlaps) for _ in range(6)]
        monkeypatch.setattr(route, "_native", False)
        pool._rotation.update(prefill=itertools.count(), decode=itertools.count())
        for handle in (h for known in pool.workers.values() for h in known.values()):
            handle.num_routed = 0
        python = [pool.router.decide(64, 4, overlaps) for _ in range(6)]
        assert [(d.decode_worker_id, d.prefill_worker_id, d.reason) for d in python] == \
            [(d.decode_worker_id, d.prefill_worker_id, d.reason) for d in native]
        assert len({d.prefill_worker_id for d in python}) > 1  # ties and loads took turns
        await pool.close()

    run(main())


class FakeRedisIndex:
    """The Redis index's interface (``longest_prefix``), as the request path asks it
    where the native extension is not built."""

    def __init__(self, overlaps: dict[str, int]) -> None:
        self.overlaps = overlaps

    def longest_prefix(self, hashes, worker_ids, clean_stale=True) -> dict[str, int]:
        return {w: n for w, n in self.overlaps.items() if w in set(worker_ids)}


def make_step(records, overlaps=None, **config):
    pool, _ = make_pool(records, **config)
    step = RoutingStep(pool.config, pool, RouterMetrics("m"),
                       FakeRedisIndex(overlaps or {}), bytes(16))
    return step, pool


def request(num_tokens: int):
    return GenerateRequest("r", list(range(num_tokens)), SamplingParams())


def exposition(step) -> str:
    return step.metrics.exposition().decode()


def test_the_routing_step_keeps_the_request_paths_rules():
    """Admission caps and their 503s and metrics, retries past the caps, exclusion, the
    prefill path's reasons, in-flight bookkeeping; the Redis index's mapping answer."""
    async def main():
        step, pool = make_step([record("d0", "decode", "cpu@h:0-1"),
                                record("d1", "decode", "cpu@h:2-3"),
                                record("p0", "prefill", "cpu@h:4-5")],
                               overlaps={"d1": 4, "p0": 2}, decode_max_inflight=1,
                               prefill_max_inflight=1, block_size=16,
                               local_prefill_threshold=16)
        await pool.refresh()
        for known in pool.workers.values():
            for w in known.values():
                w.healthy = True
        num_blocks, counts = await step.prefix_counts(request(128))
        assert (num_blocks, counts) == (8, {"d1": 4, "p0": 2})
        router = pool.router
        decode, i = step.choose_decode(router, set(), True, counts, 128)
        assert decode.worker_id == "d1"  # holds half of the prompt
        decode.num_inflight += 1
        prefill = step.choose_prefill(router, i, set(), True, counts, 128, num_blocks)
        assert prefill.worker_id == "p0" and prefill.num_inflight == 1
        assert prefill.num_routed == 1
        # p0 is at its cap: auto prefills on the decode worker, counted as prefill_busy
        decode, i = step.choose_decode(router, set(), True, None, 128)
        assert decode.worker_id == "d0"
        decode.num_inflight += 1
        assert step.choose_prefill(router, i, set(), True, None, 128, 8) is None
        assert 'reason="prefill_busy"' in exposition(step)
        # both decode workers are at their cap: 503 decode_pool_full; a retry is not capped
        with pytest.raises(RequestError) as error:
            step.choose_decode(router, set(), True, None, 128)
        assert error.value.status == 503
        assert 'reason="decode_pool_full"' in exposition(step)
        decode, _ = step.choose_decode(router, {"d1"}, False, None, 128)
        assert decode.worker_id == "d0"
        with pytest.raises(RequestError, match="no live decode worker"):
            step.choose_decode(router, {"d0", "d1"}, False, None, 128)
        # every prefill worker excluded: no_prefill_worker; short prompts stay local
        assert step.choose_prefill(router, 0, {"p0"}, False, None, 128, 8) is None
        assert 'reason="no_prefill_worker"' in exposition(step)
        assert step.choose_prefill(router, 0, set(), False, None, 8, 0) is None
        assert 'reason="short_prompt"' in exposition(step)
        await pool.close()

    run(main())


def test_always_disaggregated_at_capacity_is_a_503():
    async def main():
        step, pool = make_step([record("d0", "decode"), record("p0", "prefill")],
                               disaggregation="always", prefill_max_inflight=1)
        await pool.refresh()
        pool.workers["prefill"]["p0"].num_inflight = 1
        router = pool.router
        _, i = step.choose_decode(router, set(), True, None, 64)
        with pytest.raises(RequestError) as error:
            step.choose_prefill(router, i, set(), True, None, 64, 4)
        assert error.value.status == 503
        assert 'reason="prefill_pool_full"' in exposition(step)
        prefill = step.choose_prefill(router, i, set(), False, None, 64, 4)  # a retry
        assert prefill.worker_id == "p0"
        await pool.close()

    run(main())
