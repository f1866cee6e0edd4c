"""``GenerateRequest``: one sequence for the router to generate, as the HTTP and gRPC APIs
hand it to ``ModelService.generate`` (``router/model_service.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class GenerateRequest:
    """One sequence to generate: token ids, engine parameters, and the router's own
    options (stop strings, detokenization, ``cache_salt``, ``priority``: vLLM's, lower
    scheduled first by the workers)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    cache_salt: str | None = None
    priority: int = 0
