"""Turns a ``SchedulerOutput`` into one forward pass and samples the next tokens.

Per-step metadata is built with numpy over the batch, never a Python loop per token.
Worked example (``block_size=4``): request A decodes its 7th token (``num_computed=6``,
1 new) with blocks ``[2, 9]``; request B prefills a chunk of 3 tokens from position 4 with
blocks ``[5, 1]``. Then ``positions = [6, 4, 5, 6]``, ``slot_mapping = [9*4+2, 1*4+0,
1*4+1, 1*4+2] = [38, 4, 5, 6]``, the decode part is A (``seq_lens=[7]``) and the prefill
part is B (``cu_seqlens_q=[0, 3]``, ``seq_lens=[7]``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from multiprocessing.connection import Connection

import numpy as np
import torch

from pdserve.engine.config import ModelConfig
from pdserve.engine.kv_cache_layout import KVCacheLayout
from pdserve.engine.kv_cache_manager import KVCacheManager
from pdserve.engine.model_source import ModelSource
from pdserve.engine.models.blocks import AttentionMetadata
from pdserve.engine.models.loader import load_model
from pdserve.engine.parallel import TensorParallel, check_tensor_parallel
from pdserve.engine.request import Logprob, Request
from pdserve.engine.sampler import Sampler, tokens_logprobs
from pdserve.engine.scheduler import SchedulerOutput
from pdserve.engine.tp_executor import (
    RankSpec,
    TensorParallelExecutor,
    join_group,
    serve_rank,
    threads_per_rank,
)
from pdserve.kernels import cpu_ext
from pdserve.kernels.kv_shards import KVShard, KVShards
from pdserve.kernels.layers import filter_rows


def kv_cache_block_bytes(config: ModelConfig, block_size: int, kv_cache_dtype: str = "auto"
                         ) -> int:
    """Bytes one block takes across all layers (K and V, and a quantized cache's scales:
    ``KVCacheLayout.block_bytes``)."""
    return KVCacheLayout.of(config, block_size, kv_cache_dtype).block_bytes


@dataclass(slots=True)
class StepArrays:
    """One step's flat inputs on the host, as rank 0 sends them to the other
    tensor-parallel ranks (numpy: small and cheap to pickle); fields as
    ``AttentionMetadata``'s, with ``input_ids``, ``positions`` ``[T]`` int64 and
    ``logits_rows`` ``[R]`` int64: the rows whose logits the step needs (the prompt
    chunks' whose prompt logprobs are asked for, the first ``num_prompt_logits_rows``,
    then each sampling request's last)."""

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    num_decode_tokens: int
    decode_block_tables: np.ndarray
    decode_seq_lens: np.ndarray
    prefill_block_tables: np.ndarray
    prefill_cu_seqlens_q: np.ndarray
    prefill_seq_lens: np.ndarray
    rope_long: np.ndarray | None
    logits_rows: np.ndarray
    num_prompt_logits_rows: int = 0


@dataclass(slots=True)
class StepInputs:
    """One forward pass's inputs on the model's device (``StepArrays`` as tensors)."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    logits_rows: torch.Tensor  # [R] int64


# (request, begin, end): prompt positions [begin, end) whose next token's logprob is asked
PromptChunk = tuple[Request, int, int]
# Prompt logprobs' logits are computed this many rows at a time (fp32 [rows, vocab], and
# their log-softmax): a 2048-token chunk of a 128k vocabulary at once took ~2 GB more
# peak memory (2060 MiB measured; 558 MiB in slices) than a step's sampling rows, beyond
# what profile_activation_bytes measures.
PROMPT_LOGITS_ROWS = 256


class ModelRunner:
    """Holds the model weights and the worker's KV cache on ``device``.

    ``kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` in the
    model dtype (``kv_cache_dtype`` ``auto``) or a quantized one (int8, fp8), zero-
    initialised (padding reads stay finite): the layer-major view of block-major storage
    (``engine/kv_cache_layout.py``), so that one block's K and V of all layers, and a
    quantized cache's scales, are one contiguous run of ``kv_cache_block_bytes``.
    ``kv_cache[l, 0]`` / ``kv_cache[l, 1]`` are ``[num_blocks, block_size, num_kv_heads,
    head_dim]`` with a block stride of one block and packed blocks, as the kernels take
    them. ``kv_scales: [num_layers, 2, num_blocks, num_kv_heads]`` fp32 for a quantized
    cache (None otherwise), ``kv_scales[l, 0]`` / ``[l, 1]`` the layer's K and V scales.
    """

    def __init__(self, config: ModelConfig, block_size: int, device: torch.device,
                 seed: int = 0, progress: bool = True, source: ModelSource | None = None,
                 kv_cache_dtype: str = "auto", tensor_parallel_size: int = 1,
                 tp: TensorParallel | None = None, num_threads: int | None = None) -> None:
        self.config = config
        self.device = device
        self.block_size = block_size
        # rank 0 of a tensor-parallel worker starts the other ranks (each builds a
        # ModelRunner with its ``tp``) and sends them every command that runs the model
        self.executor: TensorParallelExecutor | None = None
        if tp is None and tensor_parallel_size > 1:
            check_tensor_parallel(config, tensor_parallel_size)
            if device.type == "cpu":
                cpu_ext.load()  # NOTE: built once here, before the ranks load it
            self.executor = TensorParallelExecutor(RankSpec(
                config, block_size, str(device), kv_cache_dtype, seed, tensor_parallel_size,
                0, num_threads), device, rank_main)
            tp = self.executor.tp
        self.tp = tp or TensorParallel()
        self.kv_layout = KVCacheLayout.of(self.tp.local_config(config), block_size,
                                          kv_cache_dtype)
        try:
            self.model = load_model(config, device, progress, source, self.tp)
            if device.type == "cpu":
                cpu_ext.load()  # NOTE: builds the C++ CPU kernels now, not in the first request
            if self.executor is not None:
                self.executor.wait_ready()
        except BaseException:
            self.shutdown()
            raise
        self.kv_cache = torch.empty(0)
        self.kv_scales: torch.Tensor | None = None
        self.rank_kv_caches: list[torch.Tensor] = []  # rank 0: the other ranks' (CPU)
        self.sampler = Sampler(seed)
        # LongRoPE (Phi-3): sequences past this length take the long factors
        self._longrope_original = (int(config.rope_parameters["original_max_position_embeddings"])
                                   if config.rope_type == "longrope" else None)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache for ``num_blocks`` blocks (bytes: ``num_blocks *
        kv_cache_block_bytes``), zeroed; on the CPU on huge pages.

        The storage is block-major (``engine/kv_cache_layout.py``), and ``self.kv_cache``
        (and ``self.kv_scales``) its layer-major views ``[num_layers, 2, num_blocks,
        ...]``: KV transfer moves a run of consecutive blocks of all layers as one
        contiguous region (no gather, no per-layer copies), while the model still indexes
        ``kv_cache[layer]``. Each tensor-parallel rank allocates as many blocks of its
        own KV heads.
        """
        if self.executor is not None:
            self.executor.send("allocate_kv_cache", num_blocks)
        self.kv_cache, self.kv_scales = self.kv_layout.allocate(num_blocks, self.device)
        if self.executor is not None and self.device.type == "cpu":
            fds = self.executor.receive_handles()
            try:
                self.rank_kv_caches = [self.kv_layout.map_shared(fd, num_blocks)[0]
                                       for fd in fds]
            finally:
                for fd in fds:
                    os.close(fd)

    def _allocate_shared_kv_cache(self, num_blocks: int) -> int | None:
        """A rank other than 0: its KV cache, in shared memory on the CPU; returns the
        memory's file descriptor for rank 0 (None on CUDA)."""
        if self.device.type != "cpu":
            self.allocate_kv_cache(num_blocks)
            return None
        self.kv_cache, self.kv_scales, fd = self.kv_layout.allocate_shared(num_blocks)
        return fd

    def transfer_cache(self) -> torch.Tensor | KVShards:
        """What KV transfer moves blocks of: this worker's ``kv_cache``, or under tensor
        parallelism (rank 0, CPU) every rank's share of the heads (``KVShards``; the other
        ranks' caches are shared memory that rank 0 maps).

        Raises:
            ValueError: tensor parallelism on CUDA or with a quantized KV cache (not
                transferred yet).
        """
        if self.tp.size == 1:
            return self.kv_cache
        if self.device.type != "cpu" or self.kv_scales is not None:
            raise ValueError("KV transfer between tensor-parallel workers runs on the CPU "
                             "with a float KV cache only, so far")
        caches = [self.kv_cache, *self.rank_kv_caches]
        heads = self.config.num_kv_heads
        return KVShards([
            KVShard(cache, TensorParallel(rank, self.tp.size).kv_head_shard(heads)[0])
            for rank, cache in enumerate(caches)])

    @torch.inference_mode()
    def profile_activation_bytes(self, num_tokens: int, num_seqs: int, max_model_len: int
                                 ) -> int:
        """Peak CUDA memory, in bytes, that a step of ``num_tokens`` prefill tokens takes
        beyond the weights and the KV cache (vLLM's ``profile_run``): one forward pass over
        ``num_tokens`` dummy tokens in sequences of at most ``max_model_len``, the logits
        of ``min(num_seqs, num_tokens)`` rows and their top-k / top-p filter (the
        sampler's sorts), into a temporary KV cache that is freed again. Counted as the
        caching allocator's reserved peak, not its allocated one: the step's frees and
        larger allocations leave segments it cannot reuse (on an H100, an 8192-token step
        of 0.8 GB of activations reserved ~0.3 GB more than it allocated). Also compiles
        the prefill path's kernels before the first request.

        Raises:
            RuntimeError: not a CUDA model runner, or the pass ran out of memory (the
                weights leave too little for one step: lower max_num_batched_tokens).
        """
        if self.device.type != "cuda":
            raise RuntimeError("profile_activation_bytes: CUDA only")
        if self.executor is not None:  # NOTE: the pass's collectives need every rank
            self.executor.send("profile_activation_bytes", num_tokens, num_seqs, max_model_len)
        block_size = self.block_size
        seq_len = max(1, min(num_tokens, max_model_len))
        lens = [seq_len] * (num_tokens // seq_len) + [num_tokens % seq_len] * bool(
            num_tokens % seq_len)
        blocks = [-(-n // block_size) for n in lens]  # [S] blocks per sequence
        first = np.cumsum([0, *blocks[:-1]])  # each sequence's first block
        positions = np.concatenate([np.arange(n) for n in lens])  # [T]
        seq_of = np.repeat(np.arange(len(lens)), lens)  # [T]
        slot_mapping = (first[seq_of] * block_size + positions).astype(np.int64)
        block_table = np.zeros((len(lens), max(blocks)), dtype=np.int32)
        for row, (start, n) in enumerate(zip(first.tolist(), blocks)):
            block_table[row, :n] = np.arange(start, start + n)
        cu = np.zeros(len(lens) + 1, dtype=np.int32)
        np.cumsum(lens, out=cu[1:])
        empty = np.zeros((0, 1), dtype=np.int32)
        meta = AttentionMetadata(
            slot_mapping=self._to_device(slot_mapping), num_decode_tokens=0,
            decode_block_tables=self._to_device(empty), decode_seq_lens=self._to_device(empty[:, 0]),
            prefill_block_tables=self._to_device(block_table),
            prefill_cu_seqlens_q=self._to_device(cu),
            prefill_seq_lens=self._to_device(np.asarray(lens, dtype=np.int32)))
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        baseline = torch.cuda.memory_reserved(self.device)
        kv_cache, kv_scales = self.kv_layout.allocate(sum(blocks), self.device)
        cache_bytes = torch.cuda.memory_reserved(self.device) - baseline
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        hidden = self.model(input_ids, self._to_device(positions), kv_cache, meta, kv_scales)
        rows = min(num_seqs, num_tokens)
        logits = self.model.compute_logits(hidden[:rows])  # [rows, vocab] fp32
        device = logits.device
        filter_rows(logits, torch.zeros(rows, device=device),
                    torch.full((rows,), 50, dtype=torch.int64, device=device),
                    torch.full((rows,), 0.9, device=device))
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_reserved(self.device) - baseline - cache_bytes
        del kv_cache, kv_scales, hidden, logits
        torch.cuda.empty_cache()
        return max(int(peak), 0)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, kv: KVCacheManager
                ) -> dict[str, list[tuple[int, Logprob | None]]]:
        """Run the step; returns request id -> [(token, logprob)] for every request whose
        prompt (or recompute) is complete after this step: one token, or for a request
        that speculated its accepted proposals and the correction or bonus token
        (``engine/spec_decode.py``)."""
        arrays, sampling_requests, prompt_chunks = self.prepare_inputs(out, kv)
        if self.executor is not None:
            self.executor.send("step", arrays)
        for request, _, _ in prompt_chunks:
            if not request.prompt_logprobs:
                request.prompt_logprobs.append(None)  # the first prompt token
        # [sampled rows, vocab] fp32: one per request, 1 + k per speculating one
        rows = self._forward(arrays, lambda first, logits: self._prompt_logprobs(
            first, logits, prompt_chunks))
        if not sampling_requests:
            return {}
        plain = [r for r in sampling_requests if not r.spec_token_ids]
        result: dict[str, list[tuple[int, Logprob | None]]] = {}
        if len(plain) == len(sampling_requests):
            sampled = self.sampler.sample(rows, plain)
            return {r.request_id: [s] for r, s in zip(plain, sampled)}
        first, plain_rows = 0, []
        for request in sampling_requests:
            count = 1 + len(request.spec_token_ids)
            if request.spec_token_ids:
                result[request.request_id] = self.sampler.verify(
                    rows[first:first + count], request)
            else:
                plain_rows.append(first)
            first += count
        if plain:
            sampled = self.sampler.sample(rows[plain_rows], plain)
            result.update((r.request_id, [s]) for r, s in zip(plain, sampled))
        return result

    def _forward(self, arrays: StepArrays, on_prompt_logits=None) -> torch.Tensor | None:
        """One forward pass over the step's tokens; returns the logits of the sampling
        rows of ``arrays.logits_rows`` (fp32 ``[rows, vocab]`` on rank 0; None on the other
        ranks, or without such rows). The prompt-logprob rows' logits go to
        ``on_prompt_logits(first row, logits [<= PROMPT_LOGITS_ROWS, vocab])`` (rank 0), a
        slice at a time, so that a long prompt's take no more memory than a batch's."""
        inputs = self.step_inputs(arrays)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.meta,
                            self.kv_scales)
        rows, split = inputs.logits_rows, arrays.num_prompt_logits_rows
        for first in range(0, split, PROMPT_LOGITS_ROWS):  # every rank: a collective gather
            logits = self.model.compute_logits(
                hidden[rows[first:min(first + PROMPT_LOGITS_ROWS, split)]])
            if logits is not None and on_prompt_logits is not None:
                on_prompt_logits(first, logits)
        if len(rows) == split:
            return None
        return self.model.compute_logits(hidden[rows[split:]])

    @torch.inference_mode()
    def run_command(self, command: str, *args) -> int | None:
        """Run one of rank 0's commands on another tensor-parallel rank
        (``tp_executor``): ``step``, ``allocate_kv_cache`` (returns the shared memory's
        file descriptor on the CPU) or ``profile_activation_bytes``.

        Raises:
            ValueError: an unknown command.
        """
        if command == "step":
            self._forward(*args)
        elif command == "allocate_kv_cache":
            return self._allocate_shared_kv_cache(*args)
        elif command == "profile_activation_bytes":
            self.profile_activation_bytes(*args)
        else:
            raise ValueError(f"unknown tensor-parallel command {command!r}")

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks, if any."""
        if self.executor is not None:
            self.executor.shutdown()
            self.executor = None

    @staticmethod
    def _prompt_logprobs(first: int, logits: torch.Tensor, chunks: list[PromptChunk]
                         ) -> None:
        """Prompt-logprob rows ``[first, first + len(logits))`` of the step (the chunks'
        rows, in order; slices arrive in order): append, per position p among them, the
        log-probability of the prompt token after p (and the top ones) to its request's
        ``prompt_logprobs``."""
        row, last = 0, first + len(logits)
        for request, begin, end in chunks:
            lo, hi = max(row, first), min(row + end - begin, last)
            if lo < hi:
                raw = torch.log_softmax(logits[lo - first:hi - first], dim=-1)  # [hi-lo, V]
                at = begin + lo - row + 1  # the prompt token after row lo's position
                targets = torch.tensor(request.all_token_ids[at:at + hi - lo],
                                       dtype=torch.int64, device=raw.device)
                request.prompt_logprobs.extend(tokens_logprobs(
                    raw, targets, request.sampling_params.prompt_logprobs))
            row += max(end - begin, 0)

    def prepare_inputs(self, out: SchedulerOutput, kv: KVCacheManager
                       ) -> tuple[StepArrays, list[Request], list[PromptChunk]]:
        """The step's flat inputs as numpy arrays (what rank 0 sends the other
        tensor-parallel ranks), the requests that sample a token after it (batch order:
        their rows come last in ``logits_rows``), and the prompt chunks whose logprobs are
        asked for (their rows first, in order)."""
        pairs = sorted(zip(out.requests, out.num_scheduled_tokens), key=lambda p: p[1] > 1)
        requests = [r for r, _ in pairs]
        num_new = np.array([n for _, n in pairs], dtype=np.int64)  # [N]
        starts = np.array([r.num_computed_tokens for r in requests], dtype=np.int64)
        cu = np.zeros(len(requests) + 1, dtype=np.int64)
        np.cumsum(num_new, out=cu[1:])
        num_tokens = int(cu[-1])
        req_index = np.repeat(np.arange(len(requests)), num_new)  # [T]
        positions = starts[req_index] + np.arange(num_tokens) - cu[:-1][req_index]
        # NOTE: a speculating request's chunk is its last token and its proposals
        input_ids = np.concatenate([
            np.asarray((r.all_token_ids[s:s + n] + r.spec_token_ids)[:n], dtype=np.int64)
            for r, s, n in zip(requests, starts.tolist(), num_new.tolist())])
        block_lists = [kv.block_ids(r.request_id) for r in requests]
        block_table = np.zeros((len(requests), max(map(len, block_lists))), dtype=np.int32)
        for row, blocks in zip(block_table, block_lists):
            row[:len(blocks)] = blocks
        slot_mapping = (block_table[req_index, positions // self.block_size].astype(np.int64)
                        * self.block_size + positions % self.block_size)
        seq_lens = (starts + num_new).astype(np.int32)
        num_decodes = int((num_new == 1).sum())
        num_spec = np.array([len(r.spec_token_ids) for r in requests], dtype=np.int64)
        samples = np.array([s == r.num_tokens + len(r.spec_token_ids)
                            for r, s in zip(requests, seq_lens.tolist())])
        chunks, chunk_rows = self._prompt_chunks(requests, cu, num_new, starts)
        arrays = StepArrays(
            input_ids=input_ids, positions=positions, slot_mapping=slot_mapping,
            num_decode_tokens=num_decodes,
            decode_block_tables=block_table[:num_decodes],
            decode_seq_lens=seq_lens[:num_decodes],
            prefill_block_tables=block_table[num_decodes:],
            prefill_cu_seqlens_q=(cu[num_decodes:] - cu[num_decodes]).astype(np.int32),
            prefill_seq_lens=seq_lens[num_decodes:],
            rope_long=self._rope_long(requests, positions, req_index),
            num_prompt_logits_rows=sum(len(r) for r in chunk_rows),
            logits_rows=np.concatenate([
                np.zeros(0, dtype=np.int64), *chunk_rows, *(np.arange(end - 1 - k, end) for end, k in
                               zip(cu[1:][samples].tolist(), num_spec[samples].tolist()))
            ]).astype(np.int64))
        return arrays, [r for r, s in zip(requests, samples) if s], chunks

    @staticmethod
    def _prompt_chunks(requests: list[Request], cu: np.ndarray, num_new: np.ndarray,
                       starts: np.ndarray) -> tuple[list[PromptChunk], list[np.ndarray]]:
        """The prompt chunks whose logprobs are asked for: ``(request, begin, end)``, where
        positions p in ``[begin, end)`` predict prompt tokens p + 1 (those recorded before,
        by a request recomputed after preemption, skipped; ``end <= begin``: none this
        step), and each chunk's rows in the batch."""
        chunks, rows = [], []
        for request, first, count, start in zip(requests, cu[:-1].tolist(), num_new.tolist(),
                                                 starts.tolist()):
            if request.sampling_params.prompt_logprobs is None or \
                    start >= request.num_prompt_tokens:
                continue
            recorded = max(len(request.prompt_logprobs), 1)  # the first token's None too
            begin = max(start, recorded - 1)
            end = max(begin, min(start + count, request.num_prompt_tokens - 1))
            chunks.append((request, begin, end))
            rows.append(np.arange(first + begin - start, first + end - start))
        return chunks, rows

    def step_inputs(self, arrays: StepArrays) -> StepInputs:
        """``arrays`` as tensors on this runner's device."""
        meta = AttentionMetadata(
            slot_mapping=self._to_device(arrays.slot_mapping),
            num_decode_tokens=arrays.num_decode_tokens,
            decode_block_tables=self._to_device(arrays.decode_block_tables),
            decode_seq_lens=self._to_device(arrays.decode_seq_lens),
            prefill_block_tables=self._to_device(arrays.prefill_block_tables),
            prefill_cu_seqlens_q=self._to_device(arrays.prefill_cu_seqlens_q),
            prefill_seq_lens=self._to_device(arrays.prefill_seq_lens),
            rope_long=(None if arrays.rope_long is None
                       else self._to_device(arrays.rope_long)),
        )
        return StepInputs(input_ids=self._to_device(arrays.input_ids),
                          positions=self._to_device(arrays.positions), meta=meta,
                          logits_rows=self._to_device(arrays.logits_rows))

    def _rope_long(self, requests: list[Request], positions: np.ndarray,
                   req_index: np.ndarray) -> np.ndarray | None:
        """LongRoPE only: ``[T]`` bool, each token's sequence is past the original context:
        its prompt, or for an output token the sequence it ends (``position + 1``), as
        transformers decides per forward pass over a whole sequence: the prompt in one
        pass, then each output token in its own decode step. So a prompt in chunks, a
        speculating request's verification chunk and a recompute after preemption each
        give every token the factors one-token decoding gave it."""
        if self._longrope_original is None:
            return None
        prompt_lens = np.array([r.num_prompt_tokens for r in requests], dtype=np.int64)
        return np.maximum(prompt_lens[req_index], positions + 1) > self._longrope_original

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        # NOTE: a few KB per step; pinning a fresh buffer each step would cost more than
        # the synchronous copy it saves.
        return tensor if self.device.type == "cpu" else tensor.to(self.device)


def rank_main(spec: RankSpec, rank: int, pipe: Connection) -> None:
    """A tensor-parallel rank process (``tp_executor``; ranks 1..N-1): build this rank's
    model shard and KV cache, then run rank 0's commands until it says stop or goes
    away. A failure to start is sent to rank 0 as ``("error", message)``."""
    torch.set_num_threads(spec.num_threads or threads_per_rank(spec.size))
    try:
        device, tp = join_group(spec, rank, pipe)
        runner = ModelRunner(spec.model_config, spec.block_size, device, spec.seed,
                             progress=False, kv_cache_dtype=spec.kv_cache_dtype, tp=tp)
    except Exception as exc:  # noqa: BLE001 - reported to rank 0
        pipe.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    serve_rank(runner, rank, pipe)
