"""Mixture-of-experts families (issue 27, part 3): Mixtral, Qwen2-MoE (shared expert, a
dense layer from ``mlp_only_layers``) and Qwen3-MoE (``norm_topk_prob``, every other layer
dense by ``decoder_sparse_step``). Tiny random checkpoints written by transformers are the
oracle: the MoE block against transformers' sparse block on the same weights, greedy
tokens and logprobs through ``LLM`` (whole and chunked prefill), the tensor-parallel
slicing (two ranks' partial outputs sum to the whole block's), and the config refusals.
The kernels' own tests are ``tests/kernels/test_moe_kernels.py``.
"""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
import transformers
from conftest import assert_matches_transformers, random_prompts, transformers_greedy
from safetensors.torch import load_file

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import ModelConfig, UnsupportedModelError
from pdserve.engine.demo_model import VOCAB_SIZE, make_demo_model
from pdserve.engine.models.moe import MoEBlock
from pdserve.engine.parallel import TensorParallel, check_tensor_parallel

# weights larger than transformers' default (0.02), so routing and the experts move the
# logits well past the tolerance
BASE = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": 256, "initializer_range": 0.1}
# name -> (config class, model class, fields beyond BASE)
FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {
        "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 64,
        "head_dim": 16}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48, "mlp_only_layers": [1],
        "norm_topk_prob": False}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 32,
        "decoder_sparse_step": 2, "norm_topk_prob": True, "head_dim": 32}),
}
PROMPT_LENGTHS = [5, 20, 45]
NEW_TOKENS = 12
SETTINGS = {"whole_prefill": {"max_model_len": 256},
            "chunked_prefill": {"max_num_batched_tokens": 24, "max_model_len": 256},
            # two ranks over gloo: each holds half of every expert (and of the shared
            # expert, the dense layers' MLP, the heads and the vocabulary)
            "tensor_parallel": {"tensor_parallel_size": 2, "max_num_batched_tokens": 24,
                                "max_model_len": 256},
            # issue 28: speculative decoding's greedy output is one-token decoding's
            "ngram_k1": {"max_model_len": 256, "speculative_config": {
                "method": "ngram", "num_speculative_tokens": 1, "prompt_lookup_max": 2,
                "prompt_lookup_min": 1}},
            "suffix_k5": {"max_model_len": 256, "speculative_config": {
                "method": "suffix", "num_speculative_tokens": 5,
                "suffix_decoding_max_tree_depth": 12, "suffix_decoding_max_spec_factor": 3.0,
                "suffix_decoding_min_token_prob": 0.0}}}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    """One fp32 checkpoint per family, with the demo model's tokenizer."""
    root = tmp_path_factory.mktemp("moe")
    demo = make_demo_model(root / "demo")
    made = {}
    for name, (config_cls, model_cls, extra) in FAMILIES.items():
        config = getattr(transformers, config_cls)(**{**BASE, **extra})
        torch.manual_seed(0)
        getattr(transformers, model_cls)(config).eval().save_pretrained(root / name)
        for tokenizer_file in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(demo / tokenizer_file, root / name / tokenizer_file)
        made[name] = root / name
    return made


@pytest.fixture(scope="module")
def hf_models(checkpoints) -> dict:
    return {name: transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32).eval() for name, path in checkpoints.items()}


@pytest.fixture(scope="module")
def oracle(hf_models):
    prompts = random_prompts(PROMPT_LENGTHS, vocab_size=VOCAB_SIZE, seed=5)
    expected = {name: transformers_greedy(model, prompts, NEW_TOKENS)
                for name, model in hf_models.items()}
    return prompts, expected


def make_block(path, layer: int, tp: TensorParallel, names=None) -> MoEBlock:
    """Layer ``layer``'s MoE block for rank ``tp``, loaded from the checkpoint's tensors
    (or from ``names``: ``{name: tensor}``)."""
    config = ModelConfig.from_pretrained(path)
    block = MoEBlock(config, tp)
    tensors = names if names is not None else load_file(path / "model.safetensors")
    prefix = f"model.layers.{layer}."
    loaded = {block.load_weight(n[len(prefix):], t) for n, t in tensors.items()
              if n.startswith(prefix)}
    assert {"gate.weight", "w13", "w2"} <= loaded
    return block.eval()


def moe_layer(config: ModelConfig) -> int:
    return next(i for i in range(config.num_layers) if config.is_moe_layer(i))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_block_equals_transformers_sparse_block(family, checkpoints, hf_models):
    """The router, top-k normalisation, experts and shared expert, on hidden states
    large enough to spread the router's choices over every expert."""
    config = ModelConfig.from_pretrained(checkpoints[family])
    layer = moe_layer(config)
    block = make_block(checkpoints[family], layer, TensorParallel())
    x = torch.randn(1, 53, 64, generator=torch.Generator().manual_seed(1)) * 3
    with torch.no_grad():
        expected = hf_models[family].model.layers[layer].mlp(x)[0]
        got = block(x[0])
        ids, _ = block.route(x[0])
    assert set(ids.flatten().tolist()) == set(range(config.num_experts))
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tensor_parallel_ranks_partial_outputs_sum_to_the_whole(family, checkpoints,
                                                                hf_models):
    """Each of 2 ranks holds every expert's half of the intermediate dimension (and the
    shared expert's half); their partial outputs, before the all-reduce, sum to the
    size-1 block's output. Rank 1 loads transformers 5's stacked in-memory tensors
    (``experts.gate_up_proj``), rank 0 the per-expert checkpoint ones."""
    path = checkpoints[family]
    config = ModelConfig.from_pretrained(path)
    check_tensor_parallel(config, 2)
    layer = moe_layer(config)
    whole = make_block(path, layer, TensorParallel())
    stacked = {n: t for n, t in hf_models[family].state_dict().items()}
    assert any(n.endswith("experts.gate_up_proj") for n in stacked)
    ranks = [make_block(path, layer, TensorParallel(0, 2)),
             make_block(path, layer, TensorParallel(1, 2), names=stacked)]
    half = config.moe_intermediate_size // 2
    assert ranks[1].w13.shape == (config.num_experts, 2 * half, 64)
    assert ranks[1].w2.shape == (config.num_experts, 64, half)
    torch.testing.assert_close(torch.cat([ranks[0].w2, ranks[1].w2], dim=2), whole.w2)
    x = torch.randn(29, 64, generator=torch.Generator().manual_seed(2)) * 3
    with torch.no_grad():
        partial = [rank.forward_partial(x) for rank in ranks]
        torch.testing.assert_close(partial[0] + partial[1], whole(x), atol=1e-6, rtol=1e-5)
        assert not torch.allclose(partial[0], whole(x), atol=1e-3)


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_matches_transformers(family, setting, checkpoints, oracle):
    prompts, expected = oracle
    llm = LLM(str(checkpoints[family]), dtype="float32", load_progress=False,
              **SETTINGS[setting])
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                                   ignore_eos=True, logprobs=2))
    assert_matches_transformers(outputs, expected[family])
    if "speculative_config" in SETTINGS[setting]:
        assert llm.engine.scheduler.num_draft_tokens_total > 0
    assert llm.engine.is_idle_and_clean()
    llm.shutdown()


def test_moe_fields_are_read_from_the_configs(checkpoints):
    mixtral = ModelConfig.from_pretrained(checkpoints["mixtral"])
    assert (mixtral.num_experts, mixtral.num_experts_per_tok) == (4, 2)
    assert mixtral.moe_intermediate_size == 64 and mixtral.norm_topk_prob
    assert mixtral.router_weights_fp32 and mixtral.moe_layers == (True,) * 4
    qwen2 = ModelConfig.from_pretrained(checkpoints["qwen2_moe"])
    assert qwen2.qkv_bias and qwen2.shared_expert_intermediate_size == 48
    assert qwen2.moe_layers == (True, False, True, True) and not qwen2.norm_topk_prob
    assert not qwen2.router_weights_fp32
    qwen3 = ModelConfig.from_pretrained(checkpoints["qwen3_moe"])
    assert qwen3.qk_norm and qwen3.norm_topk_prob and qwen3.num_experts == 8
    assert qwen3.moe_layers == (False, True, False, True)
    assert qwen3.shared_expert_intermediate_size == 0 and qwen3.layer_windows == (None,) * 4


def raw_config(checkpoints, family) -> dict:
    import json

    return json.loads((checkpoints[family] / "config.json").read_text())


@pytest.mark.parametrize("field, value, message", [
    ("num_experts_per_tok", 9, "num_experts_per_tok=9"),
    ("moe_intermediate_size", None, "moe_intermediate_size"),
    ("decoder_sparse_step", -1, "decoder_sparse_step"),
    ("quantization_config", {"quant_method": "fp8"}, "quant"),
])
def test_refuses_what_it_does_not_compute(checkpoints, field, value, message):
    raw = {**raw_config(checkpoints, "qwen2_moe"), field: value}
    with pytest.raises(UnsupportedModelError, match=message):
        ModelConfig.from_dict(raw, model="x")


def test_refuses_quantized_experts_and_uneven_tensor_parallel(checkpoints):
    from pdserve.engine.models.loader import check_model

    config = ModelConfig.from_pretrained(checkpoints["qwen2_moe"])
    with pytest.raises(UnsupportedModelError, match="quantization='int8'"):
        check_model(dataclasses.replace(config, quantization="int8"))
    with pytest.raises(UnsupportedModelError, match="shared_expert_intermediate_size=48"):
        check_tensor_parallel(dataclasses.replace(config, moe_intermediate_size=64,
                                                  intermediate_size=96), 32)
    with pytest.raises(UnsupportedModelError, match="quantized expert weights"):
        MoEBlock(config, TensorParallel()).load_weight(
            "mlp.experts.0.gate_proj.weight", torch.zeros(32, 64, dtype=torch.int8))
    olmoe = {**raw_config(checkpoints, "qwen3_moe"), "architectures": ["OlmoeForCausalLM"]}
    with pytest.raises(UnsupportedModelError, match="OlmoeForCausalLM"):
        ModelConfig.from_dict(olmoe, model="x")
