"""Engine behaviour end to end on a tiny checkpoint: prefix caching, aborts, block
accounting, sampling options, and refusals of what the engine cannot run."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import random_prompts, write_tiny_checkpoint

from pdserve.engine import LLM, EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.config import ModelConfig, UnsupportedModelError


@pytest.fixture(scope="module")
def llm(tiny_checkpoints):
    return LLM(str(tiny_checkpoints["llama"]), dtype="float32", max_model_len=256,
               max_num_batched_tokens=64, load_progress=False)


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_shared_prefix_hits_cache_and_gives_same_output(llm):
    prefix = random_prompts([64], seed=1)[0]
    first = llm.generate([prefix + [1, 2, 3]], GREEDY)[0]
    second = llm.generate([prefix + [1, 2, 3]], GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 64  # 4 full blocks of 16; the last token recomputed
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert llm.reset_prefix_cache()
    cold = llm.generate([prefix + [1, 2, 3]], GREEDY)[0]
    assert cold.num_cached_tokens == 0 and cold.outputs[0].token_ids == first.outputs[0].token_ids
    assert llm.engine.is_idle_and_clean()


def test_aborts_in_prefill_and_decode_free_every_block(llm):
    engine = llm.engine
    engine.add_request("long", random_prompts([200])[0], GREEDY)  # 4 chunks of 64
    engine.add_request("short", [5, 6, 7], GREEDY)
    engine.step()
    assert engine.scheduler.requests["long"].num_computed_tokens < 200  # mid-prefill
    assert engine.abort_request("long")
    for _ in range(3):
        engine.step()
    assert engine.scheduler.requests["short"].num_output_tokens >= 2  # mid-decode
    assert engine.abort_request("short")
    engine.add_request("queued", [1, 2], GREEDY)
    assert engine.abort_request("queued")
    assert not engine.abort_request("never-added")
    assert engine.is_idle_and_clean()


def test_priority_orders_the_queue_and_leaves_the_outputs_alone(llm):
    engine = llm.engine
    for name, priority in [("a", 2), ("b", -1), ("c", 2), ("d", 0)]:
        engine.add_request(name, [5, 6, 7], GREEDY, priority=priority)
    assert [r.request_id for r in engine.scheduler.waiting] == ["b", "d", "a", "c"]
    for name in "abcd":
        engine.abort_request(name)
    prompts = random_prompts([9, 17, 5], seed=4)
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    ranked = llm.generate(prompts, GREEDY, priority=[3, -2, 0])
    assert [o.outputs[0].token_ids for o in ranked] == plain
    with pytest.raises(ValueError, match="2 priority values for 3 prompts"):
        llm.generate(prompts, GREEDY, priority=[0, 1])
    assert engine.is_idle_and_clean()


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    prompts = random_prompts([5, 30, 9], seed=3)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=1234, max_tokens=16,
                            ignore_eos=True)
    together = llm.generate(prompts, seeded)
    alone = llm.generate([prompts[1]], seeded)[0]
    assert alone.outputs[0].token_ids == together[1].outputs[0].token_ids
    other_seed = llm.generate([prompts[1]], SamplingParams(
        temperature=0.8, top_p=0.9, top_k=50, seed=99, max_tokens=16, ignore_eos=True))[0]
    assert other_seed.outputs[0].token_ids != alone.outputs[0].token_ids


def test_top_k_one_is_greedy_and_n_gives_distinct_samples(llm):
    prompt = random_prompts([11], seed=4)
    greedy = llm.generate(prompt, GREEDY)[0].outputs[0].token_ids
    top1 = llm.generate(prompt, SamplingParams(temperature=1.5, top_k=1, max_tokens=12,
                                               ignore_eos=True))[0].outputs[0].token_ids
    assert top1 == greedy
    many = llm.generate(prompt, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12,
                                               ignore_eos=True))[0]
    assert [c.index for c in many.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in many.outputs}) == 3


def test_stop_tokens_min_tokens_and_eos(tiny_checkpoints):
    greedy = LLM(str(tiny_checkpoints["llama"]), dtype="float32", max_model_len=256,
                 load_progress=False)
    prompt = random_prompts([6], seed=5)
    tokens = greedy.generate(prompt, GREEDY)[0].outputs[0].token_ids
    stop = tokens[4]
    first = tokens.index(stop)
    out = greedy.generate(prompt, SamplingParams(temperature=0, max_tokens=12,
                                                 stop_token_ids=[stop]))[0].outputs[0]
    assert out.token_ids == tokens[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    # min_tokens bans the stop token until enough tokens exist.
    banned = greedy.generate(prompt, SamplingParams(temperature=0, max_tokens=12, min_tokens=12,
                                                    stop_token_ids=[stop]))[0].outputs[0]
    assert len(banned.token_ids) == 12 and stop not in banned.token_ids
    # EOS (from the checkpoint's generation_config) stops unless ignore_eos.
    eos_engine = LLMEngine(EngineConfig(str(tiny_checkpoints["llama"]), dtype="float32",
                                        max_model_len=256, load_progress=False),
                           eos_token_ids=[tokens[2]])
    eos_engine.add_request("r", prompt[0], SamplingParams(temperature=0, max_tokens=12))
    finished = []
    while eos_engine.has_unfinished_requests():
        finished += [o for o in eos_engine.step() if o.finished]
    assert finished[0].finish_reason == "stop"


def test_penalties_change_the_distribution(llm):
    prompt = random_prompts([8], seed=6)
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    penalised = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                    repetition_penalty=2.0,
                                                    frequency_penalty=2.0))
    tokens = penalised[0].outputs[0].token_ids
    assert tokens != plain[0].outputs[0].token_ids
    assert len(set(tokens)) == len(tokens)  # strong penalties forbid repeats here


def test_logprobs_ranks_and_cumulative(llm):
    out = llm.generate(random_prompts([7], seed=8), SamplingParams(
        temperature=0, max_tokens=5, ignore_eos=True, logprobs=2))[0].outputs[0]
    assert len(out.logprobs) == 5
    for token, position in zip(out.token_ids, out.logprobs):
        assert position[token].rank == 1  # greedy takes the most likely token
        assert len(position) == 2
    assert out.cumulative_logprob == pytest.approx(
        sum(p[t].logprob for t, p in zip(out.token_ids, out.logprobs)))


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -3), ("min_p", 2.0),
    ("repetition_penalty", 0.0), ("presence_penalty", 3.0), ("frequency_penalty", -2.5),
    ("max_tokens", 0), ("min_tokens", -1), ("logprobs", 21), ("n", 0), ("seed", -1),
])
def test_bad_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_bad_prompts_are_refused(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], GREEDY)
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([[5, 100000]], GREEDY)
    with pytest.raises(ValueError, match="maximum model length of 256"):
        llm.generate([[1] * 300], GREEDY)
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate(["text needs a tokenizer"], GREEDY)
    with pytest.raises(ValueError, match="empty"):  # the good first prompt is not leaked
        llm.generate([[1, 2, 3], []], GREEDY)
    assert llm.engine.is_idle_and_clean()


def test_max_tokens_capped_by_max_model_len(tiny_checkpoints):
    small = LLM(str(tiny_checkpoints["llama"]), dtype="float32", max_model_len=32,
                load_progress=False)
    out = small.generate([[1] * 28], SamplingParams(temperature=0, max_tokens=100,
                                                    ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"


def test_unsupported_checkpoints_are_refused(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "m", "mistral", sliding_window=64)
    # a window shorter than max_model_len is computed (tests/test_families.py)
    assert ModelConfig.from_pretrained(path, max_model_len=128).layer_windows == (64, 64)
    config = json.loads((path / "config.json").read_text())
    config["layer_types"] = ["sliding_attention", "chunked_attention"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="layer_types='chunked_attention'"):
        ModelConfig.from_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM"):
        ModelConfig.from_pretrained(path)
    with pytest.raises(FileNotFoundError):
        ModelConfig.from_pretrained(tmp_path / "missing")


def test_kv_cache_too_small_is_refused(tiny_checkpoints):
    with pytest.raises(ValueError, match="max_model_len=256") as refused:
        LLM(str(tiny_checkpoints["llama"]), max_model_len=256, num_gpu_blocks_override=4,
            load_progress=False)
    # NOTE: it says what would fit: 4 blocks of 16 tokens
    assert "lower max_model_len to at most 64" in str(refused.value)
    llm = LLM(str(tiny_checkpoints["llama"]), max_model_len=64, num_gpu_blocks_override=4,
              load_progress=False)
    assert llm.engine.max_model_len == 64


def test_dtype_aliases_and_errors():
    from pdserve.engine.config import parse_dtype

    assert parse_dtype("auto", "bfloat16") is torch.bfloat16
    assert parse_dtype("half", None) is torch.float16
    with pytest.raises(ValueError, match="dtype"):
        parse_dtype("int8", None)


def test_sampling_filters_keep_only_allowed_tokens():
    """top-k, top-p and min-p on a known distribution: draws stay inside the kept set."""
    from pdserve.engine.request import Request
    from pdserve.engine.sampler import Sampler

    probs = torch.tensor([0.5, 0.25, 0.15, 0.06, 0.04])
    logits = probs.log().repeat(4, 1)
    cases = [SamplingParams(top_k=2, seed=1), SamplingParams(top_p=0.7, seed=2),
             SamplingParams(min_p=0.2, seed=3), SamplingParams(top_p=0.95, min_p=0.1, seed=4)]
    # min_p=0.1 drops p < 0.05 (token 4); top_p=0.95 then keeps tokens 0-3 (0.9375 < 0.95).
    allowed = [{0, 1}, {0, 1}, {0, 1, 2}, {0, 1, 2, 3}]
    sampler = Sampler(seed=0)
    seen = [set() for _ in cases]
    for step in range(200):
        requests = [Request(f"r{i}", [1], p, frozenset(), 300) for i, p in enumerate(cases)]
        for request in requests:
            request.output_token_ids.extend([0] * step)  # a new position each draw
        for i, (token, _) in enumerate(sampler.sample(logits.clone(), requests)):
            seen[i].add(token)
    assert seen == allowed



def test_draws_follow_the_tempered_distribution():
    """Unseeded draws at temperature 0.5 match softmax(logits / 0.5) within sampling error
    (40,000 draws, 5 sigma per token), and a masked (-inf) token is never drawn, even
    first or last in the vocabulary."""
    from pdserve.engine.request import Request
    from pdserve.engine.sampler import Sampler

    logits = torch.tensor([float("-inf"), 0.0, 0.4, -0.3, 1.0, -2.0, float("-inf")])
    expected = torch.softmax(logits / 0.5, dim=-1)
    rows, rounds = 400, 100
    params = SamplingParams(temperature=0.5)
    requests = [Request(f"r{i}", [1], params, frozenset(), 300) for i in range(rows)]
    sampler = Sampler(seed=0)
    counts = torch.zeros(len(logits))
    for _ in range(rounds):
        tokens = [t for t, _ in sampler.sample(logits.repeat(rows, 1), requests)]
        counts += torch.bincount(torch.tensor(tokens), minlength=len(logits))
    n = rows * rounds
    assert counts[0] == 0 and counts[-1] == 0
    sigma = (n * expected * (1 - expected)).sqrt()
    assert ((counts - n * expected).abs() <= 5 * sigma + 1).all(), (counts / n, expected)

def test_cpu_kv_cache_sits_zeroed_on_huge_page_aligned_memory(llm):
    import gc
    import sys

    from pdserve.engine.kv_cache_layout import cpu_zeros_on_huge_pages

    cache = cpu_zeros_on_huge_pages((3, 5, 7), torch.bfloat16)
    assert cache.shape == (3, 5, 7) and cache.dtype == torch.bfloat16 and cache.is_contiguous()
    assert not cache.any()
    if sys.platform == "linux":
        assert cache.data_ptr() % (2 << 20) == 0
    gc.collect()  # NOTE: the tensor alone must keep its mapping alive
    cache.fill_(1.5)
    assert cache.float().sum().item() == 1.5 * 3 * 5 * 7
    kv = llm.engine.model_runner.kv_cache  # layer-major view of block-major storage
    assert kv.shape[0] == llm.engine.model_runner.config.num_layers
    assert kv.permute(2, 0, 1, 3, 4, 5).is_contiguous()
