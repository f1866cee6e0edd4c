"""Reasoning outputs (vLLM's ``--reasoning-parser``): a reasoning model's chat reply split
into its reasoning, ``message.reasoning`` (``delta.reasoning`` when streamed), and its
content, the rest (docs/architecture.md, Reasoning outputs).

Both parsers read the ``<think>`` ... ``</think>`` block, with vLLM's names:

- ``deepseek_r1`` (DeepSeek-R1 and its distills, QwQ): the reply is reasoning up to
  ``</think>``, content after it; a ``<think>`` it opens with is dropped; a reply with no
  ``</think>`` (cut off by ``max_tokens``) is reasoning whole.
- ``qwen3`` (Qwen3, Qwen3-Thinking): the same, where the reply opens with ``<think>`` or
  the prompt ends inside an open one (the thinking models' templates write ``<think>`` into
  the generation prompt); otherwise (``enable_thinking: false``, whose template closes an
  empty block in the prompt) the reply is content whole.

The tags are matched in the text, so a tag split across streamed chunks is held back
until it is whole; the tool-call parser reads the content only.
"""

from __future__ import annotations

from pdserve.router.config import REASONING_PARSERS

THINK_START, THINK_END = "<think>", "</think>"
PROMPT_TAIL_TOKENS = 16  # the generation prompt's end, where a template opens the block


def prompt_opens_reasoning(prompt_tail: str) -> bool:
    """Whether the prompt's end (``prompt_tail``, text) leaves a ``<think>`` open."""
    return prompt_tail.rfind(THINK_START) > prompt_tail.rfind(THINK_END)


def _held(text: str, tag: str) -> int:
    """The length of ``text``'s longest end that begins ``tag`` (held back: the tag may be
    completed by the next chunk)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningStream:
    """One choice's reply, fed as it streams: ``feed`` returns what each piece adds to the
    reasoning and to the content. ``parser``: one of ``REASONING_PARSERS``;
    ``prompt_tail``: the prompt's last ``PROMPT_TAIL_TOKENS`` tokens, decoded.

    Raises:
        ValueError: an unknown ``parser``.
    """

    def __init__(self, parser: str, prompt_tail: str = "") -> None:
        if parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser={parser!r} must be one of "
                             f"{list(REASONING_PARSERS)}")
        # "open": before the reply's first text, in reasoning (a leading <think> dropped);
        # "start": before it, not in reasoning (a leading <think> opens it);
        # "reasoning": inside the block; "content": past it, or there was none
        self.state = "open" if parser == "deepseek_r1" or prompt_opens_reasoning(
            prompt_tail) else "start"
        self.buffer = ""  # text held back: a tag may be in it
        self.reasoning = ""  # the whole reasoning so far
        self.entered = False  # a reasoning block was entered (message.reasoning is set)

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """Take ``text``, the reply's next piece (``final``: its last); returns (reasoning
        added, content added)."""
        self.buffer += text
        reasoning = content = ""
        if self.state in ("open", "start"):
            lead = self.buffer.lstrip()
            if THINK_START.startswith(lead) and lead != THINK_START and not final:
                return "", ""  # maybe the opening tag, not yet whole
            if lead.startswith(THINK_START):
                self.buffer = lead[len(THINK_START):]
                self.state = "reasoning"
            else:
                self.state = "reasoning" if self.state == "open" else "content"
            self.entered = self.state == "reasoning"
        if self.state == "reasoning":
            end = self.buffer.find(THINK_END)
            if end >= 0:
                reasoning, self.buffer = self.buffer[:end], self.buffer[end + len(THINK_END):]
                self.state = "content"
            else:
                keep = 0 if final else _held(self.buffer, THINK_END)
                reasoning = self.buffer[:len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep:]
        if self.state == "content":
            content, self.buffer = self.buffer, ""
        self.reasoning += reasoning
        return reasoning, content


def split_reasoning(parser: str, text: str, prompt_tail: str = "") -> tuple[str | None, str]:
    """A whole reply as (reasoning, content): reasoning None where the reply has no
    reasoning block (``ReasoningStream``'s rules)."""
    stream = ReasoningStream(parser, prompt_tail)
    _, content = stream.feed(text, final=True)
    return (stream.reasoning if stream.entered else None), content
