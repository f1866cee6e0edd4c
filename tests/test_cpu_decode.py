"""The CPU decode chain (``engine/models/cpu_decode.py``): on the steps it takes, the
decoder layers' output is the modules' bit for bit, through ``LLM`` with float and
quantized weights, biases, tied embeddings, a sliding window shorter than the prompts,
Qwen3's q/k norms, and chunked prefill between decode steps; the layers and steps it does
not cover go through the modules."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import TINY, random_prompts, write_tiny_checkpoint

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.models.cpu_decode import CpuDecodeLayers
from pdserve.kernels import cpu_ext

pytestmark = pytest.mark.skipif(not cpu_ext.load(), reason="needs the C++ CPU kernels")

PROMPTS = random_prompts([3, 19, 40])
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
# arch, dtype, --quantization, config overrides
CASES = {
    "llama-bf16": ("llama", "bfloat16", None, {}),
    "llama-fp32": ("llama", "float32", None, {}),
    "llama31-int4": ("llama31", "bfloat16", "int4", {}),
    "qwen2-int8-bias-tied": ("qwen2", "bfloat16", "int8", {}),
    "mistral-window": ("mistral", "bfloat16", None, {"sliding_window": 8}),
    "qwen3-qk-norms": ("qwen3", "bfloat16", None, {}),
}


class _Counting:
    """The model's chain, counting the steps it takes and the steps it is asked about."""

    def __init__(self, chain: CpuDecodeLayers) -> None:
        self.chain, self.calls, self.asked = chain, 0, []

    def applies(self, *args) -> bool:
        self.asked.append(self.chain.applies(*args))
        return self.asked[-1]

    def __call__(self, *args):
        self.calls += 1
        return self.chain(*args)


def _generate(path, dtype, quantization, chain: bool, **engine_args):
    """Greedy (token ids, their logprobs) per prompt of ``LLM`` with the chain on or
    off, and how many forward passes went through it."""
    llm = LLM(str(path), dtype=dtype, quantization=quantization, max_model_len=128,
              load_progress=False, **engine_args)
    model = llm.engine.model_runner.model
    assert isinstance(model.cpu_decode, CpuDecodeLayers)
    model.cpu_decode = counting = _Counting(model.cpu_decode) if chain else None
    outputs = llm.generate(PROMPTS, PARAMS)
    return [(o.outputs[0].token_ids, [p[t].logprob for t, p in
                                      zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
            for o in outputs], counting.calls if chain else 0


@pytest.mark.parametrize("case", list(CASES))
def test_chain_equals_the_modules(case, tmp_path):
    arch, dtype, quantization, overrides = CASES[case]
    path = write_tiny_checkpoint(tmp_path / arch, arch, random_norms=True, **overrides)
    # chunks of 16 tokens: the 40-token prompt's prefill chunks share steps with decodes
    chained, calls = _generate(path, dtype, quantization, True, max_num_batched_tokens=16)
    plain, _ = _generate(path, dtype, quantization, False, max_num_batched_tokens=16)
    assert chained == plain  # token ids and logprobs, exactly
    # the last prompt's prefill ends in the 3rd step, then 11 pure decode steps remain
    # at least (each sequence's 12 tokens, the first from prefill)
    assert calls >= PARAMS.max_tokens - 1


def test_chain_equals_the_modules_on_a_k_quant_gguf(tmp_path):
    """A GGUF file mixed as Q4_K_M files are (Q4_K, with v and the MLP's down projection
    in Q6_K): the K-quants' two-level scales, and q/k/v as a ``ConcatLinear`` of two
    formats, whose bound kernel the chain calls."""
    from gguf_files import write_tiny_gguf

    from pdserve.engine.models.quantization import ConcatLinear

    def k_types(name: str) -> str:
        return "Q6_K" if ".attn_v." in name or ".ffn_down." in name else "Q4_K"

    path = write_tiny_gguf(tmp_path / "mixed.gguf", k_types)
    llm = LLM(str(path), dtype="bfloat16", max_model_len=128, load_progress=False)
    qkv = llm.engine.model_runner.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, ConcatLinear) and qkv.parts[0]._cpu[3] is not None  # codes
    del llm
    chained, calls = _generate(path, "bfloat16", None, True, max_num_batched_tokens=16)
    plain, _ = _generate(path, "bfloat16", None, False, max_num_batched_tokens=16)
    assert chained == plain and calls >= PARAMS.max_tokens - 1


def test_layers_it_does_not_cover_run_through_the_modules(tmp_path):
    # Gemma 2's sandwich norms and its own RMSNorm
    config = transformers.Gemma2Config(**TINY, head_dim=16)
    torch.manual_seed(0)
    transformers.Gemma2ForCausalLM(config).save_pretrained(tmp_path / "gemma2")
    llm = LLM(str(tmp_path / "gemma2"), max_model_len=128, load_progress=False)
    assert llm.engine.model_runner.model.cpu_decode is None
    assert llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2))[0].outputs[0].token_ids


def test_a_quantized_kv_cache_runs_through_the_modules(tiny_checkpoints):
    llm = LLM(str(tiny_checkpoints["llama"]), dtype="bfloat16", kv_cache_dtype="int8",
              max_model_len=128, load_progress=False)
    model = llm.engine.model_runner.model
    model.cpu_decode = counting = _Counting(model.cpu_decode)
    llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert counting.asked and not any(counting.asked) and counting.calls == 0


def test_the_kernels_check_their_arguments(tiny_checkpoints):
    # a slot past the cache is the C++ kernel's error, not a write out of bounds
    llm = LLM(str(tiny_checkpoints["llama"]), dtype="bfloat16", max_model_len=128,
              load_progress=False)
    runner = llm.engine.model_runner
    chain, kv = runner.model.cpu_decode, runner.kv_cache
    from pdserve.engine.models.blocks import AttentionMetadata

    slots = kv.shape[2] * kv.shape[3]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([slots], dtype=torch.int64), num_decode_tokens=1,
        decode_block_tables=torch.zeros((1, 1), dtype=torch.int32),
        decode_seq_lens=torch.ones(1, dtype=torch.int32),
        prefill_block_tables=torch.zeros((0, 1), dtype=torch.int32),
        prefill_cu_seqlens_q=torch.zeros(1, dtype=torch.int32),
        prefill_seq_lens=torch.zeros(0, dtype=torch.int32))
    x = torch.zeros((1, 64), dtype=torch.bfloat16)
    rope = runner.model.rotary_emb.cos_sin(torch.zeros(1, dtype=torch.int64), x.dtype)
    assert chain.applies(x, kv, meta, None)
    with pytest.raises(RuntimeError, match="slot_mapping"):
        chain(x, rope, rope, kv, meta)
