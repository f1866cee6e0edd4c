"""The engine on a CUDA GPU: transformers' greedy tokens on the same GPU, the KV cache's
sizing against ``gpu_memory_utilization``, sampling and structured output on device
tensors, and the worker's placement record. Skipped without CUDA (marked ``cuda``).
"""

from __future__ import annotations

import gc
import json

import pytest
import torch
from conftest import ARCHITECTURES, random_prompts, write_tiny_checkpoint
from test_engine_correctness import NEW_TOKENS, NUM_LOGPROBS, PROMPT_LENGTHS, SETTINGS

from pdserve.engine import LLM, SamplingParams

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

KV_BYTES = 64 << 20  # each test engine's KV cache, so many engines fit in one process


def transformers_greedy_cuda(model_dir, prompts, dtype=torch.float32):
    """Per prompt: (token ids, [NEW_TOKENS, vocab] log-softmax) from transformers on CUDA."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda().eval()
    results = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device="cuda")
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                 eos_token_id=None, pad_token_id=0, output_logits=True,
                                 return_dict_in_generate=True)
            logprobs = torch.stack(out.logits)[:, 0].float().log_softmax(-1).cpu()
            results.append((out.sequences[0, len(prompt):].tolist(), logprobs))
    del model
    return results


@pytest.fixture(scope="module")
def cuda_oracle(tiny_checkpoints):
    prompts = random_prompts(PROMPT_LENGTHS)
    return prompts, {arch: transformers_greedy_cuda(path, prompts)
                     for arch, path in tiny_checkpoints.items()}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_greedy_matches_transformers_on_cuda(arch, setting, tiny_checkpoints, cuda_oracle):
    """fp32 on the GPU: the Triton attention and KV store kernels under chunked prefill
    and preemption give transformers' tokens and logprobs (to 1e-4)."""
    prompts, expected = cuda_oracle
    kwargs = {"kv_cache_memory_bytes": KV_BYTES, **SETTINGS[setting]}
    llm = LLM(str(tiny_checkpoints[arch]), dtype="float32", max_model_len=256,
              device="cuda", load_progress=False, **kwargs)
    assert llm.engine.model_runner.kv_cache.is_cuda
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                            logprobs=NUM_LOGPROBS)
    outputs = llm.generate(prompts, params)
    if setting == "preemption":
        assert llm.engine.scheduler.num_preemptions_total > 0
    for prompt, output, (ref_tokens, ref_logprobs) in zip(prompts, outputs, expected[arch]):
        completion = output.outputs[0]
        assert completion.token_ids == ref_tokens, f"prompt of {len(prompt)} tokens"
        for step, (token, position) in enumerate(zip(ref_tokens, completion.logprobs)):
            for token_id, lp in position.items():
                assert lp.logprob == pytest.approx(ref_logprobs[step, token_id].item(), abs=1e-4)
    assert llm.engine.is_idle_and_clean()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_on_cuda_is_close_to_transformers(dtype, tiny_checkpoints):
    """Half precision on the GPU (tensor-core dots in the Triton kernels): the first
    token's logprob within rounding of transformers' in the same dtype on the same GPU."""
    prompts = random_prompts([5, 37, 300])
    path = str(tiny_checkpoints["llama"])
    llm = LLM(path, dtype=dtype, max_model_len=512, device="cuda", load_progress=False,
              kv_cache_memory_bytes=KV_BYTES)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=0)
    outputs = llm.generate(prompts, params)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).cuda().eval()
    for prompt, output in zip(prompts, outputs):
        with torch.inference_mode():
            logits = model(torch.tensor([prompt], device="cuda")).logits[0, -1].float()
        ref = logits.log_softmax(-1).cpu()
        token = output.outputs[0].token_ids[0]
        assert output.outputs[0].logprobs[0][token].logprob == pytest.approx(
            ref[token].item(), abs=0.05)


def test_kv_cache_fills_its_share_of_the_gpu_and_a_full_step_stays_within_it(tmp_path):
    """``gpu_memory_utilization`` is this engine's share of the whole GPU, as vLLM's: the
    KV cache takes what the weights and a profiled step's activations leave of it, and a
    step of the whole token budget (here ~0.8 GB of MLP activations) then keeps this
    process within the share. Measured on this process's allocator, so other processes on
    the GPU (parallel test workers) do not move the figures. A second engine asking for
    more than is free is refused at once, naming the setting."""
    gc.collect()
    torch.cuda.empty_cache()
    path = str(write_tiny_checkpoint(tmp_path / "wide", "llama", hidden_size=512,
                                     intermediate_size=8192, num_attention_heads=8,
                                     num_key_value_heads=2, max_position_embeddings=2048))
    share = 0.25
    torch.cuda.reset_peak_memory_stats()
    reserved_before = torch.cuda.memory_reserved()
    _, total = torch.cuda.mem_get_info()
    allowed = share * total
    llm = LLM(path, dtype="float32", max_model_len=2048, device="cuda", load_progress=False,
              gpu_memory_utilization=share, max_num_batched_tokens=8192, max_num_seqs=64)
    runner = llm.engine.model_runner
    kv_bytes = runner.kv_cache.numel() * runner.kv_cache.element_size()
    assert allowed - (2 << 30) <= kv_bytes <= allowed
    # 8184 tokens in one step (4 prompts of 2046), and the sampler's top-p sorts
    prompts = random_prompts([2046] * 4, seed=5)
    outputs = llm.generate(prompts, SamplingParams(temperature=1.0, top_p=0.9, top_k=20,
                                                   max_tokens=2, seed=1, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 2 for o in outputs)
    cumulative = dict(llm.engine.iteration_tokens.snapshot()[0])
    assert cumulative[8192.0] > cumulative[4096.0]  # the prompts went in one step
    torch.cuda.synchronize()
    grown = torch.cuda.max_memory_reserved() - reserved_before
    assert grown <= allowed + (256 << 20), (grown, allowed)
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.99"):
        LLM(path, dtype="float32", max_model_len=2048, device="cuda", load_progress=False,
            gpu_memory_utilization=0.99)
    del llm, runner
    gc.collect()
    torch.cuda.empty_cache()


def test_sampling_on_cuda_is_seeded_and_filters(tiny_checkpoints):
    """Seeded draws repeat on the GPU; top-k 1 equals greedy; penalties and logit_bias run
    on device tensors."""
    llm = LLM(str(tiny_checkpoints["qwen2"]), dtype="float32", max_model_len=128,
              device="cuda", load_progress=False, kv_cache_memory_bytes=KV_BYTES)
    prompts = random_prompts([9, 33], seed=2)
    seeded = SamplingParams(temperature=1.0, top_p=0.8, min_p=0.01, seed=11, max_tokens=12,
                            ignore_eos=True, repetition_penalty=1.2, presence_penalty=0.5)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, seeded)]
    again = [o.outputs[0].token_ids for o in llm.generate(prompts, seeded)]
    assert first == again
    greedy = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12,
                                                  ignore_eos=True))
    top1 = llm.generate(prompts, SamplingParams(temperature=1.0, top_k=1, seed=3,
                                                max_tokens=12, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in top1] == [o.outputs[0].token_ids for o in greedy]
    forced = llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4,
                                                      logit_bias={7: 100.0}, ignore_eos=True))
    assert forced[0].outputs[0].token_ids == [7] * 4
    assert llm.engine.is_idle_and_clean()


def test_structured_output_on_cuda(tmp_path):
    """xgrammar's bitmask applied to CUDA logits: sampled JSON matches its schema."""
    import jsonschema

    from pdserve.engine.demo_model import make_demo_model
    from pdserve.engine.structured_output import json_schema_spec

    path = make_demo_model(tmp_path / "demo")
    llm = LLM(str(path), dtype="float32", max_model_len=512, device="cuda",
              load_progress=False, kv_cache_memory_bytes=KV_BYTES)
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"]}
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=200,
                            structured_output=json_schema_spec(schema))
    outputs = llm.generate(["Describe a person:"] * 4, params)
    for output in outputs:
        jsonschema.validate(json.loads(output.outputs[0].text), schema)
        assert output.outputs[0].finish_reason == "stop"


def test_a_cuda_worker_records_its_gpu_so_the_router_sees_shared_compute():
    from pdserve.cluster.worker_runtime import compute_placement
    from pdserve.router.routing_policy import shares_compute

    placement = compute_placement(torch.device("cuda", 0))
    assert placement.startswith("cuda@") and ":GPU-" in placement
    assert shares_compute(placement, compute_placement(torch.device("cuda", 0)))
    assert not shares_compute(placement, compute_placement(torch.device("cpu")))
