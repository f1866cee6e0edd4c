"""Speculative decoding with a draft model (``{"method": "draft_model", "model": ...}``):
a smaller model of the same tokenizer proposes ``k`` tokens greedily, one forward pass
each, and the target verifies them in its step (``engine/spec_decode.py``).

The draft has its own paged KV cache, indexed by the target's block ids: a request's
block table (``KVCacheManager``) serves both models, so the draft needs no allocation of
its own (its cache has as many blocks as the target's, of its own geometry). For each
speculating request the proposer keeps how many of its tokens the draft has computed
(``draft_computed``); before proposing it computes the rest in one chunk (a prompt whose
KV was pulled from a prefill worker or hit in the prefix cache, tokens after a preemption,
the bonus token of the last step), whose last row gives the first proposal, then runs
``k - 1`` one-token passes for the others. The draft's KV of proposals the target
rejects is not counted (``draft_computed`` falls back to the request's
``num_computed_tokens``) and is overwritten later. A greedy draft proposes
deterministically, so the rejection sampler's draft probability is 1, as for ngram.

Scheduling: the scheduler reserves ``k`` proposal slots for a speculating request
(``PENDING`` tokens) and allocates its blocks; the proposer fills them after
``schedule()`` and before the target's forward pass, writing the draft's KV into those
slots.
"""

from __future__ import annotations

import numpy as np
import torch

from pdserve.engine.config import ModelConfig, UnsupportedModelError
from pdserve.engine.kv_cache_layout import KVCacheLayout
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.model_source import open_model
from pdserve.engine.models.blocks import AttentionMetadata
from pdserve.engine.models.loader import load_model
from pdserve.engine.request import Request
from pdserve.engine.scheduler import SchedulerOutput

PENDING = -1
"""A proposal slot the draft model has yet to fill (never a token id)."""


class DraftProposer:
    """The draft model and its KV cache on ``device``.

    Args:
        path: the draft checkpoint (a folder or a ``.gguf`` file, as ``--model``).
        target: the target's ``ModelConfig`` (its vocabulary, dtype, ``max_model_len``).
        block_size, num_blocks: the target's KV cache's (the draft shares its block ids).
        device: the target's device (rank 0's under tensor parallelism).

    Raises:
        UnsupportedModelError: a draft whose vocabulary differs from the target's, or
            which cannot hold the target's ``max_model_len``.
    """

    def __init__(self, path: str, target: ModelConfig, block_size: int, num_blocks: int,
                 device: torch.device) -> None:
        source = open_model(path)
        raw = source.config_dict()
        if int(raw.get("vocab_size", -1)) != target.vocab_size:
            raise UnsupportedModelError(
                f"speculative_config.model={path!r}: its vocab_size={raw.get('vocab_size')} "
                f"is not the target's {target.vocab_size} (a draft model shares the "
                "target's tokenizer)")
        self.config = ModelConfig.from_dict(raw, model=str(source.path), dtype=target.dtype,
                                            max_model_len=target.max_model_len)
        self.device = device
        self.block_size = block_size
        self.model = load_model(self.config, device, progress=False, source=source)
        self.kv_cache, _ = KVCacheLayout.of(self.config, block_size).allocate(num_blocks,
                                                                              device)
        self.draft_computed: dict[str, int] = {}

    @torch.inference_mode()
    def propose(self, out: SchedulerOutput, kv: KVCacheManager) -> None:
        """Fill the ``PENDING`` proposals of this step's speculating requests (as many as
        the scheduler reserved for each)."""
        requests = [r for r in out.requests
                    if r.spec_token_ids and r.spec_token_ids[0] == PENDING]
        if not requests:
            return
        wanted = {r.request_id: len(r.spec_token_ids) for r in requests}
        # catch up: every token the draft has not computed, the last one included
        chunks = []
        for request in requests:
            start = min(self.draft_computed.get(request.request_id, 0),
                        request.num_tokens - 1)
            chunks.append((request, start, request.all_token_ids[start:]))
        for request, token in zip(requests, self._forward(chunks, kv)):
            request.spec_token_ids = [token]
        # then one-token passes: proposal i goes in at position num_tokens - 1 + i
        for step in range(1, max(wanted.values())):
            active = [r for r in requests if wanted[r.request_id] > step]
            chunks = [(r, r.num_tokens + step - 1, [r.spec_token_ids[-1]]) for r in active]
            for request, token in zip(active, self._forward(chunks, kv)):
                request.spec_token_ids.append(token)
        for request in requests:  # NOTE: the last proposal's KV is not computed
            self.draft_computed[request.request_id] = (request.num_tokens
                                                       + len(request.spec_token_ids) - 1)

    def after_step(self, out: SchedulerOutput) -> None:
        """The draft's KV stands only as far as the request's verified tokens."""
        for request in out.requests:
            done = self.draft_computed.get(request.request_id)
            if done is not None:
                self.draft_computed[request.request_id] = min(done,
                                                              request.num_computed_tokens)

    def finish(self, request: Request) -> None:
        self.draft_computed.pop(request.request_id, None)

    def _forward(self, chunks: list[tuple[Request, int, list[int]]],
                 kv: KVCacheManager) -> list[int]:
        """One draft forward pass over ``chunks`` ((request, first position, tokens)): on
        the decode path when every chunk is one token, else on the prefill path; the
        argmax after each chunk's last token."""
        lens = np.array([len(t) for _, _, t in chunks], dtype=np.int64)
        starts = np.array([s for _, s, _ in chunks], dtype=np.int64)
        cu = np.zeros(len(chunks) + 1, dtype=np.int64)
        np.cumsum(lens, out=cu[1:])
        seq = np.repeat(np.arange(len(chunks)), lens)
        positions = starts[seq] + np.arange(int(cu[-1])) - cu[:-1][seq]
        blocks = [kv.block_ids(r.request_id) for r, _, _ in chunks]
        table = np.zeros((len(chunks), max(map(len, blocks))), dtype=np.int32)
        for row, ids in zip(table, blocks):
            row[:len(ids)] = ids
        slots = (table[seq, positions // self.block_size].astype(np.int64) * self.block_size
                 + positions % self.block_size)
        device = self.device

        def tensor(array):
            return torch.from_numpy(np.ascontiguousarray(array)).to(device)

        empty = np.zeros((0, 1), dtype=np.int32)
        seq_lens = (starts + lens).astype(np.int32)
        if (lens == 1).all():  # NOTE: the one-token passes take the decode kernel
            meta = AttentionMetadata(
                slot_mapping=tensor(slots), num_decode_tokens=len(chunks),
                decode_block_tables=tensor(table), decode_seq_lens=tensor(seq_lens),
                prefill_block_tables=tensor(empty), prefill_cu_seqlens_q=tensor(
                    np.zeros(1, dtype=np.int32)), prefill_seq_lens=tensor(empty[:, 0]))
        else:
            meta = AttentionMetadata(
                slot_mapping=tensor(slots), num_decode_tokens=0,
                decode_block_tables=tensor(empty), decode_seq_lens=tensor(empty[:, 0]),
                prefill_block_tables=tensor(table),
                prefill_cu_seqlens_q=tensor(cu.astype(np.int32)),
                prefill_seq_lens=tensor(seq_lens))
        ids = tensor(np.concatenate([np.asarray(t, dtype=np.int64) for _, _, t in chunks]))
        hidden = self.model(ids, tensor(positions), self.kv_cache, meta)
        logits = self.model.compute_logits(hidden[tensor(cu[1:] - 1)])
        return logits.argmax(dim=-1).tolist()
