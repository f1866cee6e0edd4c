"""Tensor parallelism inside a worker (issue 27; ``engine/parallel.py``,
``engine/tp_executor.py``), on the CPU over gloo: KV heads replicated when there are fewer
than ranks, a vocabulary that does not split evenly, prompt logprobs, each rank's share of
the KV cache, the refusals, and a rank killed with SIGKILL (rank 0 fails the step and
stops; the other ranks exit when rank 0 is killed). Every family's equality with
transformers at TP=2 is in ``test_families.py``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import transformers
from conftest import random_prompts

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.async_engine import AsyncEngine, EngineDeadError
from pdserve.engine.config import UnsupportedModelError
from pdserve.engine.engine_config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.tp_executor import RankFailedError

VOCAB = 509  # NOTE: odd, so rank 1's vocabulary shard ends in a padding row
NEW_TOKENS = 12


def _write(path, **fields):
    config = transformers.LlamaConfig(**{
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 1, "intermediate_size": 96, "vocab_size": VOCAB,
        "max_position_embeddings": 512, **fields})
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def mqa_checkpoint(tmp_path_factory):
    """One KV head (multi-query attention): both ranks hold it."""
    return _write(tmp_path_factory.mktemp("tp") / "mqa")


@pytest.fixture(scope="module")
def tp2(mqa_checkpoint):
    llm = LLM(mqa_checkpoint, dtype="float32", load_progress=False, tensor_parallel_size=2,
              max_num_batched_tokens=32, max_model_len=256)
    yield llm
    llm.shutdown()


def test_replicated_kv_heads_and_padded_vocabulary_equal_one_rank(mqa_checkpoint, tp2):
    prompts = random_prompts([3, 17, 40], vocab_size=VOCAB, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                            logprobs=3, prompt_logprobs=2)
    one = LLM(mqa_checkpoint, dtype="float32", load_progress=False, max_model_len=256)
    expected = one.generate(prompts, params)
    got = tp2.generate(prompts, params)
    for ref, out in zip(expected, got):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        for ref_step, step in zip(ref.outputs[0].logprobs, out.outputs[0].logprobs):
            assert step.keys() == ref_step.keys()
            for token, lp in step.items():
                assert lp.logprob == pytest.approx(ref_step[token].logprob, abs=1e-4)
        assert len(out.prompt_logprobs) == len(ref.prompt_logprobs)
        for ref_pos, pos in zip(ref.prompt_logprobs[1:], out.prompt_logprobs[1:]):
            assert pos.keys() == ref_pos.keys()
    # the same blocks of one KV head (replicated) on each rank; the vocabulary's
    # shards end past it, the LM head's padding row never sampled
    assert tp2.engine.model_runner.kv_layout.block_bytes == \
        one.engine.model_runner.kv_layout.block_bytes
    assert tp2.engine.model_runner.model.model.embed_tokens.weight.shape[0] == (VOCAB + 1) // 2


def test_each_rank_caches_its_share_of_the_kv_heads(tmp_path):
    path = _write(tmp_path / "gqa", num_key_value_heads=2)
    one = LLM(path, dtype="float32", load_progress=False, max_model_len=128)
    two = LLM(path, dtype="float32", load_progress=False, max_model_len=128,
              tensor_parallel_size=2)
    try:
        assert two.engine.model_runner.kv_layout.block_bytes * 2 == \
            one.engine.model_runner.kv_layout.block_bytes
        assert two.engine.model_runner.kv_cache.shape[4] == 1  # [L, 2, blocks, bs, H_kv, D]
        prompt = random_prompts([30], vocab_size=VOCAB, seed=5)
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        assert two.generate(prompt, params)[0].outputs[0].token_ids == \
            one.generate(prompt, params)[0].outputs[0].token_ids
    finally:
        two.shutdown()


def test_a_size_the_heads_do_not_split_into_is_refused_at_once(tmp_path):
    path = _write(tmp_path / "three", num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=90)
    started = time.monotonic()
    with pytest.raises(UnsupportedModelError, match="tensor_parallel_size=4 does not divide "
                       "intermediate_size=90"):
        LLM(path, dtype="float32", load_progress=False, tensor_parallel_size=4)
    with pytest.raises(UnsupportedModelError, match="num_attention_heads=4"):
        LLM(path, dtype="float32", load_progress=False, tensor_parallel_size=3)
    assert time.monotonic() - started < 5.0


def test_quantized_weights_under_tensor_parallelism_are_refused(mqa_checkpoint):
    with pytest.raises(UnsupportedModelError, match="tensor_parallel_size=2 with quantized "
                       "weights"):
        LLM(mqa_checkpoint, load_progress=False, tensor_parallel_size=2, quantization="int8")


def test_a_rank_killed_mid_generation_fails_the_step_without_a_hang(mqa_checkpoint):
    llm = LLM(mqa_checkpoint, dtype="float32", load_progress=False, tensor_parallel_size=2,
              max_model_len=512)
    rank = llm.engine.model_runner.executor.pids[0]
    prompts = random_prompts([20] * 4, vocab_size=VOCAB, seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=480, ignore_eos=True)
    killer = threading.Timer(0.5, os.kill, (rank, signal.SIGKILL))
    started = time.monotonic()
    killer.start()
    try:
        with pytest.raises(RankFailedError):
            for _ in range(100):  # NOTE: the kill lands inside one of these
                llm.generate(prompts, params)
    finally:
        killer.join()
    assert time.monotonic() - started < 30.0
    assert llm.engine.is_idle_and_clean()  # the failed step's requests were aborted
    llm.shutdown()


def test_a_served_engine_whose_rank_dies_stops_and_fails_its_requests(mqa_checkpoint):
    """``AsyncEngine``: the worker is dead as a whole (its requests fail, ``alive`` is
    False: a worker server reports itself unhealthy and the router moves its streams)."""
    import asyncio

    engine = AsyncEngine.build(lambda: LLMEngine(EngineConfig(
        mqa_checkpoint, dtype="float32", load_progress=False, tensor_parallel_size=2,
        max_model_len=512)))

    async def run():
        params = SamplingParams(temperature=0.0, max_tokens=480, ignore_eos=True)
        stream = engine.generate("r0", list(range(5, 25)), params)
        first = await asyncio.wait_for(anext(aiter(stream)), 30)
        assert first.new_token_ids
        os.kill(engine.engine.model_runner.executor.pids[0], signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="the engine stopped: tensor-parallel"):
            async with asyncio.timeout(30):
                async for _ in stream:
                    pass

    try:
        asyncio.run(run())
        deadline = time.monotonic() + 10
        while engine.alive and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not engine.alive
    finally:
        engine.shutdown()


def test_the_other_ranks_exit_when_rank_0_is_killed(mqa_checkpoint):
    script = textwrap.dedent(f"""
        import sys, time
        from pdserve.engine import LLM
        if __name__ == "__main__":
            llm = LLM({mqa_checkpoint!r}, dtype="float32", load_progress=False,
                      tensor_parallel_size=2)
            print(*llm.engine.model_runner.executor.pids, flush=True)
            time.sleep(120)
    """)
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                               text=True)
    try:
        rank = int(process.stdout.readline())
    finally:
        process.kill()
        process.wait(10)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            os.kill(rank, 0)
        except ProcessLookupError:
            return
        try:  # NOTE: reaped by init, or a zombie of the killed parent until then
            with open(f"/proc/{rank}/stat") as stat:
                if stat.read().split()[2] == "Z":
                    return
        except FileNotFoundError:
            return
        time.sleep(0.1)
    os.kill(rank, signal.SIGKILL)
    pytest.fail("rank 1 outlived its rank 0 by 15 s")


def test_a_worker_refuses_tensor_parallelism_with_a_quantized_kv_cache(mqa_checkpoint):
    from pdserve.cluster.worker_config import WorkerConfig

    with pytest.raises(ValueError, match="kv_cache_dtype 'auto' only"):
        WorkerConfig("decode", EngineConfig(mqa_checkpoint, tensor_parallel_size=2,
                                            kv_cache_dtype="int8"))


def test_serve_takes_a_tensor_parallel_size_per_pool():
    import argparse

    from pdserve.entrypoints.serve import add_serve_args
    from pdserve.entrypoints.serve_models import pool_engine_config, pool_flags

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(["--decode-tensor-parallel-size", "2",
                              "--prefill-engine-args", "--max-num-seqs 8"])
    base = EngineConfig("model")
    decode = pool_engine_config(base, pool_flags(args, "decode"), "decode")
    prefill = pool_engine_config(base, pool_flags(args, "prefill"), "prefill")
    assert (decode.tensor_parallel_size, prefill.tensor_parallel_size) == (2, 1)
    assert prefill.max_num_seqs == 8
