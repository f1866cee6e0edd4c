"""``prompt_logprobs`` (vLLM's): each prompt token's log-probability under the model,
equal to transformers' teacher-forced log-softmax, whatever the chunking, preemption or
prefix cache (a request asking for them never takes prefix-cache hits)."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts
from transformers import AutoModelForCausalLM

from pdserve.engine import LLM, SamplingParams, model_runner


@pytest.mark.parametrize("settings", [
    {}, {"max_num_batched_tokens": 24},
    {"num_gpu_blocks_override": 8, "max_model_len": 128},
    # both prompts in one step, their logits 7 rows at a time: slices that cross from
    # one prompt's rows into the other's
    {"max_num_batched_tokens": 160, "logits_rows": 7}])
def test_prompt_logprobs_are_transformers_teacher_forced(settings, tiny_checkpoints,
                                                         monkeypatch):
    path = tiny_checkpoints["qwen3"]
    settings = dict(settings)
    if "logits_rows" in settings:
        monkeypatch.setattr(model_runner, "PROMPT_LOGITS_ROWS", settings.pop("logits_rows"))
    prompt = random_prompts([70], seed=3)[0]
    llm = LLM(str(path), dtype="float32", load_progress=False,
              **({"max_model_len": 256} | settings))
    # the same prompt twice: the second would hit the prefix cache without prompt_logprobs
    outputs = llm.generate([prompt, prompt], SamplingParams(
        temperature=0.0, max_tokens=2, prompt_logprobs=2, ignore_eos=True))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = model(torch.tensor([prompt])).logits[0].log_softmax(-1)  # [L, vocab]
    for output in outputs:
        got = output.prompt_logprobs
        assert got[0] is None and len(got) == len(prompt) and output.num_cached_tokens == 0
        for i in range(1, len(prompt)):
            assert got[i][prompt[i]].logprob == pytest.approx(expected[i - 1, prompt[i]].item(),
                                                              abs=1e-4)
            top = expected[i - 1].topk(2).indices.tolist()
            assert set(top) <= set(got[i])  # the top 2 and the prompt's own token
            rank = int((expected[i - 1] > expected[i - 1, prompt[i]]).sum()) + 1
            assert abs(got[i][prompt[i]].rank - rank) <= 1  # NOTE: a near-tie may swap
    assert llm.engine.is_idle_and_clean()


def test_prompt_logprobs_out_of_range_is_refused():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
