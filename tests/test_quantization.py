"""Quantized weights in the engine: a GGUF file's quantized tensors stay quantized (their
linears are ``QuantizedLinear``s, mixed formats of one fused projection included) and give
transformers' tokens; ``--quantization int8|int4`` quantizes a float checkpoint at load,
close to it; unsupported schemes are refused naming the flag."""

from __future__ import annotations

import pytest
from conftest import assert_matches_transformers, random_prompts
from gguf_files import random_blocks, write_tiny_gguf
from test_gguf import NEW_TOKENS, gguf_greedy

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.model_source import open_model
from pdserve.engine.models.loader import quantized_targets
from pdserve.engine.models.quantization import ConcatLinear, QuantizedEmbedding, QuantizedLinear

GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)


def linears(llm):
    return {name: module for name, module in llm.engine.model_runner.model.named_modules()
            if name.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"))}


def mixed_types(name: str) -> str:
    """q and k in Q8_0 beside v unquantized, the MLP's down projection in Q6_K, the rest
    in Q4_1 (as a Q4_K_M file mixes types)."""
    if ".attn_v." in name:
        return "F32"
    if ".attn_q." in name or ".attn_k." in name:
        return "Q8_0"
    return "Q6_K" if ".ffn_down." in name else "Q4_1"


@pytest.mark.parametrize("qtype,tied", [("Q4_0", False), (mixed_types, True)])
def test_gguf_quantized_tensors_stay_quantized_and_give_transformers_tokens(qtype, tied,
                                                                            tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", qtype, tied=tied)
    prompts = random_prompts([3, 17, 40])
    expected = gguf_greedy(path, prompts)
    llm = LLM(str(path), dtype="float32", max_model_len=128, load_progress=False)
    layers = linears(llm)
    if callable(qtype):
        assert isinstance(layers["model.layers.0.self_attn.qkv_proj"], ConcatLinear)
        assert isinstance(layers["model.layers.0.mlp.down_proj"], QuantizedLinear)
        assert layers["model.layers.0.mlp.down_proj"].bits == 8  # Q6_K repacked
    else:
        assert all(isinstance(m, QuantizedLinear) and m.bits == 4 for m in layers.values())
    embedding = llm.engine.model_runner.model.model.embed_tokens
    assert isinstance(embedding, QuantizedEmbedding)  # the table looked up quantized
    # its float table dropped before the model is materialised, as a quantized linear's
    assert "model.embed_tokens.weight" in quantized_targets(open_model(path))
    assert embedding.nbytes < embedding.num_embeddings * embedding.embedding_dim  # < bf16 / 2
    if tied:  # the quantized table: the head its own quantized linear
        assert isinstance(layers["lm_head"], QuantizedLinear)
    outputs = llm.generate(prompts, GREEDY)
    assert_matches_transformers(outputs, expected)


@pytest.mark.parametrize("scheme,bits,tolerance", [("int8", 8, 0.02), ("int4", 4, 0.3)])
def test_rtn_quantization_at_load_stays_close_to_the_float_model(scheme, bits, tolerance,
                                                                 tiny_checkpoints):
    path = str(tiny_checkpoints["qwen2"])  # biases on q/k/v, tied embeddings
    prompts = random_prompts([5, 30], seed=6)
    float_llm = LLM(path, dtype="float32", max_model_len=128, load_progress=False)
    quant_llm = LLM(path, dtype="float32", max_model_len=128, load_progress=False,
                    quantization=scheme)
    layers = linears(quant_llm)
    assert len(layers) == 4 * 2 + 1
    assert all(isinstance(m, QuantizedLinear) and m.bits == bits for m in layers.values())
    # teacher-forced: the quantized model's logprob of each float-greedy token
    reference = float_llm.generate(prompts, GREEDY)
    for prompt, ref in zip(prompts, reference):
        ids = prompt + ref.outputs[0].token_ids[:-1]
        forced = quant_llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=1,
                                                          logprobs=5, ignore_eos=True))
        top = forced[0].outputs[0].logprobs[0]
        expected = ref.outputs[0].logprobs[-1][ref.outputs[0].token_ids[-1]].logprob
        token = ref.outputs[0].token_ids[-1]
        assert token in top and top[token].logprob == pytest.approx(expected, abs=tolerance)


def test_unsupported_quantization_is_refused_naming_the_flag(tiny_checkpoints):
    with pytest.raises(ValueError, match="--quantization 'fp8' is not supported"):
        LLM(str(tiny_checkpoints["llama"]), quantization="fp8", load_progress=False)
    with pytest.raises(ValueError, match="--quantization gguf"):
        LLM(str(tiny_checkpoints["llama"]), quantization="gguf", load_progress=False)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"])
def test_a_quantized_embedding_looks_up_the_dequantized_rows(kind):
    """``QuantizedEmbedding``'s rows are gguf's dequantized table's, cast to the model's
    dtype, bit for bit (what the float table held); an id out of range is an IndexError."""
    import gguf
    import numpy as np
    import torch

    from pdserve.engine.gguf_quant import quant_weight

    rows, cols = 37, 512
    data = random_blocks(kind, rows, cols, np.random.default_rng(4))
    table = torch.from_numpy(gguf.dequantize(data, gguf.GGMLQuantizationType[kind]).reshape(
        rows, cols))
    embedding = QuantizedEmbedding(quant_weight(data, kind, rows, cols), torch.bfloat16,
                                   torch.device("cpu"))
    ids = torch.tensor([0, 36, 5, 5, 17])
    assert torch.equal(embedding(ids), table.to(torch.bfloat16)[ids])
    assert embedding(ids[:0]).shape == (0, cols)
    with pytest.raises(IndexError):
        embedding(torch.tensor([37]))
