"""A prefill under a request id whose lease still stands (the router prefills again after a
failed pull, and may pick the same prefill worker before its Release lands): the old
lease's blocks must not be orphaned."""

from __future__ import annotations

import pytest
from conftest import random_prompts

from pdserve.engine import EngineConfig, LLMEngine, SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_checkpoints):
    return LLMEngine(EngineConfig(str(tiny_checkpoints["qwen3"]), dtype="float32",
                                  max_model_len=256, max_num_batched_tokens=64,
                                  load_progress=False))


def prefill(engine: LLMEngine, request_id: str, prompt: list[int]) -> None:
    engine.add_request(request_id, prompt, PARAMS, remote_decode=True)
    while engine.has_unfinished_requests():
        engine.step()


def test_a_second_prefill_under_a_held_id_releases_the_first_lease(engine):
    first, second = random_prompts([70, 90], seed=21)
    prefill(engine, "r", first)
    prefill(engine, "r", second)
    assert engine.release_held("r")
    assert engine.is_idle_and_clean()


def test_a_lease_replaced_during_its_send_is_unpinned_when_that_send_ends(engine):
    first, second = random_prompts([70, 90], seed=22)
    prefill(engine, "s", first)
    sent = engine.begin_kv_send("s")
    prefill(engine, "s", second)  # the router gave the first up and prefilled again
    assert engine.held_block_ids("s") != sent
    with pytest.raises(KeyError, match="already being sent"):
        engine.begin_kv_send("s")  # one send per request id at a time
    assert engine.ownership().num_leases == 2 and engine.num_unowned_blocks() == 0
    engine.end_kv_send("s", ok=True)  # the first lease's send: it alone is unpinned
    assert engine.ownership().num_leases == 1 and engine.num_unowned_blocks() == 0
    engine.begin_kv_send("s")
    engine.end_kv_send("s", ok=True)
    assert engine.is_idle_and_clean()
