"""One process's engine: scheduler + KV cache manager + model runner, stepped in a loop.

``step()`` is the whole engine (nano-vllm's shape)::

    out = scheduler.schedule()
    sampled = model_runner.execute(out, kv_cache_manager)
    scheduler.update_from_output(out, sampled)
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence

import torch

from pdserve.engine.block_hash import block_bindings, root_block_hash
from pdserve.engine.block_pool import KVEvent
from pdserve.engine.config import ModelConfig, cpu_compute_dtype
from pdserve.engine.cpu_threads import bind_intra_op_threads
from pdserve.engine.draft_proposer import PENDING
from pdserve.engine.engine_config import EngineConfig
from pdserve.engine.engine_outputs import (
    BlockOwnership,
    EngineOutput,
    KVTransferAllocation,
    TokenHistogram,
)
from pdserve.engine.kv_cache_manager import KVCacheManager, cdiv
from pdserve.engine.model_resolution import resolve_model_paths
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.model_source import open_model
from pdserve.engine.models.quantization import check_quantization
from pdserve.engine.request import Logprob, Request, RequestStatus
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler, SchedulerConfig
from pdserve.engine.spec_decode import SpeculativeConfig, ngram_propose, speculates
from pdserve.engine.structured_output import GrammarCompiler, StructuredOutputSpec
from pdserve.engine.suffix_decoding import SuffixProposer
from pdserve.engine.tokenizer import eos_token_ids as checkpoint_eos_token_ids
from pdserve.engine.tokenizer import load_tokenizer, read_chat_template
from pdserve.engine.tp_executor import threads_per_rank

logger = logging.getLogger(__name__)

_CPU_KV_CACHE_BYTES = 4 << 30  # vLLM's VLLM_CPU_KVCACHE_SPACE default: 4 GiB


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class LLMEngine:
    """Single-process engine over a local model (a hub id in ``config`` is resolved first).

    Args:
        config: the engine settings.
        kv_event_callback: receives prefix-cache ``KVEvent``s (for the Redis index).
        eos_token_ids: overrides the checkpoint's EOS ids (default: those of its
            generation config and tokenizer, ``tokenizer.eos_token_ids``).
        kv_lease_s: seconds a finished ``remote_decode`` request's blocks stay pinned for
            a decode worker (``begin_kv_send``) before ``expire_leases`` unpins them.

    ``tokenizer`` is the checkpoint's tokenizer, or None when it ships none.

    Raises:
        ValueError: settings that cannot work (e.g. a KV cache too small for one
            ``max_model_len`` sequence), naming the setting.
    """

    def __init__(self, config: EngineConfig,
                 kv_event_callback: Callable[[KVEvent], None] | None = None,
                 eos_token_ids: Sequence[int] | None = None, kv_lease_s: float = 30.0
                 ) -> None:
        config = resolve_model_paths(config)
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = resolve_device(config.device)
        if config.tensor_parallel_size > 1 and self.device.type == "cpu" and \
                not config.num_threads:
            config = dataclasses.replace(
                config, num_threads=threads_per_rank(config.tensor_parallel_size))
            self.config = config
            torch.set_num_threads(config.num_threads)
        self.source = open_model(config.model)
        self.model_config = ModelConfig.from_dict(
            self.source.config_dict(), model=str(self.source.path), dtype=config.dtype,
            max_model_len=config.max_model_len)
        self.model_config = dataclasses.replace(self.model_config, quantization=(
            check_quantization(config.quantization, self.source.quant_method())))
        if config.dtype == "auto" and self.device.type == "cpu":
            dtype = cpu_compute_dtype(self.model_config.dtype)
            if dtype != self.model_config.dtype:
                logger.info("--dtype auto: computing in %s, not the checkpoint's %s: this "
                            "CPU has no native %s arithmetic (--dtype %s keeps it)",
                            _dtype_name(dtype), _dtype_name(self.model_config.dtype),
                            _dtype_name(self.model_config.dtype),
                            _dtype_name(self.model_config.dtype))
                self.model_config = dataclasses.replace(self.model_config, dtype=dtype)
        self.served_model_name = config.served_model_name or config.model
        self.tokenizer = self._load_tokenizer()
        if eos_token_ids is None:
            eos_token_ids = checkpoint_eos_token_ids(config.model, self.tokenizer,
                                                     config.generation_config)
        self.eos_token_ids = frozenset(eos_token_ids)
        sized_by_share = (self.device.type == "cuda" and config.num_gpu_blocks_override is None
                          and config.kv_cache_memory_bytes is None)
        gpu_reserved_at_start = self._check_gpu_share() if sized_by_share else 0
        self.model_runner = ModelRunner(self.model_config, config.block_size, self.device,
                                        config.seed, config.load_progress, self.source,
                                        config.kv_cache_dtype, config.tensor_parallel_size,
                                        num_threads=config.num_threads)
        try:
            self.num_blocks = self._num_kv_blocks(gpu_reserved_at_start)
            self.model_runner.allocate_kv_cache(self.num_blocks)
        except BaseException:
            self.model_runner.shutdown()
            raise
        self.kv_cache_manager = KVCacheManager(
            self.num_blocks, config.block_size,
            root_block_hash(self.served_model_name, config.block_size, config.kv_cache_dtype),
            config.enable_prefix_caching, kv_event_callback, lease_s=kv_lease_s,
            sliding_window=self.model_config.kv_free_window)
        self.speculative_config = spec = SpeculativeConfig.parse(config.speculative_config)
        self.suffix_proposer = (SuffixProposer(spec.suffix)
                                if spec is not None and spec.method == "suffix" else None)
        self.draft_proposer = None
        if spec is not None and spec.method == "draft_model":
            from pdserve.engine.draft_proposer import DraftProposer
            from pdserve.engine.hub import resolve_model

            self.draft_proposer = DraftProposer(
                resolve_model(spec.model, download_dir=config.download_dir),
                self.model_config, config.block_size, self.num_blocks, self.device)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, self._token_budget(),
                            self.model_config.max_model_len),
            self.kv_cache_manager, self._propose if spec is not None else None,
            self._request_finished if spec is not None and spec.method != "ngram" else None)
        self.iteration_tokens = TokenHistogram()
        self._grammar_compiler: GrammarCompiler | None = None  # made on first use
        self._grammar_compiler_lock = threading.Lock()

    def _load_tokenizer(self):
        """``--tokenizer``'s tokenizer, else the model's own; None when there is none."""
        template = read_chat_template(self.config.chat_template)
        if self.config.tokenizer is not None:
            return load_tokenizer(self.config.tokenizer, chat_template=template)
        if not self.source.has_tokenizer():
            return None
        tokenizer = self.source.load_tokenizer()
        if template is not None:
            tokenizer.chat_template = template
        return tokenizer

    def _token_budget(self) -> int:
        if self.config.max_num_batched_tokens is not None:
            return self.config.max_num_batched_tokens
        return 8192 if self.device.type == "cuda" else 1024

    @property
    def max_model_len(self) -> int:
        return self.model_config.max_model_len

    def _num_kv_blocks(self, gpu_reserved_at_start: int) -> int:
        """Blocks of the KV cache; ``gpu_reserved_at_start``: the bytes this process's CUDA
        caching allocator held before this engine loaded anything (CUDA only)."""
        cfg, mc = self.config, self.model_config
        block_bytes = self.model_runner.kv_layout.block_bytes  # NOTE: a TP rank's share
        min_blocks = cdiv(mc.max_model_len, cfg.block_size)
        if cfg.num_gpu_blocks_override is not None:
            num_blocks = cfg.num_gpu_blocks_override
        elif cfg.kv_cache_memory_bytes is not None:
            num_blocks = cfg.kv_cache_memory_bytes // block_bytes
        elif self.device.type == "cuda":
            num_blocks = self._num_gpu_blocks(block_bytes, gpu_reserved_at_start)
        else:
            useful = cfg.max_num_seqs * min_blocks
            num_blocks = min(_CPU_KV_CACHE_BYTES // block_bytes, useful)
        if num_blocks < min_blocks:
            # NOTE: as vLLM, refuse rather than serve less, and say what would fit
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks of {cfg.block_size} tokens "
                f"({num_blocks * block_bytes} bytes), fewer than one max_model_len="
                f"{mc.max_model_len} sequence needs ({min_blocks} blocks, "
                f"{min_blocks * block_bytes} bytes); raise kv_cache_memory_bytes / "
                "gpu_memory_utilization / num_gpu_blocks_override, or lower max_model_len "
                f"to at most {num_blocks * cfg.block_size}")
        return int(num_blocks)

    def _check_gpu_share(self) -> int:
        """Refuse to start without this engine's share free; return the bytes this
        process's CUDA caching allocator holds now, before this engine loads anything.

        Raises:
            ValueError: less is free than this engine's share (``gpu_memory_utilization``
                of the whole GPU), naming the setting, as vLLM refuses to start.
        """
        free, total = torch.cuda.mem_get_info(self.device)  # NOTE: makes the CUDA context
        share = self.config.gpu_memory_utilization
        if free < share * total:
            raise ValueError(
                f"gpu_memory_utilization={share} asks for {share * total / 2**30:.2f} GiB of "
                f"{torch.cuda.get_device_name(self.device)}'s {total / 2**30:.2f} GiB, but "
                f"only {free / 2**30:.2f} GiB are free (other processes hold the rest): "
                "lower gpu_memory_utilization or free the GPU")
        return torch.cuda.memory_reserved(self.device)

    def _num_gpu_blocks(self, block_bytes: int, reserved_at_start: int) -> int:
        """KV blocks that fit in this engine's share of the GPU, ``gpu_memory_utilization``
        of its whole memory (vLLM's meaning: two engines on one GPU take 0.45 each), beside
        what this engine uses otherwise: what its process's caching allocator took since
        ``reserved_at_start`` (its weights, library workspaces) and the activations of its
        largest step, measured by a profile run.

        NOTE: counted on this process's allocator, not the device's free memory: another
        process allocating while this one loads (a second engine starting, other jobs on
        a shared GPU) would otherwise shrink this cache by what it took (on an H100 with
        parallel test processes, 9 of 21 GB). The CUDA context is made before
        ``reserved_at_start`` and is outside the share's accounting, as in vLLM.
        """
        cfg = self.config
        activation_bytes = self.model_runner.profile_activation_bytes(
            self._token_budget(), cfg.max_num_seqs, self.model_config.max_model_len)
        total = torch.cuda.mem_get_info(self.device)[1]
        used = max(torch.cuda.memory_reserved(self.device) - reserved_at_start, 0) \
            + activation_bytes
        budget = int(total * cfg.gpu_memory_utilization) - used
        logger.info("GPU memory: %.2f GiB of %.2f GiB for this engine "
                    "(gpu_memory_utilization=%s); weights and workspaces %.2f GiB, a step's "
                    "activations %.2f GiB, the KV cache %.2f GiB", total * cfg.gpu_memory_utilization
                    / 2**30, total / 2**30, cfg.gpu_memory_utilization,
                    (used - activation_bytes) / 2**30, activation_bytes / 2**30,
                    max(budget, 0) / 2**30)
        return max(budget, 0) // block_bytes

    def grammar_compiler(self) -> GrammarCompiler:
        """The structured output compiler of this engine's tokenizer, made on the first
        constrained request (thread-safe).

        Raises:
            ValueError: the checkpoint has no tokenizer.
        """
        with self._grammar_compiler_lock:
            if self._grammar_compiler is None:
                if self.tokenizer is None:
                    raise ValueError("structured_output needs the checkpoint's tokenizer, and "
                                     "this checkpoint has none")
                self._grammar_compiler = GrammarCompiler(
                    self.tokenizer, self.model_config.vocab_size, sorted(self.eos_token_ids))
            return self._grammar_compiler

    def compile_grammar(self, spec: StructuredOutputSpec | None) -> None:
        """Compile ``spec`` into the cache, from any thread: ``AsyncEngine`` calls it in a
        worker thread before a request is added, so the engine thread finds it compiled.

        Raises:
            ValueError: the spec does not compile, or there is no tokenizer.
        """
        if spec is not None:
            self.grammar_compiler().compile(spec)

    def make_request(self, request_id: str, prompt_token_ids: Sequence[int],
                     sampling_params: SamplingParams, cache_salt: str | None = None,
                     resume_token_ids: Sequence[int] = (), priority: int = 0) -> Request:
        """Validate a prompt and build its ``Request``; ``resume_token_ids`` are output
        tokens generated earlier (elsewhere), which the request starts with; ``priority``
        (vLLM's): lower is scheduled first (``engine/scheduler.py``).

        Raises:
            ValueError: an empty prompt, a token id outside ``[0, vocab_size)``, a prompt
                of ``max_model_len`` tokens or more, or as many resumed tokens as the
                request may generate; a structured output that does not compile, or
                resumed tokens its grammar forbids.
        """
        prompt = [int(t) for t in prompt_token_ids]
        resumed = [int(t) for t in resume_token_ids]
        if not prompt:
            raise ValueError("prompt is empty: at least one token is required")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt + resumed if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is out of range [0, {vocab})")
        if len(prompt) >= self.max_model_len:
            raise ValueError(f"The prompt (length {len(prompt)}) is longer than the maximum "
                             f"model length of {self.max_model_len} minus one output token")
        room = self.max_model_len - len(prompt)
        max_tokens = room if sampling_params.max_tokens is None else min(
            sampling_params.max_tokens, room)
        if len(resumed) >= max_tokens:
            raise ValueError(f"resume_token_ids holds {len(resumed)} tokens, but the request "
                             f"may generate at most {max_tokens}: nothing is left to generate")
        request = Request(request_id, prompt, sampling_params, self.eos_token_ids, max_tokens,
                          cache_salt, int(priority))
        if sampling_params.structured_output is not None:
            request.grammar = self.grammar_compiler().matcher(sampling_params.structured_output)
        for token_id in resumed:
            request.append_output_token(token_id)
        return request

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int],
                    sampling_params: SamplingParams, cache_salt: str | None = None,
                    remote_decode: bool = False, resume_token_ids: Sequence[int] = (),
                    kv_consumer: str | None = None, priority: int = 0) -> Request:
        """Queue a request (see ``make_request`` for the errors raised).

        ``remote_decode=True`` (prefill workers): the request ends after its first token
        with status ``FINISHED_REMOTE_DECODE`` (unless that token already finishes it) and
        its blocks stay pinned under a lease (``begin_kv_send``, ``release_held``,
        ``expire_leases``) that only ``kv_consumer`` may take, when given (``grant_kv``
        names another). ``resume_token_ids``: a request migrated from another worker
        goes on after the tokens it already generated, computing prompt and those tokens
        as one prefill (as recompute after preemption does); per-position seeds make its
        continuation the one it would have had, up to rounding: prefill attention sums
        in another order than the decode steps that first computed those tokens' KV, and
        a draw (or an argmax) within rounding of the boundary between two tokens goes the
        other way (docs/architecture.md, Lifecycle and failure).
        """
        request = self.make_request(request_id, prompt_token_ids, sampling_params, cache_salt,
                                    resume_token_ids, priority)
        request.remote_decode = remote_decode
        request.kv_consumer = kv_consumer
        self.scheduler.add_request(request)
        return request

    def add_kv_transfer_request(self, request_id: str, prompt_token_ids: Sequence[int],
                                first_token: int, sampling_params: SamplingParams,
                                cache_salt: str | None = None,
                                first_logprob: Logprob | None = None,
                                priority: int = 0) -> KVTransferAllocation | None:
        """Decode workers: admit a request prefilled elsewhere, whose first token is known.

        Allocates its blocks, reusing locally cached ones; returns which of the prompt's
        blocks to pull and into which local block ids, or None when too few blocks are
        free now (retry after a step). Call ``finish_kv_transfer`` when the pull ends.

        Raises:
            ValueError: as ``make_request``, or a reused ``request_id``.
        """
        request = self.make_request(request_id, prompt_token_ids, sampling_params, cache_salt,
                                    priority=priority)
        if not 0 <= int(first_token) < self.model_config.vocab_size:
            raise ValueError(f"first_token_id {first_token} is out of range "
                             f"[0, {self.model_config.vocab_size})")
        request.append_output_token(int(first_token), first_logprob)  # advances the grammar
        if not self.scheduler.add_kv_transfer_request(request):
            return None
        block_size = self.config.block_size
        first_missing = request.num_cached_tokens // block_size
        block_ids = self.kv_cache_manager.block_ids(request_id)
        # NOTE: the prompt's full blocks are hashed already (the prefix cache's lookup);
        # a block the first token completes is not a prompt block
        kv = self.kv_cache_manager
        full = kv.update_block_hashes(request)[:request.num_prompt_tokens // block_size]
        bindings = block_bindings(request.prompt_token_ids, block_size, kv.root_hash,
                                  request.cache_salt, full_hashes=full)
        return KVTransferAllocation(
            request_id, list(range(first_missing, cdiv(request.num_prompt_tokens, block_size))),
            block_ids[first_missing:], request.num_cached_tokens, bindings[first_missing:])

    def finish_kv_transfer(self, request_id: str, ok: bool) -> bool:
        """The pull for ``request_id`` ended (``ok``: all blocks arrived). True if the
        request goes on to decode."""
        request = self.scheduler.finish_kv_transfer(request_id, ok)
        return request is not None and request.status == RequestStatus.WAITING

    def held_block_ids(self, request_id: str) -> list[int] | None:
        """Block ids a finished prefill request still holds, or None."""
        return self.kv_cache_manager.held_block_ids(request_id)

    def begin_kv_send(self, request_id: str, consumer: str | None = None) -> list[int]:
        """Prefill workers: the block ids of ``request_id``'s lease, marked as being sent
        to ``consumer`` until ``end_kv_send``. Raises KeyError without a live lease (or
        while another send of it runs), PermissionError if the lease names another
        consumer."""
        return self.kv_cache_manager.begin_send(request_id, consumer)

    def bind_kv_lease(self, request_id: str, bindings: list[bytes]) -> list[int] | None:
        """Prefill workers: record what each block of ``request_id``'s lease holds (the KV
        path's block tags, ``block_hash.block_bindings``) and return its block ids; None
        without a live lease of that many blocks."""
        return self.kv_cache_manager.bind(request_id, bindings)

    def kv_lease_bindings(self, request_id: str) -> list[bytes] | None:
        """What ``bind_kv_lease`` recorded for ``request_id``'s lease, or None."""
        return self.kv_cache_manager.bindings(request_id)

    def grant_kv(self, request_id: str, consumer: str | None) -> bool:
        """Let ``consumer`` take ``request_id``'s lease instead of the one it names (the
        router retries the decode elsewhere); False without a live lease not being sent."""
        return self.kv_cache_manager.grant(request_id, consumer)

    def end_kv_send(self, request_id: str, ok: bool) -> None:
        """The send of a lease ended: sent, or released meanwhile, its blocks are unpinned
        into the prefix cache; failed, the lease stands until it expires (another decode
        worker may pull it)."""
        self.kv_cache_manager.end_send(request_id, ok)

    def release_held(self, request_id: str) -> bool:
        """Unpin a finished prefill request's blocks (into the prefix cache)."""
        return self.kv_cache_manager.release_held(request_id)

    def expire_leases(self, now: float) -> list[str]:
        """Unpin leases past their expiry (``time.monotonic()`` seconds); their ids."""
        return self.kv_cache_manager.expire_leases(now)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request at any point and free its blocks, or unpin its lease if it has
        finished under one (at the end of a send of it, if one runs); False if neither is
        here."""
        if self.scheduler.abort_request(request_id) is not None:
            return True
        return self.kv_cache_manager.release_held(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def has_schedulable_requests(self) -> bool:
        """Whether a step has requests to consider: waiting or running ones. A decode
        worker's request whose KV is being pulled is unfinished but not schedulable
        until ``finish_kv_transfer``."""
        return bool(self.scheduler.waiting or self.scheduler.running)

    def bind_threads(self, explicit_only: bool = False) -> int:
        """Bind the calling thread's intra-op team as ``cpu_omp_threads_bind`` says (CPU
        engines only); returns how many threads were bound. Call it on the thread that
        steps the engine (an OpenMP team belongs to its thread): ``AsyncEngine`` does on
        its own thread; ``LLM`` only for a CPU list (``explicit_only``), since "auto"
        would pin its caller's thread, and every process that thread starts later
        (``cpu_threads.bind_intra_op_threads``).

        Raises:
            ValueError: a CPU list shorter than the team.
        """
        if self.device.type != "cpu":
            return 0
        return bind_intra_op_threads(self.config.cpu_omp_threads_bind, self.config.num_threads,
                                     explicit_only)

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks (none at ``tensor_parallel_size`` 1)."""
        self.model_runner.shutdown()

    def _propose(self, request: Request) -> list[int]:
        """A decoding request's proposals (``speculative_config``'s method), as many as
        can stand before ``max_tokens`` or ``max_model_len``; [] where it does not
        speculate (``spec_decode.speculates``)."""
        spec = self.speculative_config
        room = min(spec.num_speculative_tokens,
                   request.max_tokens - request.num_output_tokens - 1,
                   self.model_config.max_model_len - request.num_tokens)
        if (room <= 0 or len(self.scheduler.running) >= spec.disable_by_batch_size
                or not speculates(request)):
            return []
        if self.draft_proposer is not None:  # NOTE: filled after scheduling (draft_proposer)
            return [] if request.grammar is not None else [PENDING] * room
        if self.suffix_proposer is not None:
            proposals = self.suffix_proposer.propose(request.request_id,
                                                     request.all_token_ids, room)
        else:
            proposals = ngram_propose(request.all_token_ids, room, spec.prompt_lookup_max,
                                      spec.prompt_lookup_min)
        if request.grammar is not None:  # NOTE: only what the grammar allows is verified
            proposals = proposals[:request.grammar.valid_prefix(proposals)]
        return proposals

    def _request_finished(self, request: Request) -> None:
        """SuffixDecoding: a request that ended leaves its tokens to the global index
        (unless aborted) and drops its own; a draft model forgets its progress."""
        if self.draft_proposer is not None:
            self.draft_proposer.finish(request)
            return
        aborted = request.status == RequestStatus.FINISHED_ABORTED
        self.suffix_proposer.finish(request.request_id,
                                    [] if aborted else request.all_token_ids)

    def step(self) -> list[EngineOutput]:
        """Schedule, run the model once, and report each request's new tokens."""
        out = self.scheduler.schedule()
        if not out.requests:
            return []
        self.iteration_tokens.observe(out.total_num_scheduled_tokens)
        if self.draft_proposer is not None:
            self.draft_proposer.propose(out, self.kv_cache_manager)
        sampled = self.model_runner.execute(out, self.kv_cache_manager)
        before = {r.request_id: (r.num_output_tokens, len(r.output_logprobs))
                  for r in out.requests}
        outputs = []
        updated = self.scheduler.update_from_output(out, sampled)
        if self.draft_proposer is not None:
            self.draft_proposer.after_step(out)
        for request in updated:
            num_before, logprobs_before = before[request.request_id]
            first = num_before == 0 and request.prompt_logprobs
            outputs.append(EngineOutput(
                request.request_id, request.output_token_ids[num_before:],
                request.output_logprobs[logprobs_before:], request.status.finished,
                request.status.finish_reason, request.stop_reason, request.num_prompt_tokens,
                request.num_cached_tokens, list(request.prompt_logprobs) if first else None))
        return outputs

    def num_free_blocks(self) -> int:
        return self.kv_cache_manager.pool.num_free_blocks

    def reset_prefix_cache(self) -> bool:
        """Forget every prefix-cached block (emitting ``removed`` KV events), as vLLM's
        ``reset_prefix_cache``; False (nothing done) while a request holds blocks."""
        return self.kv_cache_manager.pool.reset_prefix_cache()

    def num_unowned_blocks(self) -> int:
        """The audit of docs/architecture.md's ownership rule: blocks in use (ref count > 0) that no
        owner holds, i.e. not referenced by a request (running, waiting, waiting for KV)
        nor by a lease. 0 unless a block leaked. O(blocks owned); call it on the engine
        thread, between steps."""
        owners = set(self.scheduler.requests) | set(self.scheduler.waiting_for_kv)
        kv = self.kv_cache_manager
        owned = {block.block_id for request_id, blocks in kv.req_to_blocks.items()
                 if request_id in owners for block in blocks if block is not None}
        owned.update(block.block_id for lease in kv.leases() for block in lease.blocks)
        num_in_use = self.num_blocks - kv.pool.num_free_blocks
        return num_in_use - len(owned)

    def ownership(self) -> BlockOwnership:
        """Who owns the blocks now (``BlockOwnership``); call it on the engine thread."""
        kv = self.kv_cache_manager
        return BlockOwnership(
            num_requests_waiting_for_kv=len(self.scheduler.waiting_for_kv),
            num_leases=len(kv.leases()), num_leased_blocks=kv.num_leased_blocks,
            num_unowned_blocks=self.num_unowned_blocks())

    def is_idle_and_clean(self) -> bool:
        """True when no request is held and every block is free (for leak checks)."""
        return (not self.has_unfinished_requests()
                and self.num_free_blocks() == self.num_blocks
                and not self.kv_cache_manager.req_to_blocks
                and not self.kv_cache_manager.leases()
                and not self.scheduler.waiting_for_kv)


__all__ = ["LLMEngine"]
