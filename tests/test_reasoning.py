"""Reasoning outputs (vLLM's ``--reasoning-parser``): the ``<think>`` block split off the
content, whole and streamed in pieces cut anywhere (``router/reasoning.py``), and end to
end through a cluster on the demo model (a real Redis, real gRPC, the router behind a real
HTTP port) under ``qwen3``: a prompt that ends inside an open block makes the reply
reasoning, streamed as ``delta.reasoning``; ``include_reasoning: false`` leaves it out;
a reply a grammar writes is content."""

from __future__ import annotations

import random

import httpx
import pytest
from inproc_cluster import in_process_cluster

from pdserve.router.config import RouterConfig
from pdserve.router.reasoning import ReasoningStream, prompt_opens_reasoning, split_reasoning

REPLIES = [  # (parser, prompt tail, reply, reasoning, content)
    ("deepseek_r1", "", "weigh it</think>\n\nYes.", "weigh it", "\n\nYes."),
    ("deepseek_r1", "", "<think>weigh it</think>Yes.", "weigh it", "Yes."),
    ("deepseek_r1", "", "cut off before the end", "cut off before the end", ""),
    ("deepseek_r1", "", "a</think>b</think>c", "a", "b</think>c"),
    ("qwen3", "", "\n<think>\nweigh it\n</think>\n\nYes.", "\nweigh it\n", "\n\nYes."),
    ("qwen3", "", "Yes, no block.", None, "Yes, no block."),
    ("qwen3", "", "Yes.</think> a stray tag", None, "Yes.</think> a stray tag"),
    ("qwen3", "<|im_start|>assistant\n<think>\n", "weigh it</think>Yes.", "weigh it", "Yes."),
    ("qwen3", "<think>\n\n</think>\n\n", "Yes.", None, "Yes."),
    ("qwen3", "", "<thin", None, "<thin"),
    ("qwen3", "", "<think>unfinished </thi", "unfinished </thi", ""),
    ("qwen3", "", "", None, ""),
]


@pytest.mark.parametrize("parser, tail, reply, reasoning, content", REPLIES)
def test_a_reply_splits_the_same_whole_and_in_any_pieces(parser, tail, reply, reasoning,
                                                         content):
    assert split_reasoning(parser, reply, tail) == (reasoning, content)
    rng = random.Random(len(reply))
    for _ in range(30):
        cuts = sorted(rng.sample(range(len(reply) + 1), min(len(reply) + 1, rng.randint(1, 6))))
        pieces = [reply[a:b] for a, b in zip([0, *cuts], [*cuts, len(reply)])]
        stream = ReasoningStream(parser, tail)
        deltas = [stream.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
        assert "".join(r for r, _ in deltas) == (reasoning or "")
        assert "".join(c for _, c in deltas) == content
        for r, _ in deltas:  # never a piece of a tag in the reasoning
            assert "</think>" not in r


def test_an_open_block_is_the_last_tag_of_the_prompt():
    assert prompt_opens_reasoning("x<think>\n")
    assert not prompt_opens_reasoning("<think>a</think>\n")
    assert prompt_opens_reasoning("<think>a</think> then <think>")
    assert not prompt_opens_reasoning("")


def test_an_unknown_parser_is_refused_naming_it():
    with pytest.raises(ValueError, match="reasoning_parser"):
        ReasoningStream("granite")
    with pytest.raises(ValueError, match="reasoning_parser"):
        RouterConfig("m", "redis://x", reasoning_parser="granite")


MAX_MODEL_LEN = 256
OPEN = [{"role": "user", "content": "Think it over. <think>"}]
CLOSED = [{"role": "user", "content": "No thinking. <think> </think>"}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with in_process_cluster(tmp_path_factory.mktemp("reasoning"), MAX_MODEL_LEN,
                            reasoning_parser="qwen3") as cluster:
        yield cluster


def chat(cluster, messages, **body) -> dict:
    with httpx.Client(base_url=cluster.url, timeout=60) as http:
        reply = http.post("/v1/chat/completions", json={
            "model": str(cluster.model), "messages": messages, "max_tokens": 12,
            "temperature": 0, "ignore_eos": True, **body})
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_a_prompt_inside_an_open_block_makes_the_reply_reasoning(cluster):
    expected = cluster.expected(OPEN, temperature=0, max_tokens=12, ignore_eos=True)
    assert "</think>" not in expected  # random weights: the block stays open
    message = chat(cluster, OPEN)["choices"][0]["message"]
    assert message["reasoning"] == expected.removeprefix("<think>")
    assert message["content"] is None
    streamed = cluster.client().chat.completions.create(
        model=str(cluster.model), messages=OPEN, max_tokens=12, temperature=0, stream=True,
        extra_body={"ignore_eos": True})
    reasoning = content = ""
    for chunk in streamed:
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning", None) or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == (message["reasoning"], "")
    hidden = chat(cluster, OPEN, include_reasoning=False)["choices"][0]["message"]
    assert "reasoning" not in hidden and hidden["content"] is None


def test_a_closed_block_or_a_grammar_leaves_the_reply_content(cluster):
    expected = cluster.expected(CLOSED, temperature=0, max_tokens=12, ignore_eos=True)
    message = chat(cluster, CLOSED)["choices"][0]["message"]
    assert "reasoning" not in message and message["content"] == expected
    constrained = chat(cluster, OPEN, max_tokens=30, ignore_eos=False, structured_outputs={
        "choice": ["yes", "no"]})["choices"][0]["message"]
    assert "reasoning" not in constrained and constrained["content"] in ("yes", "no")
    cluster.wait_all_blocks_free()
