"""Sampling parameters, with vLLM's names and defaults."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.structured_output import StructuredOutputSpec

MAX_LOGPROBS = 20  # top logprobs per token (OpenAI's top_logprobs limit)
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_ALLOWED_TOKEN_IDS = 1 << 18  # more than any vocabulary pdserve loads
MAX_BAD_WORDS = 256  # token sequences of bad_words (vLLM's), each of at most ...
MAX_BAD_WORD_TOKENS = 64  # ... this many tokens
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range: [-100, 100]


class SamplingParamError(ValueError):
    """A sampling parameter out of range: ``param`` names it (e.g. ``top_k``), the
    message says the value and the rule (``top_k=-5 is invalid: ...``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class SamplingParams:
    """How to choose each generated token (vLLM's ``SamplingParams`` names).

    ``temperature == 0`` is greedy. Filters apply in the order min-p, top-k, top-p to the
    penalised, temperature-scaled logits. Penalties follow vLLM: ``repetition_penalty``
    (CTRL, https://arxiv.org/abs/1909.05858) over prompt and output tokens,
    ``presence_penalty`` and ``frequency_penalty`` (OpenAI API) over output tokens.
    A ``seed`` makes sampling reproducible per token position (docs/architecture.md).
    ``logprobs`` asks for the sampled token's log-probability plus the top ``logprobs``
    alternatives, computed from the raw model logits; ``prompt_logprobs`` the same for each
    prompt token after the first (vLLM's: the prompt is then computed whole, never taken
    from the prefix cache, so every position has logits). ``logit_bias`` (OpenAI's) adds
    ``bias`` to token ``id``'s logit before penalties, greedy choice and sampling (at most
    ``MAX_LOGIT_BIAS_ENTRIES`` ids, each bias in [-100, 100]; -100 in practice bans a
    token, +100 forces it); logprobs stay those of the raw logits. ``structured_output``
    (``engine/structured_output.py``) constrains the output to a JSON schema, any JSON
    object, a regex, a choice or a grammar: tokens the grammar forbids are masked after
    ``logit_bias`` and penalties, and the request stops (``finish_reason`` "stop") when
    the grammar is complete and EOS is sampled. The grammar decides where the output
    ends, so it takes no ``min_tokens``. ``allowed_token_ids`` (vLLM's) leaves only those
    tokens to sample or take greedily (the others' logits set to -inf before
    ``logit_bias``; at most ``MAX_ALLOWED_TOKEN_IDS``, not with ``structured_output``,
    whose grammar decides that itself); logprobs stay those of the raw logits.
    ``bad_words_token_ids`` (vLLM's ``bad_words``, tokenized by the caller:
    ``engine.tokenizer.bad_word_sequences``) bans, for each sequence, its last token
    wherever the output so far ends with the rest of it (a one-token sequence: always).

    Raises:
        SamplingParamError: from ``__post_init__`` (a ValueError), naming the field
            (``param``) and the allowed range.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    structured_output: StructuredOutputSpec | None = None
    allowed_token_ids: list[int] | None = None
    bad_words_token_ids: list[list[int]] | None = None

    def __post_init__(self) -> None:
        self.stop_token_ids = list(self.stop_token_ids or [])
        if not self.logit_bias:
            self.logit_bias = None
        if self.top_k == -1:
            self.top_k = 0
        _check(self.n >= 1, "n", self.n, "must be >= 1")
        _check(self.temperature >= 0.0, "temperature", self.temperature, "must be >= 0")
        _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "must be in (0, 1]")
        _check(self.top_k >= 0, "top_k", self.top_k, "must be -1 (off), 0 (off) or >= 1")
        _check(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "must be in [0, 1]")
        _check(self.repetition_penalty > 0.0, "repetition_penalty", self.repetition_penalty,
               "must be > 0")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", self.presence_penalty,
               "must be in [-2, 2]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
               self.frequency_penalty, "must be in [-2, 2]")
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", self.max_tokens,
               "must be >= 1")
        _check(self.min_tokens >= 0, "min_tokens", self.min_tokens, "must be >= 0")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               self.min_tokens, f"must be <= max_tokens ({self.max_tokens})")
        _check(self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs",
               self.logprobs, f"must be in [0, {MAX_LOGPROBS}]")
        _check(self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
               "prompt_logprobs", self.prompt_logprobs, f"must be in [0, {MAX_LOGPROBS}]")
        _check(self.seed is None or 0 <= self.seed < 2**63, "seed", self.seed,
               "must be in [0, 2**63)")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", self.stop_token_ids,
               "must be non-negative token ids")
        if self.logit_bias is not None:
            _check(len(self.logit_bias) <= MAX_LOGIT_BIAS_ENTRIES, "logit_bias",
                   f"<{len(self.logit_bias)} entries>",
                   f"must have at most {MAX_LOGIT_BIAS_ENTRIES} entries")
            for token_id, bias in self.logit_bias.items():
                _check(isinstance(token_id, int) and token_id >= 0, "logit_bias", token_id,
                       "keys must be non-negative token ids")
                _check(-LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT, "logit_bias", bias,
                       "values must be in [-100, 100]")

        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
            _check(0 < len(self.allowed_token_ids) <= MAX_ALLOWED_TOKEN_IDS,
                   "allowed_token_ids", f"<{len(self.allowed_token_ids)} ids>",
                   f"must hold 1 to {MAX_ALLOWED_TOKEN_IDS} token ids")
            _check(all(isinstance(t, int) and t >= 0 for t in self.allowed_token_ids),
                   "allowed_token_ids", self.allowed_token_ids[:8],
                   "must be non-negative token ids")
            _check(self.structured_output is None, "allowed_token_ids",
                   f"<{len(self.allowed_token_ids)} ids>", "cannot be combined with "
                   "structured output (its grammar decides which tokens may come)")
        if self.bad_words_token_ids is not None:
            self.bad_words_token_ids = [list(s) for s in self.bad_words_token_ids] or None
            sequences = self.bad_words_token_ids or []
            _check(len(sequences) <= MAX_BAD_WORDS, "bad_words", f"<{len(sequences)} words>",
                   f"must hold at most {MAX_BAD_WORDS} token sequences")
            _check(all(0 < len(s) <= MAX_BAD_WORD_TOKENS and
                       all(isinstance(t, int) and t >= 0 for t in s) for s in sequences),
                   "bad_words", "<token sequences>", f"each must be 1 to "
                   f"{MAX_BAD_WORD_TOKENS} non-negative token ids")
        _check(self.structured_output is None or self.min_tokens == 0, "min_tokens",
               self.min_tokens, "must be 0 with structured output (the grammar decides "
               "where the output ends)")

    @property
    def greedy(self) -> bool:
        """True when the argmax token is taken (``temperature == 0``)."""
        return self.temperature < 1e-5


def _check(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        raise SamplingParamError(f"{name}={value!r} is invalid: {rule}", name)
