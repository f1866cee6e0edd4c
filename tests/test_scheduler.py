"""Scheduler: token budget, max_num_seqs, decodes first, preemption, abort accounting,
priority order."""

from __future__ import annotations

from pdserve.engine.block_hash import root_block_hash
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler, SchedulerConfig


def make_request(request_id: str, num_prompt_tokens: int, max_tokens: int = 8,
                 priority: int = 0) -> Request:
    prompt = [hash((request_id, i)) % 1000 for i in range(num_prompt_tokens)]
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens), frozenset(),
                   max_tokens, priority=priority)


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


def test_priority_orders_the_queue_arrival_breaking_ties():
    scheduler = make_scheduler(max_num_seqs=1)
    for name, priority in [("a", 1), ("b", 0), ("c", 2), ("d", 0), ("e", 1), ("f", -5)]:
        scheduler.add_request(make_request(name, 3, max_tokens=1, priority=priority))
    assert [r.request_id for r in scheduler.waiting] == ["f", "b", "d", "a", "e", "c"]
    finished = []
    while scheduler.num_unfinished:
        out = run_step(scheduler)
        finished += [r.request_id for r in out.requests if r.request_id not in scheduler.requests]
    assert finished == ["f", "b", "d", "a", "e", "c"]


def test_the_more_urgent_running_request_gets_blocks_first():
    # 4 blocks of 4 tokens. "urgent" (priority -1) is admitted after "low" (priority 1)
    # and scheduled before it, so when both need a third block, low preempts itself
    # (first come, first served would have scheduled low first and preempted urgent), and
    # it is requeued before the waiting request of its own priority.
    scheduler = make_scheduler(num_blocks=4, max_num_batched_tokens=64)
    scheduler.add_request(make_request("low", 7, max_tokens=4, priority=1))
    run_step(scheduler)
    scheduler.add_request(make_request("urgent", 7, max_tokens=4, priority=-1))
    run_step(scheduler)  # low decodes token 8 (block 2 full), urgent prefills 2 blocks
    scheduler.add_request(make_request("later", 3, max_tokens=1, priority=1))
    out = run_step(scheduler)  # urgent first: token 8; low needs a 3rd block: itself
    assert [r.request_id for r in out.preempted] == ["low"]
    assert [r.request_id for r in scheduler.waiting] == ["low", "later"]
    assert scheduler.requests["urgent"].status == RequestStatus.RUNNING
    out = run_step(scheduler)  # urgent needs a 3rd block: nothing of lower priority runs
    assert scheduled(out) == {"urgent": 1} and not out.preempted
    while scheduler.num_unfinished:
        run_step(scheduler)
    assert scheduler.kv.pool.num_free_blocks == 4


def test_the_victim_is_the_running_request_of_the_highest_priority_value():
    scheduler = make_scheduler(num_blocks=6, max_num_batched_tokens=64)
    for name, priority in [("mid", 0), ("low", 3), ("high", -2)]:
        scheduler.add_request(make_request(name, 7, max_tokens=4, priority=priority))
    run_step(scheduler)  # 2 blocks each
    run_step(scheduler)  # token 8 each: block 2 full
    out = run_step(scheduler)  # high, mid need a 3rd block: low goes (admitted second)
    assert [r.request_id for r in out.preempted] == ["low"]
    assert set(scheduled(out)) == {"high", "mid"}


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
