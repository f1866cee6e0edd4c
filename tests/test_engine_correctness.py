"""pdserve's greedy tokens and logprobs equal transformers' (the oracle) on every supported
architecture, with all prompts submitted together, under chunked prefill and preemption."""

from __future__ import annotations

import pytest
import torch
from conftest import ARCHITECTURES, random_prompts, transformers_greedy
from transformers import AutoModelForCausalLM

from pdserve.engine import LLM, SamplingParams

PROMPT_LENGTHS = [1, 3, 15, 16, 17, 40, 70, 129]
NEW_TOKENS = 32
NUM_LOGPROBS = 3


def hf_greedy(model_dir, prompts, new_tokens: int = NEW_TOKENS):
    """Per prompt: (token ids, [new_tokens, vocab] log-softmax of the logits) from HF."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return transformers_greedy(model, prompts, new_tokens)


@pytest.fixture(scope="module")
def oracle(tiny_checkpoints):
    prompts = random_prompts(PROMPT_LENGTHS)
    return prompts, {arch: hf_greedy(path, prompts)
                     for arch, path in tiny_checkpoints.items()}


# chunked: a 24-token step budget splits every prompt over 16 tokens into chunks.
# preempt: 24 blocks of 16 cannot hold all 8 sequences (they need 37), so the scheduler
# must preempt and recompute.
SETTINGS = {
    "chunked_prefill": {"max_num_batched_tokens": 24},
    "preemption": {"num_gpu_blocks_override": 24, "max_num_batched_tokens": 256},
}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_greedy_matches_transformers(arch, setting, tiny_checkpoints, oracle):
    prompts, expected = oracle
    llm = LLM(str(tiny_checkpoints[arch]), dtype="float32", max_model_len=256,
              load_progress=False, **SETTINGS[setting])
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                            logprobs=NUM_LOGPROBS)
    outputs = llm.generate(prompts, params)

    if setting == "preemption":
        assert llm.engine.scheduler.num_preemptions_total > 0
    for prompt, output, (ref_tokens, ref_logprobs) in zip(prompts, outputs, expected[arch]):
        completion = output.outputs[0]
        assert output.prompt_token_ids == prompt
        assert completion.token_ids == ref_tokens, f"prompt of {len(prompt)} tokens"
        assert completion.finish_reason == "length"
        for step, (token, position) in enumerate(zip(ref_tokens, completion.logprobs)):
            ref_top = ref_logprobs[step].topk(NUM_LOGPROBS)
            assert set(position) == set(ref_top.indices.tolist()) | {token}
            for token_id, lp in position.items():
                assert lp.logprob == pytest.approx(ref_logprobs[step, token_id].item(), abs=1e-4)
    assert llm.engine.is_idle_and_clean()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_close_to_fp32(dtype, tiny_checkpoints):
    """Half-precision weights give finite logprobs close to fp32's for the same tokens."""
    prompts = random_prompts([5, 37])
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    path = str(tiny_checkpoints["llama"])
    full = LLM(path, dtype="float32", max_model_len=128, load_progress=False).generate(prompts, params)
    half = LLM(path, dtype=dtype, max_model_len=128, load_progress=False).generate(prompts, params)
    for a, b in zip(full, half):
        first_a = a.outputs[0].logprobs[0][a.outputs[0].token_ids[0]].logprob
        first_b = b.outputs[0].logprobs[0][b.outputs[0].token_ids[0]].logprob
        assert first_b == pytest.approx(first_a, abs=0.05)


@pytest.mark.parametrize(("machine", "avx512", "checkpoint", "expected"), [
    ("x86_64", False, torch.bfloat16, torch.float32),
    ("x86_64", False, torch.float16, torch.float32),
    ("x86_64", False, torch.float32, torch.float32),
    ("x86_64", True, torch.bfloat16, torch.bfloat16),
    ("aarch64", False, torch.bfloat16, torch.bfloat16),
])
def test_cpu_compute_dtype_follows_the_cpu(machine, avx512, checkpoint, expected, monkeypatch):
    """``--dtype auto`` on a CPU: half precision only where the CPU computes in it."""
    from pdserve.engine import config

    monkeypatch.setattr(config.platform, "machine", lambda: machine)
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: avx512)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert config.cpu_compute_dtype(checkpoint) is expected


def test_auto_dtype_of_a_bf16_checkpoint_on_this_cpu(tmp_path):
    """A bf16 checkpoint under ``dtype="auto"`` computes in ``cpu_compute_dtype``'s dtype
    with packed linears (float32 on an AVX2 machine: the tokens of an fp32 engine);
    ``dtype="bfloat16"`` keeps bf16."""
    from conftest import write_tiny_checkpoint

    from pdserve.engine.config import ModelConfig, cpu_compute_dtype
    from pdserve.engine.models.layers import PackedLinear

    path = str(write_tiny_checkpoint(tmp_path / "bf16", "llama", dtype=torch.bfloat16))
    assert ModelConfig.from_pretrained(path).dtype is torch.bfloat16
    prompts = random_prompts([5, 37])
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    auto = LLM(path, dtype="auto", max_model_len=128, load_progress=False)
    expected = cpu_compute_dtype(torch.bfloat16)
    assert auto.engine.model_config.dtype is expected
    assert auto.engine.model_runner.kv_cache.dtype is expected
    linears = [m for m in auto.engine.model_runner.model.modules()
               if isinstance(m, (torch.nn.Linear, PackedLinear))]
    assert linears and all(isinstance(m, PackedLinear) for m in linears)
    same = LLM(path, dtype=str(expected).removeprefix("torch."), max_model_len=128,
               load_progress=False)
    assert [o.outputs[0].token_ids for o in auto.generate(prompts, params)] == \
        [o.outputs[0].token_ids for o in same.generate(prompts, params)]
    kept = LLM(path, dtype="bfloat16", max_model_len=128, load_progress=False)
    assert kept.engine.model_config.dtype is torch.bfloat16


def test_logit_bias_forces_and_bans_tokens_and_keeps_raw_logprobs(tiny_checkpoints):
    """+100 makes a token the greedy choice at every step; -100 bans the greedy token;
    the reported logprobs stay those of the raw logits (OpenAI's and vLLM's semantics)."""
    llm = LLM(str(tiny_checkpoints["llama"]), dtype="float32", max_model_len=128,
              load_progress=False)
    prompt = random_prompts([9], seed=3)[0]
    plain = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6,
                                                  ignore_eos=True, logprobs=1))[0].outputs[0]
    forced = llm.generate([prompt], SamplingParams(
        temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias={7: 100.0}))[0].outputs[0]
    assert forced.token_ids == [7] * 6
    sampled = llm.generate([prompt], SamplingParams(
        temperature=1.0, seed=1, max_tokens=6, ignore_eos=True, logit_bias={7: 100.0}))
    assert sampled[0].outputs[0].token_ids == [7] * 6
    first = plain.token_ids[0]
    banned = llm.generate([prompt], SamplingParams(
        temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=1,
        logit_bias={first: -100.0}))[0].outputs[0]
    assert banned.token_ids[0] != first
    # the raw top-1 is still reported, with its raw log-probability
    assert banned.logprobs[0][first].logprob == pytest.approx(plain.logprobs[0][first].logprob)


@pytest.mark.parametrize("bias", [{-1: 1.0}, {3: 100.5}, {3: float("nan")}])
def test_logit_bias_out_of_range_is_refused(bias):
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=bias)


def test_allowed_token_ids_choose_among_them_as_transformers_ranks_them(tiny_checkpoints):
    """Greedy: each token is the best of the allowed ones under transformers' logits
    (teacher-forced on the output so far); sampled: every token is allowed; logprobs
    stay the raw ones; speculation stands aside for such a request."""
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoints["llama"]
    llm = LLM(str(path), dtype="float32", max_model_len=128, load_progress=False,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    prompt = random_prompts([9], seed=3)[0]
    allowed = [5, 11, 17, 23, 60]
    greedy = llm.generate([prompt], SamplingParams(
        temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0,
        allowed_token_ids=allowed))[0].outputs[0]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + greedy.token_ids])).logits[0]
    for i, token in enumerate(greedy.token_ids):
        row = logits[len(prompt) - 1 + i]
        assert token == allowed[int(row[allowed].argmax())]
        raw = row.log_softmax(-1)[token].item()
        assert greedy.logprobs[i][token].logprob == pytest.approx(raw, abs=1e-4)
    sampled = llm.generate([prompt] * 4, SamplingParams(
        temperature=1.5, seed=2, max_tokens=8, ignore_eos=True, allowed_token_ids=allowed))
    assert all(set(o.outputs[0].token_ids) <= set(allowed) for o in sampled)
    assert llm.engine.is_idle_and_clean()


@pytest.mark.parametrize("allowed", [[], [-1], list(range((1 << 18) + 1))])
def test_allowed_token_ids_out_of_range_are_refused(allowed):
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=allowed)


def test_allowed_token_ids_and_a_grammar_are_refused_together():
    from pdserve.engine.structured_output import StructuredOutputSpec

    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[3], structured_output=StructuredOutputSpec(
            "regex", "[ab]+"))


def test_bad_words_ban_a_sequences_last_token_after_the_rest(tiny_checkpoints):
    llm = LLM(str(tiny_checkpoints["llama"]), dtype="float32", max_model_len=128,
              load_progress=False)
    prompt = random_prompts([9], seed=3)[0]
    params = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}
    plain = llm.generate([prompt], SamplingParams(**params))[0].outputs[0].token_ids
    pair = llm.generate([prompt], SamplingParams(
        **params, bad_words_token_ids=[plain[1:3]]))[0].outputs[0].token_ids
    assert pair[:2] == plain[:2] and pair[2] != plain[2]  # banned only after plain[1]
    assert all(pair[i:i + 2] != plain[1:3] for i in range(len(pair) - 1))
    single = llm.generate([prompt], SamplingParams(
        **params, bad_words_token_ids=[[plain[0]]]))[0].outputs[0].token_ids
    assert plain[0] not in single
    assert llm.engine.is_idle_and_clean()


@pytest.mark.parametrize("words", [[[]], [[-3]], [[1] * 65], [[1]] * 257])
def test_bad_words_out_of_range_are_refused(words):
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words_token_ids=words)
