"""Chats that reuse their whole history: a reply sent back in the next turn is read as the
model wrote it (router/history.py), so the decode worker that generated it serves the
previous prompt and the reply from its prefix cache."""

from __future__ import annotations

import pytest
from inproc_cluster import in_process_cluster

from pdserve.engine.tokenizer import apply_chat_template
from pdserve.router.history import ReplyTokens

MAX_MODEL_LEN = 1024
BLOCK = 16


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # auto: both workers share this machine's CPUs, so every prompt is prefilled on the
    # decode worker, where the replies' KV is.
    with in_process_cluster(tmp_path_factory.mktemp("history"), MAX_MODEL_LEN,
                            disaggregation="auto") as c:
        yield c


def test_splice_puts_back_the_generated_spelling_only_where_the_text_is(cluster):
    tokenizer = cluster.router.tokenizer
    text = "the seashore"
    canonical = tokenizer.encode(text, add_special_tokens=False)
    spelled = [i for piece in ("the", " sea", "sh", "ore") for i in
               tokenizer.encode(piece, add_special_tokens=False)]
    assert tokenizer.decode(spelled) == text and spelled != canonical
    replies = ReplyTokens(tokenizer, max_entries=2)
    replies.remember(text, spelled + [tokenizer.eos_token_id])  # the stop token is dropped
    prompt = [1, 2, *canonical, 3]
    assert replies.splice(prompt, [text]) == [1, 2, *spelled, 3]
    assert replies.splice(prompt, ["other text"]) == prompt
    assert replies.splice([1, 2, 3], [text]) == [1, 2, 3]  # not in the prompt: unchanged
    replies.remember("a", [5])  # does not decode to "a": not remembered
    for word in ("ocean", "harbour"):  # the LRU keeps max_entries
        letters = [i for ch in word for i in tokenizer.encode(ch, add_special_tokens=False)]
        assert letters != tokenizer.encode(word, add_special_tokens=False)
        replies.remember(word, letters)
    assert replies.splice(prompt, [text]) == prompt  # evicted


@pytest.mark.parametrize("stream", [False, True])
def test_each_turn_reuses_the_previous_prompt_and_reply(cluster, stream):
    client = cluster.client()
    model = cluster.router.served_model_name
    opening = "Tell me a long story about the sea, the ships and the sailors on it. " * 3
    messages = [{"role": "user", "content": f"{opening}({stream})"}]
    history_len = None
    for turn in range(3):
        kwargs = {"model": model, "messages": messages, "max_tokens": 64, "temperature": 0}
        if stream:
            text, usage = "", None
            for chunk in client.chat.completions.create(
                    stream=True, stream_options={"include_usage": True}, **kwargs):
                text += "".join(c.delta.content or "" for c in chunk.choices)
                usage = chunk.usage or usage
        else:
            reply = client.chat.completions.create(**kwargs)
            text, usage = reply.choices[0].message.content, reply.usage
        if history_len is not None:
            # Everything but the last, partly filled block of the history is served from
            # the cache: the previous prompt and the reply, as generated.
            assert usage.prompt_tokens_details.cached_tokens >= history_len // BLOCK * BLOCK \
                - BLOCK, (turn, usage)
        history_len = usage.prompt_tokens + usage.completion_tokens - 1
        messages += [{"role": "assistant", "content": text},
                     {"role": "user", "content": f"And then what happened? ({turn})"}]
    cluster.wait_all_blocks_free()
    # The prompts still say what transformers' template says: only the spelling differs.
    tokenizer = cluster.router.tokenizer
    rendered = tokenizer.decode(apply_chat_template(tokenizer, messages))
    assert "And then what happened? (1)" in rendered
