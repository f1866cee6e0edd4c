"""Speculative decoding: proposals, and their verification in one target forward pass.

A request that speculates proposes ``k`` tokens after its last one; the scheduler runs
its last token and the ``k`` proposals as one chunk (``1 + k`` query rows over the paged
cache, beside every other request of the step), and the target's logits at those rows
decide how many proposals stand (Leviathan et al. 2023, https://arxiv.org/abs/2211.17192;
Chen et al. 2023, https://arxiv.org/abs/2302.01318):

- greedy: proposal ``i`` stands while it equals the argmax of row ``i``; the first row
  whose argmax differs gives the correction, and when all stand, row ``k`` gives a bonus
  token. The output is exactly what decoding one token at a time gives.
- sampled: proposal ``t`` at row ``i`` stands with probability ``p_i(t)`` (the target's
  probability after temperature and the top-k / top-p / min-p filters; a deterministic
  proposer's own probability is 1), else the correction is drawn from ``p_i`` without
  ``t``, renormalised (the residual ``max(p - q, 0)`` of a one-hot ``q``); all standing,
  the bonus is drawn from ``p_k``. Each output token then follows the target's
  distribution. A seeded request draws each uniform from (seed, output index, purpose),
  so it repeats exactly.

Verified tokens append to the request; the KV slots of rejected proposals are not
counted (``num_computed_tokens`` advances past the accepted ones only) and are
overwritten by the next step; a block is hashed into the prefix cache only once it is
full of verified tokens (``KVCacheManager.cache_blocks`` stops at ``num_tokens``).

``--speculative-config`` takes vLLM's JSON keys. Methods: ``ngram`` (prompt lookup: the
last ``n`` tokens, ``prompt_lookup_max >= n >= prompt_lookup_min``, matched against the
request's earlier tokens, the ``k`` tokens after the latest match proposed) and
``suffix`` (SuffixDecoding over the request's tokens and recent requests',
``engine/suffix_decoding.py``, with vLLM's ``suffix_decoding_*`` keys) and
``draft_model`` (a smaller model of the same tokenizer, ``engine/draft_proposer.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields

import numpy as np
import torch

from pdserve.engine.request import Request
from pdserve.engine.seeding import position_seed
from pdserve.engine.suffix_decoding import SuffixSettings

METHODS = ("ngram", "suffix", "draft_model")
_SUFFIX_KEYS = {f"suffix_decoding_{f.name}": f.name for f in fields(SuffixSettings)}
_SPEC_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
              "disable_by_batch_size", "model", *_SUFFIX_KEYS}
DEFAULT_DISABLE_BY_BATCH_SIZE = 8
_ACCEPT_STREAM, _RESIDUAL_STREAM = 0x5BEC_0001, 0x5BEC_0002  # seeded uniforms' purposes


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """vLLM's ``--speculative-config`` keys that pdserve takes.

    ``num_speculative_tokens`` (k): proposals per step, 1 to 16; ``prompt_lookup_max`` /
    ``prompt_lookup_min``: the longest and shortest n-gram matched (ngram; vLLM's
    defaults: both 5, or the one given). ``disable_by_batch_size``: no request proposes
    while this many or more are running (vLLM's key; pdserve's default 8, where vLLM's
    never turns speculation off): a step of many sequences is no longer bound by reading
    the weights, so each proposal's row costs about what a decode row does, and
    rejected ones are lost work (W1 at batch 32 on a 2-core CPU: 0.80x the throughput
    with ngram k=4 on, at 61% acceptance). ``suffix``: the ``suffix_decoding_*`` keys
    (``suffix_decoding.SuffixSettings``). ``model``: the draft model of ``draft_model``
    (a folder, ``.gguf`` file or hub id in the cache; ``engine/draft_proposer.py``).
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 5
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    suffix: SuffixSettings = field(default_factory=SuffixSettings)
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method={self.method!r}: pdserve proposes "
                             f"with {', '.join(METHODS)} (EAGLE and MTP are not "
                             "supported yet)")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative_config.model names the draft model, for method "
                             "draft_model (and only for it)")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"speculative_config.num_speculative_tokens="
                             f"{self.num_speculative_tokens} must be in [1, 16]")
        settings = self.suffix
        if not (1 < settings.max_tree_depth <= 256 and settings.max_cached_requests >= 0
                and settings.max_spec_factor > 0 and 0 <= settings.min_token_prob <= 1):
            raise ValueError(f"speculative_config: suffix_decoding_* out of range: "
                             f"{settings} (max_tree_depth in [2, 256], max_cached_requests "
                             ">= 0, max_spec_factor > 0, min_token_prob in [0, 1])")
        if self.disable_by_batch_size < 1:
            raise ValueError(f"speculative_config.disable_by_batch_size="
                             f"{self.disable_by_batch_size} must be >= 1")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 64:
            raise ValueError(f"speculative_config.prompt_lookup_min={self.prompt_lookup_min} "
                             f"and prompt_lookup_max={self.prompt_lookup_max} must satisfy "
                             "1 <= min <= max <= 64")

    @classmethod
    def parse(cls, value: str | dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From the flag's JSON text (or its dict); None for None or ``{}``.

        Raises:
            ValueError: not JSON, an unknown key, or a bad value, naming it.
        """
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config is not JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be a JSON object")  # noqa: TRY004
        if not value:
            return None
        unknown = sorted(set(value) - _SPEC_KEYS)
        if unknown:
            raise ValueError(f"speculative_config: unknown key {unknown[0]!r} (pdserve takes "
                             f"{', '.join(sorted(_SPEC_KEYS))})")
        if "method" not in value or "num_speculative_tokens" not in value:
            raise ValueError("speculative_config needs method and num_speculative_tokens")
        # NOTE: vLLM's defaults: 5 and 5; one given sets the other
        lookup_max = value.get("prompt_lookup_max", value.get("prompt_lookup_min", 5))
        lookup_min = value.get("prompt_lookup_min", lookup_max)
        for key in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                    "disable_by_batch_size"):
            if key in value and (not isinstance(value[key], int) or isinstance(value[key], bool)):
                raise ValueError(f"speculative_config.{key} must be an integer")
        suffix = SuffixSettings(**{name: value[key] for key, name in _SUFFIX_KEYS.items()
                                   if key in value})
        return cls(str(value["method"]), value["num_speculative_tokens"], lookup_max,
                   lookup_min, value.get("disable_by_batch_size",
                                         DEFAULT_DISABLE_BY_BATCH_SIZE), suffix,
                   value.get("model"))


def ngram_propose(tokens: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    """Prompt lookup decoding (Saxena 2023; vLLM's ``ngram``): the up to ``k`` tokens
    that followed the latest earlier occurrence of the last ``n`` tokens of ``tokens``,
    for the longest ``n`` in ``[n_min, n_max]`` that occurs; ``[]`` when none does.

    Example: tokens ``[1, 2, 3, 9, 1, 2]``, k 2, n 2..1: ``[1, 2]`` occurred at 0, so
    ``[3, 9]``.
    """
    length = len(tokens)
    if length < 2:
        return []
    array = np.asarray(tokens, dtype=np.int64)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = array[length - n:]
        # windows ending before the last token: start positions 0 .. length - n - 1
        windows = np.lib.stride_tricks.sliding_window_view(array[:length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # NOTE: the latest match continues most recently
            return array[start:start + k].tolist()
    return []


def speculates(request: Request) -> bool:
    """Whether ``request``'s sampling lets it speculate: no penalties, ``logit_bias``,
    ``allowed_token_ids``, ``bad_words`` or pending ``min_tokens`` (verification does not
    apply them to the proposals' rows yet; such a request decodes one token a step,
    beside speculating ones). A structured output's grammar checks the proposals
    (``GrammarMatcher.valid_prefix``) and masks each verification row as it would that
    position's step."""
    p = request.sampling_params
    return (p.repetition_penalty == 1.0 and p.presence_penalty == 0.0
            and p.frequency_penalty == 0.0 and not p.logit_bias and not p.allowed_token_ids
            and not p.bad_words_token_ids
            and request.num_output_tokens >= p.min_tokens and not request.remote_decode)


def _uniform(request: Request, index: int, stream: int,
             generator: torch.Generator) -> float:
    """A uniform in [0, 1): a seeded request's from (seed, output index, purpose)."""
    seed = request.sampling_params.seed
    if seed is None:
        return float(torch.rand(1, generator=generator, dtype=torch.float64))
    gen = torch.Generator().manual_seed(position_seed(seed ^ stream, index))
    return float(torch.rand(1, generator=gen, dtype=torch.float64))


def _inverse_transform(probs: torch.Tensor, u: float) -> int:
    """The first token whose cumulative probability reaches ``u * total`` (``probs``
    ``[V]`` fp32, not necessarily normalised)."""
    cdf = torch.cumsum(probs.double(), 0)
    index = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])],
                                                     dtype=torch.float64), right=True))
    return min(index, probs.shape[0] - 1)


def verify(probs: torch.Tensor | None, logits: torch.Tensor, proposals: list[int],
           request: Request, generator: torch.Generator) -> list[int]:
    """The tokens one speculating request outputs after its verification pass.

    Args:
        probs: ``[k + 1, V]`` fp32 target probabilities per row (after temperature and
            filters), or None for a greedy request.
        logits: ``[k + 1, V]`` the rows' logits (greedy: their argmax decides).
        proposals: the ``k`` proposed tokens (row ``i`` verifies ``proposals[i]``).
        request: the request (its seed and output count key the seeded uniforms).
        generator: the sampler's generator, for unseeded requests.

    Returns:
        The accepted proposals, then the correction or bonus token: 1 to ``k + 1`` tokens.
    """
    out: list[int] = []
    if probs is None:
        best = logits.argmax(dim=-1).tolist()
        for i, token in enumerate(proposals):
            if best[i] != token:
                return [*out, best[i]]
            out.append(token)
        return [*out, best[len(proposals)]]
    index = request.num_output_tokens
    for i, token in enumerate(proposals):
        u = _uniform(request, index + i, _ACCEPT_STREAM, generator)
        if u < float(probs[i, token]):
            out.append(token)
            continue
        residual = probs[i].clone()
        residual[token] = 0.0
        if float(residual.sum()) <= 0.0:  # NOTE: p(t) was ~1 and u landed past it
            residual = probs[i]
        u = _uniform(request, index + i, _RESIDUAL_STREAM, generator)
        return [*out, _inverse_transform(residual, u)]
    u = _uniform(request, index + len(proposals), _RESIDUAL_STREAM, generator)
    return [*out, _inverse_transform(probs[len(proposals)], u)]
