"""Scheduler: token budget, max_num_seqs, decodes first, preemption, abort accounting."""

from __future__ import annotations

from pdserve.engine.block_hash import root_block_hash
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler, SchedulerConfig


def make_request(request_id: str, num_prompt_tokens: int, max_tokens: int = 8) -> Request:
    prompt = [hash((request_id, i)) % 1000 for i in range(num_prompt_tokens)]
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens), frozenset(),
                   max_tokens)


def make_scheduler(num_blocks=32, block_size=4, **config) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, root_block_hash("m", block_size))
    return Scheduler(SchedulerConfig(**{"max_model_len": 128, **config}), kv)


def run_step(scheduler: Scheduler, token: int = 7):
    """Schedule, pretend the model ran, and sample ``token`` for each finished prompt."""
    out = scheduler.schedule()
    sampled = {r.request_id: [(token, None)]
               for r, n in zip(out.requests, out.num_scheduled_tokens)
               if r.num_computed_tokens + n == r.num_tokens}
    scheduler.update_from_output(out, sampled)
    return out


def scheduled(out) -> dict[str, int]:
    return {r.request_id: n for r, n in zip(out.requests, out.num_scheduled_tokens)}


def test_token_budget_chunks_prefill():
    scheduler = make_scheduler(max_num_batched_tokens=10)
    scheduler.add_request(make_request("a", 25))
    assert scheduled(run_step(scheduler)) == {"a": 10}
    assert scheduled(run_step(scheduler)) == {"a": 10}
    assert scheduled(run_step(scheduler)) == {"a": 5}  # prompt done: first token sampled
    assert scheduler.requests["a"].output_token_ids == [7]
    assert scheduled(run_step(scheduler)) == {"a": 1}  # decode


def test_decodes_first_then_prefill_chunks_within_budget():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(make_request("a", 4))
    run_step(scheduler)  # a prefilled, now decoding
    scheduler.add_request(make_request("b", 20))
    out = run_step(scheduler)
    assert scheduled(out) == {"a": 1, "b": 7}
    assert [r.request_id for r in out.requests] == ["a", "b"]


def test_max_num_seqs_limits_running():
    scheduler = make_scheduler(max_num_seqs=2)
    for name in "abc":
        scheduler.add_request(make_request(name, 3))
    assert set(scheduled(run_step(scheduler))) == {"a", "b"}
    assert [r.request_id for r in scheduler.waiting] == ["c"]


def test_preemption_recomputes_latest_request():
    # 4 blocks of 4 tokens: a (7 tokens) and b (7 tokens) take 2 blocks each; when a
    # needs a third block, b (admitted last) is preempted and re-queued at the front.
    scheduler = make_scheduler(num_blocks=4, max_num_batched_tokens=64)
    scheduler.add_request(make_request("a", 7, max_tokens=4))
    scheduler.add_request(make_request("b", 7, max_tokens=4))
    run_step(scheduler)
    assert scheduler.requests["a"].num_computed_tokens == 7
    out = run_step(scheduler)  # a: token 8 fits block 2; b too
    out = run_step(scheduler)  # a needs a 3rd block for token 9
    assert [r.request_id for r in out.preempted] == ["b"]
    b = scheduler.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert scheduler.waiting[0] is b and b.num_tokens == 9  # its outputs are kept
    while scheduler.num_unfinished:
        run_step(scheduler)
    assert b.output_token_ids == [7, 7, 7, 7]
    assert scheduler.kv.pool.num_free_blocks == 4


def test_abort_frees_blocks_in_prefill_and_decode():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(make_request("prefilling", 30))
    scheduler.add_request(make_request("waiting", 5))
    run_step(scheduler)
    assert scheduler.kv.pool.num_free_blocks < 32
    scheduler.abort_request("prefilling")
    scheduler.abort_request("waiting")
    assert scheduler.kv.pool.num_free_blocks == 32 and not scheduler.requests

    scheduler.add_request(make_request("decoding", 5))
    run_step(scheduler)
    run_step(scheduler)
    assert scheduler.abort_request("decoding").status == RequestStatus.FINISHED_ABORTED
    assert scheduler.kv.pool.num_free_blocks == 32 and not scheduler.kv.req_to_blocks
    assert scheduler.abort_request("unknown") is None


def test_length_and_stop_finish():
    scheduler = make_scheduler()
    req = make_request("a", 3, max_tokens=2)
    scheduler.add_request(req)
    run_step(scheduler)
    run_step(scheduler)
    assert req.status == RequestStatus.FINISHED_LENGTH and req.output_token_ids == [7, 7]

    stop = Request("s", [1, 2], SamplingParams(stop_token_ids=[7]), frozenset(), 8)
    scheduler.add_request(stop)
    run_step(scheduler)
    assert stop.status == RequestStatus.FINISHED_STOPPED and stop.stop_reason == 7
