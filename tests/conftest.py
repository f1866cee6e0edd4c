"""Shared test helpers: tiny random checkpoints written by transformers itself."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 320,
        "max_position_embeddings": 512}

# name -> (transformers config class, model class, extra config fields)
ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama31": ("LlamaConfig", "LlamaForCausalLM", {"rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None, "head_dim": 16}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),
}


def write_tiny_checkpoint(path: Path, arch: str, dtype: torch.dtype = torch.float32,
                          seed: int = 0, random_norms: bool = False, **overrides) -> Path:
    """Write a tiny random checkpoint of ``arch`` with transformers' ``save_pretrained``.
    ``random_norms``: every norm weight drawn from [0.5, 1.5) (transformers starts them all
    at 1, where a test could not tell two norms apart)."""
    import transformers

    config_cls, model_cls, extra = ARCHITECTURES[arch]
    config = getattr(transformers, config_cls)(**{**TINY, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).to(dtype).eval()
    if random_norms:
        with torch.no_grad():
            for name, weight in model.named_parameters():
                if "norm" in name:
                    weight.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """One fp32 checkpoint per supported architecture variant."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {arch: write_tiny_checkpoint(root / arch, arch) for arch in ARCHITECTURES}


def random_prompts(lengths, vocab_size: int = TINY["vocab_size"], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lengths]


def transformers_greedy(model, prompts, new_tokens: int) -> list[tuple[list[int], torch.Tensor]]:
    """transformers' greedy ``generate`` of exactly ``new_tokens`` tokens after each
    prompt (no EOS stop) with a loaded ``model``: per prompt (token ids, ``[steps,
    vocab]`` log-softmax of each step's logits), the oracle ``assert_matches_transformers``
    takes."""
    results = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             eos_token_id=None, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True)
        results.append((out.sequences[0, len(prompt):].tolist(),
                        torch.stack(out.logits)[:, 0].log_softmax(-1)))
    return results


def assert_matches_transformers(outputs, expected, abs_tol: float = 1e-4) -> None:
    """Each pdserve output's greedy tokens equal transformers' (``expected``: per prompt,
    (token ids, [steps, vocab] log-softmax), as ``transformers_greedy`` gives), and each
    chosen token's logprob is within ``abs_tol`` of transformers'."""
    assert len(outputs) == len(expected)
    for output, (tokens, logprobs) in zip(outputs, expected):
        completion = output.outputs[0]
        assert completion.token_ids == tokens
        for step, (token, position) in enumerate(zip(tokens, completion.logprobs)):
            assert position[token].logprob == pytest.approx(logprobs[step, token].item(),
                                                            abs=abs_tol)


def stop_cluster(launcher, redis, loop, thread) -> None:
    """Tear down a module's cluster: the Ray workers (if Ray started), Redis, and the
    event loop thread that served the router."""
    if launcher is not None:
        launcher.shutdown()
    redis.close()
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
