"""The families beyond Llama's (issue 25): Gemma 2 and 3, Phi-3, Mistral and Qwen2 with
sliding windows shorter than the prompts, Llama 3.2 and SmolLM with tied embeddings. Each
is a tiny random checkpoint written by transformers, whose greedy tokens and logprobs are
the oracle: through ``LLM`` (with chunked prefill, so windows cross chunks, with
preemption, and at tensor_parallel_size=2 over gloo), and through a disaggregated cluster (every prompt prefilled by the prefill
worker, its KV pulled by the decode worker).
"""

from __future__ import annotations

import shutil

import pytest
import torch
import transformers
from conftest import random_prompts, transformers_greedy
from inproc_cluster import in_process_cluster

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.demo_model import VOCAB_SIZE, make_demo_model

WINDOW = 8
BASE = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": 256}
SLIDING_FULL = ["sliding_attention", "full_attention"] * 2
# name -> (config class, model class, fields beyond BASE)
FAMILIES = {
    # weights large enough for the soft-caps to bite (the attention cap moves the logits
    # by up to ~9, the final one holds them within +-2 from ~28)
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {
        "head_dim": 16, "sliding_window": WINDOW, "query_pre_attn_scalar": 24,
        "attn_logit_softcapping": 1.5, "final_logit_softcapping": 2.0,
        "initializer_range": 0.5}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "head_dim": 16, "sliding_window": WINDOW, "layer_types": SLIDING_FULL,
        "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 4.0,
                                               "rope_theta": 1e6},
                            "sliding_attention": {"rope_type": "default",
                                                  "rope_theta": 1e4}}}),
    # LongRoPE: prompts and outputs past original_max_position_embeddings take the long
    # factors; a window on every layer as Phi-3-mini-4k's
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {
        "sliding_window": 24, "original_max_position_embeddings": 64,
        "rope_scaling": {"type": "longrope", "short_factor": [1.0 + i / 8 for i in range(8)],
                         "long_factor": [2.0 + i / 4 for i in range(8)]},
        "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"head_dim": 16,
                                                        "sliding_window": WINDOW}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"use_sliding_window": True,
                                                  "sliding_window": WINDOW,
                                                  "max_window_layers": 2}),
    "llama32": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True, "rope_scaling": {
        "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}}),
    "smollm": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True,
                                                   "rope_theta": 100000.0}),
}
SERVED = ("gemma2", "gemma3", "phi3", "mistral", "qwen2")
PROMPT_LENGTHS = [5, 20, 45, 70]
NEW_TOKENS = 16
# preemption: 8 blocks of 16 cannot hold the 4 sequences (they need 15), unless every
# layer slides and the blocks before the windows are freed
SETTINGS = {"chunked_prefill": {"max_num_batched_tokens": 24, "max_model_len": 256},
            "preemption": {"num_gpu_blocks_override": 8, "max_num_batched_tokens": 256,
                           "max_model_len": 128},
            # issue 27: two ranks over gloo, each with 2 of the 4 heads, 1 of the 2 KV heads
            # and half the MLP and vocabulary, chunked prefill across them
            "tensor_parallel": {"tensor_parallel_size": 2, "max_num_batched_tokens": 24,
                                "max_model_len": 256}}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    """One fp32 checkpoint per family, with the demo model's tokenizer (its vocabulary is
    BASE's) so the router can serve them."""
    root = tmp_path_factory.mktemp("families")
    demo = make_demo_model(root / "demo")
    made = {}
    for name, (config_cls, model_cls, extra) in FAMILIES.items():
        config = getattr(transformers, config_cls)(**{**BASE, **extra})
        torch.manual_seed(0)
        model = getattr(transformers, model_cls)(config).eval()
        model.save_pretrained(root / name)
        for tokenizer_file in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(demo / tokenizer_file, root / name / tokenizer_file)
        made[name] = root / name
    return made


def hf_greedy(path, prompts):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return transformers_greedy(model, prompts, NEW_TOKENS)


@pytest.fixture(scope="module")
def oracle(checkpoints):
    prompts = random_prompts(PROMPT_LENGTHS, vocab_size=VOCAB_SIZE, seed=4)
    return prompts, {name: hf_greedy(path, prompts)
                     for name, path in checkpoints.items()}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_matches_transformers(family, setting, checkpoints, oracle):
    prompts, expected = oracle
    llm = LLM(str(checkpoints[family]), dtype="float32", load_progress=False,
              **SETTINGS[setting])
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                                   ignore_eos=True, logprobs=2))
    if setting == "preemption" and llm.engine.model_config.kv_free_window is None:
        assert llm.engine.scheduler.num_preemptions_total > 0
    for prompt, output, (ref_tokens, ref_logprobs) in zip(prompts, outputs, expected[family]):
        completion = output.outputs[0]
        assert completion.token_ids == ref_tokens, f"prompt of {len(prompt)} tokens"
        for step, (token, position) in enumerate(zip(ref_tokens, completion.logprobs)):
            assert position[token].logprob == pytest.approx(
                ref_logprobs[step, token].item(), abs=1e-4)
    assert llm.engine.is_idle_and_clean()
    llm.shutdown()


def test_the_families_switches_are_read_from_their_configs(checkpoints):
    from pdserve.engine.config import ModelConfig

    gemma2 = ModelConfig.from_pretrained(checkpoints["gemma2"])
    assert gemma2.layer_windows == (WINDOW, None, WINDOW, None)
    assert gemma2.softmax_scale == 24 ** -0.5 and gemma2.attn_logit_softcapping == 1.5
    assert gemma2.final_logit_softcapping == 2.0 and gemma2.hidden_act == "gelu_pytorch_tanh"
    assert gemma2.embed_scale == 64 ** 0.5 and gemma2.kv_free_window is None
    gemma3 = ModelConfig.from_pretrained(checkpoints["gemma3"])
    assert gemma3.qk_norm and gemma3.rope_parameters["rope_theta"] == 1e6
    assert gemma3.local_rope_parameters["rope_theta"] == 1e4
    phi3 = ModelConfig.from_pretrained(checkpoints["phi3"])
    assert phi3.rope_type == "longrope" and phi3.fused_checkpoint
    assert phi3.kv_free_window == 24
    assert ModelConfig.from_pretrained(checkpoints["mistral"]).kv_free_window == WINDOW
    assert ModelConfig.from_pretrained(checkpoints["qwen2"]).layer_windows == (
        None, None, WINDOW, WINDOW)


def test_blocks_before_every_window_are_freed_as_a_request_runs(checkpoints):
    """Mistral slides every layer: a 70-token prompt plus its output holds only the blocks
    its window reaches, not the whole sequence's; the table's other entries are -1."""
    llm = LLM(str(checkpoints["mistral"]), dtype="float32", max_model_len=256,
              load_progress=False, block_size=4)
    engine = llm.engine
    engine.add_request("r", random_prompts([70], vocab_size=VOCAB_SIZE)[0],
                       SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    held = []
    while engine.has_unfinished_requests():
        engine.step()
        table = engine.kv_cache_manager.block_ids("r")
        if table:
            held.append(sum(b >= 0 for b in table))
            assert all(b == -1 for b in table[:len(table) - held[-1]])
    # the window (8 tokens) spans at most 3 blocks of 4, plus the one being filled
    assert max(held[1:]) <= 4 < 70 // 4
    assert engine.is_idle_and_clean()


@pytest.mark.parametrize("family", SERVED)
def test_served_disaggregated_equals_offline(family, checkpoints, tmp_path):
    """Through the router with a prefill and a decode worker (``--disaggregation always``):
    the served greedy text equals the offline engine's, which equals transformers'."""
    words = "the KV cache of a sliding window model holds only the last tokens it needs " * 4
    prompts = [words, "a short one " * 5]
    with in_process_cluster(tmp_path, 256, model=checkpoints[family],
                            disaggregation="always", local_prefill_threshold=4) as cluster:
        client = cluster.client()
        for prompt in prompts:
            reply = client.completions.create(model=str(checkpoints[family]), prompt=prompt,
                                              max_tokens=12, temperature=0.0,
                                              extra_body={"ignore_eos": True})
            assert reply.choices[0].text == cluster.expected(
                prompt, temperature=0.0, max_tokens=12, ignore_eos=True)
        assert cluster.prefill_paths().get("remote", 0) >= len(prompts)
        cluster.wait_all_blocks_free()
