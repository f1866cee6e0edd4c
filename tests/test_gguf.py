"""GGUF files (engine/gguf_source.py): every tensor type pdserve dequantizes gives the
model transformers builds from the same file, token for token; llama.cpp's q/k row order is
undone; what pdserve would not compute exactly is refused when the file is opened."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import assert_matches_transformers, random_prompts, transformers_greedy
from gguf_files import TINY_GGUF, write_tiny_gguf
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import ModelConfig, UnsupportedModelError, cpu_compute_dtype
from pdserve.engine.gguf_source import SUPPORTED_TENSOR_TYPES, GGUFFile
from pdserve.engine.model_source import open_model

NEW_TOKENS = 12


def gguf_greedy(path, prompts):
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32).eval()
    return transformers_greedy(model, prompts, NEW_TOKENS)


@pytest.mark.parametrize("qtype", SUPPORTED_TENSOR_TYPES)
def test_each_tensor_type_gives_transformers_tokens(qtype, tmp_path):
    path = write_tiny_gguf(tmp_path / f"tiny-{qtype}.gguf", qtype, tied=qtype == "Q8_0")
    prompts = random_prompts([3, 17, 40])
    expected = gguf_greedy(path, prompts)
    llm = LLM(str(path), dtype="float32", max_model_len=128, load_progress=False)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                                   ignore_eos=True, logprobs=0))
    assert_matches_transformers(outputs, expected)


def test_f32_weights_are_the_checkpoints_own(tmp_path):
    """Dequantized F32 tensors are the original weights exactly: the q and k rows that
    llama.cpp permuted come back in transformers' order."""
    torch.manual_seed(0)
    original = LlamaForCausalLM(LlamaConfig(**TINY_GGUF)).state_dict()
    source = open_model(write_tiny_gguf(tmp_path / "tiny.gguf", "F32"))
    assert isinstance(source, GGUFFile)
    weights = dict(source.iterate_weights(torch.float32, progress=False))
    assert set(weights) == set(original)
    for name, tensor in original.items():
        assert torch.equal(weights[name], tensor), name


def test_config_from_metadata(tmp_path):
    path = write_tiny_gguf(tmp_path / "tied.gguf", "Q4_1", tied=True)
    config = ModelConfig.from_pretrained(path)
    assert (config.architecture, config.hidden_size, config.num_layers, config.num_heads,
            config.num_kv_heads, config.head_dim, config.intermediate_size,
            config.vocab_size, config.max_position_embeddings) == (
        "LlamaForCausalLM", 256, 2, 4, 2, 64, 512, 320, 512)
    assert config.tie_word_embeddings and config.rope_theta == 10000.0
    assert config.rms_norm_eps == pytest.approx(1e-5)
    assert config.dtype is torch.bfloat16  # --dtype auto: vLLM's half precision
    assert not ModelConfig.from_pretrained(write_tiny_gguf(tmp_path / "untied.gguf")
                                           ).tie_word_embeddings


def test_dtype_auto_computes_a_gguf_file_in_bfloat16(tmp_path):
    """A GGUF file has no dtype of its own: ``--dtype auto`` takes vLLM's half precision
    for it, weights and KV cache (float32 on an x86 CPU without AVX-512)."""
    llm = LLM(str(write_tiny_gguf(tmp_path / "tiny.gguf", "Q8_0")), max_model_len=128,
              load_progress=False)
    dtype = cpu_compute_dtype(torch.bfloat16)
    assert llm.engine.model_config.dtype is dtype
    assert llm.engine.model_runner.model.model.norm.weight.dtype is dtype
    assert llm.engine.model_runner.kv_cache.dtype is dtype
    output = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4,
                                                      ignore_eos=True))[0]
    assert len(output.outputs[0].token_ids) == 4


def test_a_folder_holding_one_gguf_file_is_that_file(tmp_path):
    path = write_tiny_gguf(tmp_path / "only.gguf")
    assert open_model(tmp_path).path == path
    write_tiny_gguf(tmp_path / "second.gguf")
    with pytest.raises(UnsupportedModelError, match="2 .gguf files"):
        open_model(tmp_path)


@pytest.mark.parametrize(("kwargs", "named"), [
    ({"arch": "qwen2"}, "general.architecture='qwen2'"),
    ({"metadata": {"llama.rope.scaling.type": "linear"}}, "llama.rope.scaling.type='linear'"),
    ({"metadata": {"llama.expert_count": 8}}, "llama.expert_count=8"),
    ({"extra_tensors": {"rope_freqs.weight": np.ones(32)}}, "tensor 'rope_freqs.weight'"),
    ({"qtype": "Q5_0"}, "is of type Q5_0"),
])
def test_what_pdserve_does_not_compute_is_refused_naming_it(kwargs, named, tmp_path):
    path = write_tiny_gguf(tmp_path / "bad.gguf", **kwargs)
    with pytest.raises(UnsupportedModelError) as info:
        open_model(path)
    assert named in str(info.value)
