"""``--kv-cache-dtype`` in the engine: int8 / fp8 caches and their sizing, greedy output
close to a float cache's, and the KV dtype in the prefix-cache identity.

Tolerance of the greedy comparison: an int8 block stores each value within half a step,
1/254 of its (block, layer, K or V, kv head)'s largest magnitude; on these tiny random
models the chosen tokens' logprobs move by at most ~0.002 (fp8 e4m3, 3 mantissa bits:
~0.01; e5m2, 2 bits: ~0.02), and a bf16 model beside an fp32 one moves them by ~0.003.
The bound here is ten times that measure for int8 (0.02) and five times for fp8 (0.05,
0.1). Greedy tokens are equal up to the first token where the two runs differ, which
must be a near-tie of the float run: its top two logprobs within twice the bound. Random
weights give nearly flat distributions, where near-ties are common: e5m2 runs differ on
most prompts somewhere in 32 tokens.
"""

from __future__ import annotations

import argparse

import pytest
import torch
from conftest import random_prompts

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.args import add_engine_args, engine_kwargs
from pdserve.engine.block_hash import hash_block_chain, root_block_hash
from pdserve.engine.kv_cache_layout import KVCacheLayout

PROMPT_LENGTHS = [1, 3, 15, 16, 17, 40, 70, 129]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=2)
TOLERANCE = {"int8": 0.02, "fp8": 0.05, "fp8_e5m2": 0.1}
MIN_WHOLE = {"int8": 6, "fp8": 4, "fp8_e5m2": 2}
"""Of the 8 prompts, how many must give all 32 tokens of the fp32 cache's run."""
# chunked: blocks written across several steps; preemption: 24 blocks for 37 needed, so
# blocks are recycled and rewritten from slot 0 under a stale scale.
SETTINGS = {"chunked_prefill": {"max_num_batched_tokens": 24},
            "preemption": {"num_gpu_blocks_override": 24, "max_num_batched_tokens": 256}}


def test_the_kv_cache_dtype_is_part_of_the_block_hash_identity():
    auto = root_block_hash("m", 16)
    assert auto == root_block_hash("m", 16, "auto")  # float caches hash as before
    assert root_block_hash("m", 16, "fp8") == root_block_hash("m", 16, "fp8_e4m3")
    roots = {root_block_hash("m", 16, name) for name in ("auto", "int8", "fp8", "fp8_e5m2")}
    assert len(roots) == 4
    tokens = list(range(32))
    assert not set(hash_block_chain(tokens, 16, auto)) & set(
        hash_block_chain(tokens, 16, root_block_hash("m", 16, "int8")))
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        root_block_hash("m", 16, "int4")


def test_flag_reaches_the_engine_config():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args(["--model", "x", "--kv-cache-dtype", "fp8"]))[
        "kv_cache_dtype"] == "fp8"
    assert engine_kwargs(parser.parse_args(["--model", "x"]))["kv_cache_dtype"] == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "int4"])


@pytest.fixture(scope="module")
def model(tiny_checkpoints):
    return str(tiny_checkpoints["llama"])


def test_int8_holds_about_twice_the_blocks_of_bf16_in_the_same_memory(model):
    memory = 2 << 20
    bf16 = LLM(model, dtype="bfloat16", max_model_len=256, kv_cache_memory_bytes=memory,
               load_progress=False)
    int8 = LLM(model, dtype="bfloat16", kv_cache_dtype="int8", max_model_len=256,
               kv_cache_memory_bytes=memory, load_progress=False)
    assert int8.engine.num_blocks >= 1.9 * bf16.engine.num_blocks
    runner = int8.engine.model_runner
    layout = runner.kv_layout  # 2 layers x 2 x 16 tokens x 2 kv heads x 16: 2048 B of values
    assert (layout.values_bytes, layout.scales_offset, layout.block_bytes) == (2048, 2048, 2112)
    assert bf16.engine.model_runner.kv_layout.block_bytes == 4096
    assert int8.engine.num_blocks == memory // 2112 and bf16.engine.num_blocks == memory // 4096
    kv_cache, kv_scales = runner.kv_cache, runner.kv_scales
    assert kv_cache.dtype == torch.int8 and kv_scales.dtype == torch.float32
    assert kv_cache.stride(2) == layout.block_bytes == 4 * kv_scales.stride(2)
    # block b's scales lie inside its own bytes, after its values
    offset = kv_scales[0, 0, 3].data_ptr() - kv_cache[0, 0, 3].data_ptr()
    assert offset == layout.scales_offset


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))


def assert_close_greedy(float_outputs, quant_outputs, tolerance: float) -> int:
    """Tokens equal up to a near-tie of the float run, logprobs within ``tolerance``
    before it; returns how many of the outputs match all the way."""
    whole = 0
    for expected, actual in zip(float_outputs, quant_outputs):
        e, a = expected.outputs[0], actual.outputs[0]
        n = first_difference(e.token_ids, a.token_ids)
        for i in range(n):
            assert abs(e.logprobs[i][e.token_ids[i]].logprob
                       - a.logprobs[i][a.token_ids[i]].logprob) <= tolerance, i
        if n == len(e.token_ids):
            whole += 1
            continue
        top = sorted((lp.logprob for lp in e.logprobs[n].values()), reverse=True)
        assert top[0] - top[1] <= 2 * tolerance, f"not a near-tie at token {n}: {top}"
    return whole


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("kv_cache_dtype", list(TOLERANCE))
def test_greedy_with_a_quantized_cache_is_close_to_fp32s(model, kv_cache_dtype, setting):
    prompts = random_prompts(PROMPT_LENGTHS)
    common = dict(dtype="float32", max_model_len=256, load_progress=False, **SETTINGS[setting])
    expected = LLM(model, **common).generate(prompts, GREEDY)
    llm = LLM(model, kv_cache_dtype=kv_cache_dtype, **common)
    actual = llm.generate(prompts, GREEDY)
    if setting == "preemption":
        assert llm.engine.scheduler.num_preemptions_total > 0
    whole = assert_close_greedy(expected, actual, TOLERANCE[kv_cache_dtype])
    assert whole >= MIN_WHOLE[kv_cache_dtype]


def test_bf16_model_with_int8_cache_is_close_to_its_bf16_cache(model):
    prompts = random_prompts(PROMPT_LENGTHS)
    common = {"dtype": "bfloat16", "max_model_len": 256, "load_progress": False}
    expected = LLM(model, **common).generate(prompts, GREEDY)
    actual = LLM(model, kv_cache_dtype="int8", **common).generate(prompts, GREEDY)
    assert assert_close_greedy(expected, actual, 0.05) >= 4


def test_int8_prefix_cache_hits_and_hashes_apart_from_float(model):
    llm = LLM(model, dtype="float32", kv_cache_dtype="int8", max_model_len=256,
              load_progress=False)
    prompt = random_prompts([70], seed=3)
    first = llm.generate(prompt, GREEDY)[0]
    second = llm.generate(prompt, GREEDY)[0]
    assert second.num_cached_tokens == 64 and first.num_cached_tokens == 0
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    manager = llm.engine.kv_cache_manager
    assert manager.root_hash == root_block_hash(model, 16, "int8") != root_block_hash(model, 16)


def test_layout_of_each_dtype():
    for dtype, block_bytes in ((torch.int8, 2112), (torch.float8_e4m3fn, 2112),
                               (torch.float8_e5m2, 2112), (torch.bfloat16, 4096),
                               (torch.float32, 8192)):
        assert KVCacheLayout(2, 16, 2, 16, dtype).block_bytes == block_bytes
