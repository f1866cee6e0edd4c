"""The offline API, shaped like vLLM's ``LLM`` so its users feel at home::

    from pdserve.engine import LLM, SamplingParams
    llm = LLM(model="/path/to/checkpoint", dtype="bfloat16")
    outputs = llm.generate(["Hello, my name is"], SamplingParams(max_tokens=32))
    print(outputs[0].outputs[0].text)
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from pdserve.engine.engine_config import EngineConfig
from pdserve.engine.engine_outputs import EngineOutput
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from pdserve.engine.request import Logprob
from pdserve.engine.sampling_params import SamplingParams

PromptType = str | Sequence[int] | dict


class LLM:
    """Generate from a local Hugging Face checkpoint in this process.

    Keyword arguments are ``EngineConfig`` fields (vLLM's names: ``dtype``,
    ``max_model_len``, ``block_size``, ``max_num_seqs``, ``max_num_batched_tokens``,
    ``enable_prefix_caching``, ``num_gpu_blocks_override``, ``seed``, ...).

    Raises:
        FileNotFoundError, ValueError: from ``EngineConfig`` and the checkpoint checks.
    """

    def __init__(self, model: str, **kwargs: Any) -> None:
        unknown = set(kwargs) - {f.name for f in dataclasses.fields(EngineConfig)}
        if unknown:
            raise TypeError(f"unknown LLM arguments: {sorted(unknown)}")
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._bound_threads: set[int] = set()  # threads whose team is bound (a CPU list)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the engine's other tensor-parallel ranks (a no-op at
        ``tensor_parallel_size=1``; they also exit with this process)."""
        self.engine.shutdown()

    def get_tokenizer(self):
        return self.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Drop the prefix cache (e.g. between benchmark runs of the same prompts); False
        while requests are running. See ``LLMEngine.reset_prefix_cache``."""
        return self.engine.reset_prefix_cache()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False, priority: Sequence[int] | None = None
                 ) -> list[RequestOutput]:
        """Run every prompt to completion; returns one ``RequestOutput`` per prompt, in order.

        A prompt is a string, a list of token ids, or ``{"prompt_token_ids": [...]}``
        (vLLM's ``TokensPrompt``). ``sampling_params`` is one for all or one per prompt.
        ``priority`` (vLLM's): one per prompt, lower scheduled first (default 0 each).

        Raises:
            ValueError: a bad prompt (see ``LLMEngine.make_request``), a string prompt
                without a tokenizer, or a ``sampling_params`` or ``priority`` list of the
                wrong length.
        """
        prompts = _as_prompt_list(prompts)
        if threading.get_ident() not in self._bound_threads:
            self.engine.bind_threads(explicit_only=True)
            self._bound_threads.add(threading.get_ident())
        params = sampling_params or SamplingParams()
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(priorities)} priority values for {len(prompts)} prompts")
        outputs: list[RequestOutput] = []
        by_id: dict[str, tuple[RequestOutput, int]] = {}  # engine request -> (output, index)
        bar = tqdm(total=0, desc="Generating", disable=not use_tqdm)
        try:
            for prompt, prompt_params, rank in zip(prompts, params, priorities):
                output, children = self._add(prompt, prompt_params, rank)
                outputs.append(output)
                by_id.update({child: (output, i) for i, child in enumerate(children)})
            bar.total = len(by_id)
            while self.engine.has_unfinished_requests():
                for delta in self.engine.step():
                    output, index = by_id[delta.request_id]
                    self._merge(output, index, delta)
                    bar.update(delta.finished)
        finally:
            bar.close()
            # A bad prompt or an exception mid-run must not leave requests holding blocks.
            for child in by_id:
                self.engine.abort_request(child)
        return [self._finalize(output) for output in outputs]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | None = None, use_tqdm: bool = False
             ) -> list[RequestOutput]:
        """Apply the checkpoint's chat template to each conversation and generate."""
        from pdserve.engine.tokenizer import apply_chat_template

        if self.tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer, so chat() cannot be used")
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [{"prompt_token_ids": apply_chat_template(self.tokenizer, c)}
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _add(self, prompt: PromptType, params: SamplingParams, priority: int = 0):
        text, token_ids = self._tokenize(prompt)
        base = str(next(self._ids))
        output = RequestOutput(base, text, token_ids)
        children = []
        for index in range(params.n):
            child_params = params
            if params.n > 1 and params.seed is not None:
                child_params = dataclasses.replace(params, seed=params.seed + index, n=1)
            child = f"{base}-{index}" if params.n > 1 else base
            request = self.engine.add_request(child, token_ids, child_params,
                                              priority=priority)
            wants_logprobs = params.logprobs is not None
            output.outputs.append(CompletionOutput(index, "", [], 0.0 if wants_logprobs else None,
                                                   [] if wants_logprobs else None))
            children.append(request.request_id)
        return output, children

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this checkpoint has no tokenizer: pass token ids, not text")
            from pdserve.engine.tokenizer import encode_prompt

            return prompt, encode_prompt(self.tokenizer, prompt)
        return None, [int(t) for t in prompt]

    def _merge(self, output: RequestOutput, index: int, delta: EngineOutput) -> None:
        completion = output.outputs[index]
        completion.token_ids.extend(delta.new_token_ids)
        if completion.logprobs is not None:
            for lp in delta.new_logprobs:
                completion.logprobs.append(_logprob_dict(lp))
                completion.cumulative_logprob += lp.logprob
        output.num_cached_tokens = delta.num_cached_tokens
        if delta.prompt_logprobs is not None and output.prompt_logprobs is None:
            output.prompt_logprobs = [None if lp is None else _logprob_dict(lp)
                                      for lp in delta.prompt_logprobs]
        if delta.finished:
            completion.finish_reason = delta.finish_reason
            completion.stop_reason = delta.stop_reason

    def _finalize(self, output: RequestOutput) -> RequestOutput:
        output.finished = True
        for completion in output.outputs:
            if self.tokenizer is not None:
                completion.text = self.tokenizer.decode(completion.token_ids,
                                                        skip_special_tokens=True)
                for position in completion.logprobs or []:
                    for token_id, lp in position.items():
                        lp.decoded_token = self.tokenizer.decode([token_id])
        return output


def _logprob_dict(lp: Logprob) -> dict[int, TokenLogprob]:
    ranked = {t: TokenLogprob(v, rank) for rank, (t, v) in enumerate(lp.top.items(), start=1)}
    ranked[lp.token_id] = TokenLogprob(lp.logprob, lp.rank)
    return ranked


def _as_prompt_list(prompts) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts
