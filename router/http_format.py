"""How the HTTP API writes one request's answer: ``Formatter`` collects its choices and
writes OpenAI responses (models) and stream chunks (dicts in the stream models' shape,
``router/protocol/responses.py``); ``CompletionFormatter`` and ``ChatFormatter`` write the
two APIs' shapes (``router/http_openai.py`` serves them)."""

from __future__ import annotations

from pdserve.router.detokenizer import fast_decoder
from pdserve.router.history import ReplyTokens
from pdserve.router.logprobs import (
    chat_logprobs,
    completion_logprobs,
    completion_prompt_logprobs,
    vllm_prompt_logprobs,
)
from pdserve.router.model_service import ModelService
from pdserve.router.output import GenerationChunk
from pdserve.router.protocol import (
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    ChatToolCall,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ToolCallFunction,
    UsageInfo,
    chat_stream_choice,
    chat_stream_chunk,
    completion_stream_choice,
    completion_stream_chunk,
)
from pdserve.router.reasoning import PROMPT_TAIL_TOKENS, ReasoningStream, split_reasoning
from pdserve.router.tool_calling import ToolCalling


class Formatter:
    """Collects one request's choices (``n`` per prompt, indexed ``prompt * n + i``) and
    writes OpenAI responses (models) and stream chunks (dicts in the stream models' shape,
    ``router/protocol/responses.py``); subclasses write the two APIs' shapes."""

    def __init__(self, router: ModelService, request, response_id: str,
                 prompts: list[list[int]]) -> None:
        self.request = request
        self.response_id = response_id
        self.model = router.served_model_name
        self._decode = fast_decoder(router.tokenizer, skip_special_tokens=False)
        self.prompts = prompts
        num_choices = len(prompts) * request.n
        self.texts = [""] * num_choices
        self.logprobs: list[list] = [[] for _ in range(num_choices)]
        self.num_tokens = [0] * num_choices
        self.finish: list[tuple[str | None, int | str | None]] = [(None, None)] * num_choices
        self.cached_tokens = [0] * len(prompts)
        self.prompt_logprobs: list[list | None] = [None] * num_choices
        self.token_ids: list[list[int]] = [[] for _ in range(num_choices)]

    def add(self, index: int, chunk: GenerationChunk) -> None:
        """Record ``chunk`` of choice ``index``."""
        self.texts[index] += chunk.text
        self.logprobs[index] += chunk.logprobs
        self.num_tokens[index] += len(chunk.token_ids)
        self.token_ids[index] += chunk.token_ids
        if chunk.prompt_logprobs is not None:
            self.prompt_logprobs[index] = chunk.prompt_logprobs
        prompt = index // self.request.n
        self.cached_tokens[prompt] = max(self.cached_tokens[prompt], chunk.num_cached_tokens)
        if chunk.finish_reason:
            self.finish[index] = (chunk.finish_reason, chunk.stop_reason)

    def usage(self) -> UsageInfo:
        """Usage so far: prompt tokens (once per prompt), generated tokens, cache hits."""
        return UsageInfo.of(sum(len(p) for p in self.prompts), sum(self.num_tokens),
                            sum(self.cached_tokens))

    def decode_token(self, token_id: int) -> str:
        """The text of one token for logprobs: ``tokenizer.decode([token_id])``, or
        ``token_id:<id>`` with ``return_tokens_as_token_ids`` (vLLM's, for tokens whose
        bytes are not text on their own)."""
        if self.request.return_tokens_as_token_ids:
            return f"token_id:{token_id}"
        return self._decode([token_id])

    def ids(self, token_ids: list[int]) -> list[int] | None:
        """``token_ids`` for an answer's ``token_ids`` / ``prompt_token_ids`` fields when the
        request asked for them (vLLM's ``return_token_ids``), else None (left out)."""
        return list(token_ids) if self.request.return_token_ids else None

    def prompt_logprobs_of(self, index: int) -> list | None:
        """The prompt logprobs of choice ``index``'s prompt: its own, or (a full answer's
        choices after a prompt's first do not ask the workers again) that first choice's."""
        own = self.prompt_logprobs[index]
        return own if own is not None else self.prompt_logprobs[index - index % self.request.n]

    def vllm_prompt_logprobs(self, index: int):
        """vLLM's ``prompt_logprobs`` of choice ``index`` when the request asked for them
        (``PromptLogprobs``), else None."""
        num_top, logprobs = self.request.prompt_logprobs, self.prompt_logprobs_of(index)
        if num_top is None or logprobs is None:
            return None
        return vllm_prompt_logprobs(logprobs, self.decode_token, num_top)

    def stream_start(self) -> list[dict]:
        """Chunks sent before any token (chat: each choice's role)."""
        return []

    def running_usage(self) -> dict | None:
        """The usage so far, for every stream chunk with ``continuous_usage_stats``; else
        None (the chunk's ``usage`` stays null)."""
        return self.usage().model_dump() if self.request.continuous_usage() else None

    def stream_usage(self) -> dict | None:
        """The last chunk, with only usage, when ``stream_options.include_usage``."""
        if not self.request.include_usage():
            return None
        return self._stream_response([], usage=self.usage().model_dump())


class CompletionFormatter(Formatter):
    """``text_completion`` responses; ``echo_texts`` are the prompts' texts with ``echo``."""

    def __init__(self, router: ModelService, request: CompletionRequest, response_id: str,
                 prompts: list[list[int]], echo_texts: list[str] | None) -> None:
        super().__init__(router, request, response_id, prompts)
        self.echo = ["" if echo_texts is None else echo_texts[i // request.n]
                     for i in range(len(self.texts))]
        # echoed logprobs: the prompt tokens' texts' length less the echoed text's, so that
        # the generated tokens' offsets go on from the prompt tokens' (as vLLM's do)
        self._offset_shift = [0] * len(self.texts)

    def add(self, index: int, chunk: GenerationChunk) -> None:
        super().add(index, self._visible(chunk))

    def _visible(self, chunk: GenerationChunk) -> GenerationChunk:
        """``chunk`` as the answer shows it: without its tokens for a request that asked for
        the prompt alone (``CompletionRequest.prompt_only``)."""
        if not self.request.prompt_only():
            return chunk
        return GenerationChunk("", [], [], chunk.num_cached_tokens, chunk.finish_reason,
                               chunk.stop_reason, chunk.prompt_logprobs)

    def _logprobs(self, index: int, logprobs: list, text_offset: int, echoed: bool):
        """Choice ``index``'s ``logprobs`` for the generated ``logprobs`` from
        ``text_offset`` on; ``echoed``: the text starts with the echoed prompt, and so do
        the logprobs (the prompt's)."""
        if self.request.logprobs is None:
            return None
        prompt_logprobs, head = self.prompt_logprobs_of(index), None
        if echoed and self.request.echo and prompt_logprobs is not None:
            head = completion_prompt_logprobs(self.prompts[index // self.request.n],
                                              prompt_logprobs, self.decode_token,
                                              self.request.logprobs)
            end = head.text_offset[-1] + len(head.tokens[-1]) if head.tokens else 0
            self._offset_shift[index] = end - len(self.echo[index])
        out = completion_logprobs(logprobs, self.decode_token,
                                  text_offset + self._offset_shift[index])
        if head is None:
            return out
        for name in ("text_offset", "token_logprobs", "tokens", "top_logprobs"):
            getattr(head, name).extend(getattr(out, name))
        return head

    def stream_chunk(self, index: int, chunk: GenerationChunk) -> dict:
        """Record ``chunk`` of choice ``index``; its ``CompletionStreamResponse`` dict."""
        first = not self.num_tokens[index] and not self.finish[index][0]
        prefix = self.echo[index] if first else ""
        offset = len(self.echo[index]) + len(self.texts[index])
        chunk = self._visible(chunk)
        self.add(index, chunk)
        logprobs = self._logprobs(index, chunk.logprobs, offset, first)
        return self._stream_response([completion_stream_choice(
            index, prefix + chunk.text, chunk.finish_reason, chunk.stop_reason,
            None if logprobs is None else logprobs.model_dump(), self.ids(chunk.token_ids),
            self.ids(self.prompts[index // self.request.n]) if first else None)],
            self.running_usage())

    def _stream_response(self, choices: list[dict], usage: dict | None = None) -> dict:
        return completion_stream_chunk(self.response_id, self.model, choices, usage)

    def response(self) -> CompletionResponse:
        choices = [CompletionChoice(
            index=i, text=self.echo[i] + text, finish_reason=self.finish[i][0],
            stop_reason=self.finish[i][1],
            logprobs=self._logprobs(i, self.logprobs[i], len(self.echo[i]), True),
            token_ids=self.ids(self.token_ids[i]),
            prompt_token_ids=self.ids(self.prompts[i // self.request.n]),
            prompt_logprobs=self.vllm_prompt_logprobs(i))
            for i, text in enumerate(self.texts)]
        return CompletionResponse(id=self.response_id, model=self.model, choices=choices,
                                  usage=self.usage())


class ChatFormatter(Formatter):
    """``chat.completion`` responses and ``chat.completion.chunk`` stream chunks; under
    ``--reasoning-parser`` each choice's reasoning block is split off its content
    (``router/reasoning.py``; not for a request whose output a grammar writes: structured
    output, ``tool_choice`` required or named); with ``tools``, the content is read for
    tool calls (``ToolCalling``)."""

    def __init__(self, router: ModelService, request: ChatCompletionRequest, response_id: str,
                 prompts: list[list[int]], tools: ToolCalling | None = None,
                 replies: ReplyTokens | None = None) -> None:
        super().__init__(router, request, response_id, prompts)
        self.tools = tools
        self.replies = replies
        self._streams = [tools.stream() if tools else None for _ in self.texts]
        self._has_calls = [False] * len(self.texts)
        constrained = request.structured_output_spec() is not None or (
            tools is not None and tools.spec is not None)
        self._parser = None if constrained else router.config.reasoning_parser
        self._prompt_tail = router.tokenizer.decode(
            prompts[0][-PROMPT_TAIL_TOKENS:]) if self._parser else ""
        self._reasoning = [ReasoningStream(self._parser, self._prompt_tail) if self._parser
                           else None for _ in self.texts]

    def add(self, index: int, chunk: GenerationChunk) -> None:
        """Record ``chunk`` of choice ``index``; a finished plain-text reply's token ids
        are remembered for the next turn (``ReplyTokens``)."""
        super().add(index, chunk)
        if chunk.finish_reason and self.replies is not None and self.tools is None:
            self.replies.remember(self.texts[index], self.token_ids[index])

    def _logprobs(self, logprobs: list):
        if not self.request.logprobs:
            return None
        return chat_logprobs(logprobs, self.decode_token, self.request.top_logprobs or 0)

    def _finish_reason(self, index: int, reason: str | None) -> str | None:
        if reason == "stop" and self._has_calls[index] and self.tools.finish_as_tool_calls:
            return "tool_calls"
        return reason

    def stream_start(self) -> list[dict]:
        """Each choice's role chunk, then, under ``echo``, one with the echoed content."""
        chunks = [self._stream_response([chat_stream_choice(i, "", role="assistant")],
                                        self.running_usage(), self.ids(self.prompts[0]))
                  for i in range(len(self.texts))]
        if echoed := self.request.echoed():
            chunks += [self._stream_response([chat_stream_choice(i, echoed)],
                                             self.running_usage())
                       for i in range(len(self.texts))]
        return chunks

    def stream_chunk(self, index: int, chunk: GenerationChunk) -> dict:
        """Record ``chunk`` of choice ``index``; its ``ChatCompletionStreamResponse`` dict."""
        self.add(index, chunk)
        logprobs = self._logprobs(chunk.logprobs)
        content, calls, reasoning = chunk.text, [], None
        final = chunk.finish_reason is not None
        if (split := self._reasoning[index]) is not None:
            reasoning, content = split.feed(content, final)
            reasoning = reasoning if reasoning and self.request.include_reasoning else None
        stream = self._streams[index]
        if stream is not None:
            first = len(stream.calls)
            content, new = stream.feed(content, final=final)
            calls = [(first + i, call_id, c.name, c.arguments)
                     for i, (call_id, c) in enumerate(new)]
            self._has_calls[index] |= bool(stream.calls)
        return self._stream_response([chat_stream_choice(
            index, content, finish_reason=self._finish_reason(index, chunk.finish_reason),
            stop_reason=chunk.stop_reason,
            logprobs=None if logprobs is None else logprobs.model_dump(), tool_calls=calls,
            token_ids=self.ids(chunk.token_ids), reasoning=reasoning)], self.running_usage())

    def _stream_response(self, choices: list[dict], usage: dict | None = None,
                         prompt_token_ids: list[int] | None = None) -> dict:
        return chat_stream_chunk(self.response_id, self.model, choices, usage, prompt_token_ids)

    def _message(self, index: int) -> ChatResponseMessage:
        text, echoed, reasoning = self.texts[index], self.request.echoed(), None
        if self._parser:
            reasoning, text = split_reasoning(self._parser, text, self._prompt_tail)
        empty = "" if reasoning is None else None  # vLLM's: no content after the block
        if not self.request.include_reasoning:
            reasoning = None
        if self.tools is None:
            return ChatResponseMessage(content=(echoed + text) or empty, reasoning=reasoning)
        stream = self.tools.stream()
        content, calls = stream.feed(text, final=True)
        self._has_calls[index] = bool(calls)
        content = echoed + content
        return ChatResponseMessage(content=content or (None if calls else empty),
                                   reasoning=reasoning, tool_calls=[
            ChatToolCall(id=call_id, function=ToolCallFunction(name=c.name, arguments=c.arguments))
            for call_id, c in calls])

    def response(self) -> ChatCompletionResponse:
        messages = [self._message(i) for i in range(len(self.texts))]
        choices = [ChatCompletionChoice(
            index=i, message=message,
            finish_reason=self._finish_reason(i, self.finish[i][0]),
            stop_reason=self.finish[i][1], logprobs=self._logprobs(self.logprobs[i]),
            token_ids=self.ids(self.token_ids[i]))
            for i, message in enumerate(messages)]
        return ChatCompletionResponse(id=self.response_id, model=self.model, choices=choices,
                                      usage=self.usage(),
                                      prompt_logprobs=self.vllm_prompt_logprobs(0),
                                      prompt_token_ids=self.ids(self.prompts[0]))
