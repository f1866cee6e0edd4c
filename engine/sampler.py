"""Batched token sampling: penalties, temperature, top-k / top-p / min-p, seeded draws.

Order of operations (vLLM's): logprobs from the raw logits; then ``allowed_token_ids`` (the
other tokens to -inf) and ``bad_words_token_ids``; then ``logit_bias``; then
repetition, frequency and presence penalties and the ``min_tokens`` ban on stop tokens; then
the structured output bitmask of the rows that have a grammar (``engine/structured_output.py``;
a batch without one does no extra work); then greedy rows take the argmax; the rest are
divided by their temperature, filtered (min-p, top-k, top-p: ``kernels.layers.filter_rows``,
each a threshold on the logits, found on the CPU without sorting the row) and drawn by
inverse transform sampling (``kernels.layers.sample_rows``, one C++ pass over each row on
the CPU): one uniform ``u`` per row, and the first token whose
cumulative probability reaches ``(1 - u) * total``, which samples from ``p`` exactly (up to
fp32 rounding of the running sum) and never picks a token of probability 0. It needs one
random number per row where the exponential race ``argmax(p / q), q ~ Exp(1)`` needs one per
vocabulary entry (15 ms per step at 32 rows x 32000 tokens on a 2-core CPU, against under
1 ms). A seeded row draws its ``u`` from a generator keyed by (seed, output token index), so
the same request gives the same tokens on any worker, in any batch (docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pdserve.engine.request import Logprob, Request
from pdserve.engine.seeding import position_seed
from pdserve.engine.spec_decode import verify
from pdserve.engine.structured_output import apply_grammar_bitmask, bitmask_width
from pdserve.kernels.layers import argmax, filter_rows, sample_rows


class Sampler:
    """Chooses one token per row of a logits batch.

    Args:
        seed: seeds the generator used by unseeded requests.
    """

    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        # [rows, ceil(vocab / 32)] int32 on the CPU, grown to the largest constrained batch
        self._bitmask = torch.empty(0, 0, dtype=torch.int32)

    def sample(self, logits: torch.Tensor, requests: Sequence[Request]
               ) -> list[tuple[int, Logprob | None]]:
        """``logits: [N, vocab]`` fp32, row ``i`` for ``requests[i]`` -> N (token, logprob).

        ``logits`` may be modified in place.
        """
        params = [r.sampling_params for r in requests]
        raw_logprobs = None
        if any(p.logprobs is not None for p in params):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        self._allow_only(logits, requests)
        self._ban_bad_words(logits, requests)
        self._apply_logit_bias(logits, requests)
        self._apply_penalties(logits, requests)
        self._ban_stop_tokens(logits, requests)
        self._apply_grammars(logits, requests)
        if all(p.greedy for p in params):
            tokens = argmax(logits)
        else:
            tokens = self._draw(logits, requests)
        token_list = tokens.tolist()
        return [(t, token_logprob(raw_logprobs, i, t, p.logprobs))
                for i, (t, p) in enumerate(zip(token_list, params))]

    def verify(self, logits: torch.Tensor, request: Request
               ) -> list[tuple[int, Logprob | None]]:
        """A speculating request's tokens from its ``logits: [1 + k, vocab]`` fp32 (row
        ``i`` after its last token and ``i`` proposals; ``engine/spec_decode.verify``):
        the accepted proposals and the correction or bonus token, each with its logprob
        from its row's raw logits when asked; a structured output's rows masked by its
        grammar at each row's position. Only for requests ``spec_decode.speculates`` lets
        speculate (no penalties, bias or pending ``min_tokens``)."""
        params = request.sampling_params
        raw = torch.log_softmax(logits, dim=-1) if params.logprobs is not None else None
        if request.grammar is not None:  # NOTE: row i under the grammar after i proposals
            import xgrammar as xgr

            rows, width = logits.shape[0], bitmask_width(logits.shape[1])
            mask = torch.empty(rows, width, dtype=torch.int32)
            request.grammar.fill_bitmasks_along(request.spec_token_ids, mask)
            logits = logits.clone()
            xgr.apply_token_bitmask_inplace(
                logits, mask if logits.device.type == "cpu" else mask.to(logits.device),
                vocab_size=logits.shape[1])
        probs = None if params.greedy else self.target_probs(logits, params)
        tokens = verify(probs, logits, request.spec_token_ids, request, self.generator)
        return [(t, token_logprob(raw, i, t, params.logprobs)) for i, t in enumerate(tokens)]

    @staticmethod
    def target_probs(logits: torch.Tensor, params) -> torch.Tensor:
        """``[R, vocab]`` fp32: the distribution a sampled token is drawn from, per row of
        ``logits`` (temperature, then the min-p, top-k and top-p filters, as ``_draw``)."""
        scaled = logits / params.temperature
        rows = logits.shape[0]
        if params.min_p > 0 or _filters([params.top_k], [params.top_p], logits.shape[1]):
            device = logits.device
            scaled = filter_rows(scaled, torch.full((rows,), params.min_p, device=device),
                                 torch.full((rows,), params.top_k, dtype=torch.int64,
                                            device=device),
                                 torch.full((rows,), params.top_p, device=device))
        return torch.softmax(scaled, dim=-1)

    def _draw(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """``[N]`` int64: the argmax of greedy rows, a draw from the others."""
        params = [r.sampling_params for r in requests]
        temps = torch.tensor([0.0 if p.greedy else p.temperature for p in params],
                             dtype=torch.float32, device=logits.device)
        # NOTE: greedy rows are left unfiltered, so they keep their argmax, ties included
        sampled = [not p.greedy for p in params]
        min_p = [p.min_p if s else 0.0 for p, s in zip(params, sampled)]
        top_k = [p.top_k if s else 0 for p, s in zip(params, sampled)]
        top_p = [p.top_p if s else 1.0 for p, s in zip(params, sampled)]
        if any(m > 0 for m in min_p) or _filters(top_k, top_p, logits.shape[1]):
            # NOTE: filter the scaled logits, then draw from them as they are (temperature 1)
            logits = logits / torch.where(temps > 0, temps, 1.0)[:, None]
            device = logits.device
            logits = filter_rows(logits, torch.tensor(min_p, device=device),
                                 torch.tensor(top_k, device=device),
                                 torch.tensor(top_p, device=device))
            temps = (temps > 0).to(temps.dtype)
        return sample_rows(logits, temps, self._uniforms(requests).to(logits.device))

    def _uniforms(self, requests: Sequence[Request]) -> torch.Tensor:
        """``[N]`` fp64 in [0, 1): a seeded row's from its (seed, output index), the
        others' from the sampler's generator (greedy rows' unused)."""
        params = [r.sampling_params for r in requests]
        u = torch.zeros(len(params), dtype=torch.float64)
        unseeded = [i for i, p in enumerate(params) if p.seed is None and not p.greedy]
        if unseeded:
            u[unseeded] = torch.rand(len(unseeded), generator=self.generator,
                                     dtype=torch.float64)
        for i, p in enumerate(params):
            if p.seed is not None and not p.greedy:
                gen = torch.Generator().manual_seed(position_seed(p.seed,
                                                                  requests[i].num_output_tokens))
                u[i] = torch.rand(1, generator=gen, dtype=torch.float64)
        return u

    @staticmethod
    def _allow_only(logits: torch.Tensor, requests: Sequence[Request]) -> None:
        """Set every token outside a request's ``allowed_token_ids`` to -inf in its row
        (ids past the vocabulary, which the router refuses, are skipped here)."""
        vocab = logits.shape[1]
        for i, req in enumerate(requests):
            allowed = req.sampling_params.allowed_token_ids
            if allowed:
                ids = torch.tensor([t for t in allowed if t < vocab], dtype=torch.int64,
                                   device=logits.device)
                kept = logits[i, ids]
                logits[i].fill_(float("-inf"))
                logits[i, ids] = kept

    @staticmethod
    def _ban_bad_words(logits: torch.Tensor, requests: Sequence[Request]) -> None:
        """Set to -inf the last token of each ``bad_words_token_ids`` sequence whose other
        tokens end the request's output so far (vLLM's rule: the output, not the prompt)."""
        vocab = logits.shape[1]
        for i, req in enumerate(requests):
            sequences = req.sampling_params.bad_words_token_ids
            if not sequences:
                continue
            output = req.output_token_ids
            banned = [s[-1] for s in sequences if s[-1] < vocab and (
                len(s) == 1 or (len(output) >= len(s) - 1
                                and output[len(output) - len(s) + 1:] == s[:-1]))]
            if banned:
                logits[i, banned] = float("-inf")

    @staticmethod
    def _apply_logit_bias(logits: torch.Tensor, requests: Sequence[Request]) -> None:
        """Add each request's ``logit_bias`` to its row (ids past the vocabulary, which the
        router refuses, are skipped here)."""
        vocab = logits.shape[1]
        for i, req in enumerate(requests):
            bias = req.sampling_params.logit_bias
            if bias:
                ids = [t for t in bias if t < vocab]
                logits[i, ids] += torch.tensor([bias[t] for t in ids], dtype=logits.dtype,
                                               device=logits.device)

    def _apply_grammars(self, logits: torch.Tensor, requests: Sequence[Request]) -> None:
        """Mask the tokens each constrained row's grammar forbids (-inf); other rows are
        left as they are."""
        rows = [i for i, r in enumerate(requests) if r.grammar is not None]
        if not rows:
            return
        num_rows, width = logits.shape[0], bitmask_width(logits.shape[1])
        if self._bitmask.shape[0] < num_rows or self._bitmask.shape[1] != width:
            self._bitmask = torch.empty(max(num_rows, self._bitmask.shape[0]), width,
                                        dtype=torch.int32)
        apply_grammar_bitmask(logits, [requests[i].grammar for i in rows], rows, self._bitmask)

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, requests: Sequence[Request]) -> None:
        rows = [i for i, r in enumerate(requests) if _has_penalty(r)]
        if not rows:
            return
        vocab = logits.shape[1]
        sub = logits[rows]  # [R, V]
        counts = _token_counts([requests[i].output_token_ids for i in rows], vocab, logits.device)
        seen = counts > 0
        prompt_seen = _token_counts([requests[i].prompt_token_ids for i in rows], vocab,
                                    logits.device) > 0
        rep = torch.tensor([requests[i].sampling_params.repetition_penalty for i in rows],
                           device=logits.device)[:, None]
        penalised = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(seen | prompt_seen, penalised, sub)
        freq = torch.tensor([requests[i].sampling_params.frequency_penalty for i in rows],
                            device=logits.device)[:, None]
        pres = torch.tensor([requests[i].sampling_params.presence_penalty for i in rows],
                            device=logits.device)[:, None]
        sub = sub - freq * counts - pres * seen
        logits[rows] = sub

    @staticmethod
    def _ban_stop_tokens(logits: torch.Tensor, requests: Sequence[Request]) -> None:
        """Below ``min_tokens``, EOS and ``stop_token_ids`` cannot be chosen."""
        for i, req in enumerate(requests):
            params = req.sampling_params
            if req.num_output_tokens < params.min_tokens:
                banned = set(params.stop_token_ids)
                if not params.ignore_eos:
                    banned |= req.eos_token_ids
                banned = [t for t in banned if t < logits.shape[1]]
                if banned:
                    logits[i, banned] = float("-inf")


def _has_penalty(req: Request) -> bool:
    p = req.sampling_params
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def _token_counts(token_lists: list[list[int]], vocab: int, device) -> torch.Tensor:
    """``[len(token_lists), vocab]`` fp32 occurrence counts."""
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    width = max((len(t) for t in token_lists), default=0)
    if width:
        padded = torch.full((len(token_lists), width), vocab, dtype=torch.long)
        for i, tokens in enumerate(token_lists):
            padded[i, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        counts.scatter_add_(1, padded.to(device), torch.ones_like(padded, dtype=counts.dtype,
                                                                  device=device))
    return counts[:, :vocab]


def _filters(top_k: list[int], top_p: list[float], vocab: int) -> bool:
    """Whether any row's top-k or top-p removes a token."""
    return not (all(k == 0 or k >= vocab for k in top_k) and all(p >= 1.0 for p in top_p))


def token_logprob(raw: torch.Tensor | None, row: int, token: int, num_top: int | None
                  ) -> Logprob | None:
    """Token ``token``'s log-probability in row ``row`` of ``raw [N, vocab]`` (log-softmax),
    its rank and the top ``num_top``; None when ``raw`` or ``num_top`` is None."""
    if raw is None or num_top is None:
        return None
    top: dict[int, float] = {}
    if num_top > 0:
        values, ids = raw[row].topk(num_top)
        top = dict(zip(ids.tolist(), values.tolist()))
    value = raw[row, token]
    rank = int((raw[row] > value).sum()) + 1
    return Logprob(token, float(value), rank, top)


def tokens_logprobs(raw: torch.Tensor, tokens: torch.Tensor, num_top: int) -> list[Logprob]:
    """``token_logprob`` of every row at once: row i's ``tokens[i]`` in ``raw [N, vocab]``
    (log-softmax, fp32), with its rank (1 + the count of tokens strictly more likely) and
    the top ``num_top`` (>= 0) alternatives; ``tokens [N]`` int64 on ``raw``'s device."""
    values = raw.gather(1, tokens[:, None])  # [N, 1]
    ranks = ((raw > values).sum(dim=1) + 1).tolist()
    tops: list[dict[int, float]] = [{} for _ in ranks]
    if num_top > 0:
        top_values, top_ids = raw.topk(num_top, dim=1)
        tops = [dict(zip(i, v)) for i, v in zip(top_ids.tolist(), top_values.tolist())]
    return [Logprob(t, v, r, top) for t, v, r, top in
            zip(tokens.tolist(), values[:, 0].tolist(), ranks, tops)]
