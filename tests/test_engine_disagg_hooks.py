"""The engine's hooks for disaggregation, in one process: a prefill engine that holds its
blocks after the first token, and a decode engine that imports them (copied here with the
block gather/scatter kernels; the real transfer between processes is tested in
test_kvtransfer and the worker integration tests)."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts

from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.request import RequestStatus
from pdserve.kernels.block_copy import gather_blocks, scatter_blocks

PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def make_engine(path) -> LLMEngine:
    return LLMEngine(EngineConfig(str(path), dtype="float32", max_model_len=256,
                                  max_num_batched_tokens=64, load_progress=False))


def run(engine: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


@pytest.fixture(scope="module")
def engines(tiny_checkpoints):
    path = tiny_checkpoints["qwen3"]
    return make_engine(path), make_engine(path), make_engine(path)


def disaggregated(prefill: LLMEngine, decode: LLMEngine, request_id: str, prompt: list[int]):
    prefill.add_request(request_id, prompt, PARAMS, remote_decode=True)
    first = run(prefill)[request_id]
    assert len(first) == 1
    held = prefill.held_block_ids(request_id)
    alloc = decode.add_kv_transfer_request(request_id, prompt, first[0], PARAMS)
    assert alloc is not None
    src = torch.tensor([held[i] for i in alloc.block_indices], dtype=torch.long)
    payload = gather_blocks(prefill.model_runner.kv_cache, src)
    scatter_blocks(decode.model_runner.kv_cache, torch.tensor(alloc.block_ids, dtype=torch.long),
                   payload)
    assert prefill.release_held(request_id)
    assert decode.finish_kv_transfer(request_id, ok=True)
    return first + run(decode)[request_id], alloc


def test_disaggregated_equals_colocated_and_pulls_only_missing_blocks(engines):
    prefill, decode, colocated = engines
    shared = random_prompts([80], seed=11)[0]
    first_prompt, second_prompt = shared + [1, 2, 3], shared + [4, 5]
    for rid, prompt in (("a", first_prompt), ("b", second_prompt)):
        colocated.add_request(rid, prompt, PARAMS)
    expected = run(colocated)

    tokens_a, alloc_a = disaggregated(prefill, decode, "a", first_prompt)
    assert tokens_a == expected["a"]
    assert alloc_a.block_indices == list(range(6))  # 83 tokens: 5 full blocks + 1 partial
    tokens_b, alloc_b = disaggregated(prefill, decode, "b", second_prompt)
    assert tokens_b == expected["b"]
    # The decode engine cached the 5 full shared blocks from "a": only the last is pulled.
    assert alloc_b.num_cached_tokens == 80 and alloc_b.block_indices == [5]
    assert prefill.is_idle_and_clean() and decode.is_idle_and_clean()


def test_abort_while_waiting_for_kv_frees_after_the_transfer_ends(engines):
    _, decode, _ = engines
    prompt = random_prompts([40], seed=12)[0]
    alloc = decode.add_kv_transfer_request("x", prompt, 7, PARAMS)
    assert decode.scheduler.requests["x"].status == RequestStatus.WAITING_FOR_KV
    assert decode.abort_request("x")
    # The transfer may still be writing into the blocks: they are not free yet.
    assert decode.num_free_blocks() == decode.num_blocks - len(alloc.block_ids)
    assert not decode.finish_kv_transfer("x", ok=True)
    assert decode.is_idle_and_clean()


def test_failed_transfer_ends_request(engines):
    _, decode, _ = engines
    decode.add_kv_transfer_request("y", random_prompts([20], seed=13)[0], 7, PARAMS)
    assert not decode.finish_kv_transfer("y", ok=False)
    assert decode.is_idle_and_clean()


def test_prefill_request_finished_by_its_first_token_holds_nothing(engines):
    """No decode will come for it, so no lease is made: its blocks go straight back."""
    prefill, _, _ = engines
    prefill.add_request("one", [5, 6, 7], SamplingParams(temperature=0, max_tokens=1),
                        remote_decode=True)
    outputs = [o for _ in range(2) for o in prefill.step()]
    assert outputs[0].finish_reason == "length"
    assert prefill.held_block_ids("one") is None
    assert prefill.is_idle_and_clean()


def prefill_one(engine, request_id: str, prompt: list[int]) -> list[int]:
    """Prefill ``prompt`` as a remote-decode request; returns its leased block ids."""
    engine.add_request(request_id, prompt, PARAMS, remote_decode=True)
    while engine.has_unfinished_requests():
        engine.step()
    return engine.held_block_ids(request_id)


def test_a_lease_is_made_in_the_step_that_finishes_the_prefill(engines):
    prefill, _, _ = engines
    block_ids = prefill_one(prefill, "leased", random_prompts([40], seed=14)[0])
    assert block_ids is not None and len(block_ids) == 3  # 40 tokens: 3 blocks of 16
    assert prefill.ownership().num_leases == 1
    assert prefill.ownership().num_leased_blocks == 3
    assert prefill.num_unowned_blocks() == 0
    assert prefill.abort_request("leased")  # an abort of a finished prefill ends its lease
    assert prefill.is_idle_and_clean() and prefill.num_unowned_blocks() == 0


def test_a_lease_expires_unless_it_is_being_sent(engines):
    import time

    prefill, _, _ = engines
    prefill_one(prefill, "expiring", random_prompts([20], seed=15)[0])
    prefill_one(prefill, "sending", random_prompts([20], seed=16)[0])
    assert prefill.begin_kv_send("sending")
    with pytest.raises(KeyError, match="already being sent"):
        prefill.begin_kv_send("sending")
    later = time.monotonic() + 3600
    assert prefill.expire_leases(later) == ["expiring"]
    prefill.end_kv_send("sending", ok=False)  # a failed send: the lease stands
    assert prefill.held_block_ids("sending") is not None
    assert prefill.begin_kv_send("sending")  # another decode worker may pull it
    prefill.end_kv_send("sending", ok=True)  # sent: unpinned into the prefix cache
    assert prefill.is_idle_and_clean()
    with pytest.raises(KeyError, match="no KV lease"):
        prefill.begin_kv_send("sending")


def test_a_lease_released_during_its_send_is_unpinned_when_the_send_ends(engines):
    prefill, _, _ = engines
    prefill_one(prefill, "given-up", random_prompts([20], seed=18)[0])
    block_ids = prefill.begin_kv_send("given-up")
    assert prefill.release_held("given-up")  # the router gave the KV up
    assert prefill.held_block_ids("given-up") == block_ids  # still read by the send
    with pytest.raises(KeyError):
        prefill.begin_kv_send("given-up")  # no other decode worker may take it now
    prefill.end_kv_send("given-up", ok=False)
    assert prefill.is_idle_and_clean() and prefill.num_unowned_blocks() == 0


def test_a_resumed_request_goes_on_as_if_undisturbed(engines):
    """A request migrated after k tokens, resumed with them, samples the same next tokens
    (seeded per position) as the request that was never moved."""
    prefill, _, _ = engines
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=10, ignore_eos=True)
    prompt = random_prompts([23], seed=17)[0]

    def run(request_id, resume=()):
        prefill.add_request(request_id, prompt, params, resume_token_ids=resume)
        tokens = list(resume)
        while prefill.has_unfinished_requests():
            tokens += [t for o in prefill.step() for t in o.new_token_ids]
        return tokens

    whole = run("whole")
    assert len(whole) == 10
    assert run("resumed", whole[:4]) == whole
    with pytest.raises(ValueError, match="nothing is left to generate"):
        prefill.add_request("done", prompt, params, resume_token_ids=whole)
    assert prefill.is_idle_and_clean()


def test_bad_first_token_is_refused_before_anything_is_allocated(engines):
    _, decode, _ = engines
    with pytest.raises(ValueError, match="first_token_id"):
        decode.add_kv_transfer_request("bad", [1, 2, 3], 10**6, PARAMS)
    assert decode.is_idle_and_clean()
