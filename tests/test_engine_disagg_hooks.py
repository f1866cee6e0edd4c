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


def test_prefill_request_finished_by_its_first_token_still_holds_blocks(engines):
    prefill, _, _ = engines
    prefill.add_request("one", [5, 6, 7], SamplingParams(temperature=0, max_tokens=1),
                        remote_decode=True)
    outputs = [o for _ in range(2) for o in prefill.step()]
    assert outputs[0].finish_reason == "length"
    assert prefill.held_block_ids("one") is not None
    assert prefill.release_held("one") and not prefill.release_held("one")
    assert prefill.is_idle_and_clean()


def test_bad_first_token_is_refused_before_anything_is_allocated(engines):
    _, decode, _ = engines
    with pytest.raises(ValueError, match="first_token_id"):
        decode.add_kv_transfer_request("bad", [1, 2, 3], 10**6, PARAMS)
    assert decode.is_idle_and_clean()
