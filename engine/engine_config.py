"""An engine's settings (``EngineConfig``), checked when made; flag names follow vLLM's
(``engine/args.py`` turns flags into one)."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields

import torch

from pdserve.engine.cpu_threads import parse_cpu_list
from pdserve.engine.spec_decode import SpeculativeConfig
from pdserve.kernels.kv_quant import canonical_kv_cache_dtype


@dataclass(slots=True)
class EngineConfig:
    """Everything an engine needs; flag names follow vLLM's.

    Where the model comes from (``engine/hub.py``, ``engine/model_source.py``): ``model``
    is a checkpoint folder, a ``.gguf`` file (or a folder holding one), or a hub id
    downloaded at ``revision`` into ``download_dir`` (default ``$HF_HOME/hub``);
    ``tokenizer`` another folder or hub id to take the tokenizer from;
    ``chat_template`` a Jinja template, or a file holding one, replacing the tokenizer's;
    ``generation_config`` (``auto``, ``vllm`` or a folder,
    ``engine/generation_config.py``) says whose ``eos_token_id`` ends generation.
    ``resolve_model_paths`` turns hub ids into local paths (``pdserve serve`` does it once,
    before its workers start).

    ``kv_cache_dtype`` (vLLM's ``--kv-cache-dtype``): ``auto`` stores the KV cache in
    the model's dtype; ``int8``, ``fp8`` (= ``fp8_e4m3``) and ``fp8_e5m2`` store one byte
    per value and one fp32 scale per (block, layer, K or V, kv head)
    (``kernels/kv_quant.py``), about twice the blocks in the same memory. It is part of
    the prefix-cache identity (``block_hash.root_block_hash``).

    Sizes: ``max_model_len``, ``max_num_batched_tokens`` in tokens; ``block_size`` in
    tokens per block; ``kv_cache_memory_bytes`` in bytes. ``device="auto"`` takes CUDA
    when available. ``num_threads`` caps torch's CPU threads (None leaves torch's default).
    ``max_num_batched_tokens=None`` resolves to 8192 on CUDA and 1024 on CPU: on CPU a
    step of 1024 tokens runs at the same tokens per second as one of 2048 (both ~1.5x
    faster than 8192-row matmuls, which leave the cache), and a burst of prompts gets its
    first tokens in smaller groups (W1's served shape on 2 cores: mean TTFT ~0.67 s
    against ~0.85 s, same throughput).

    ``cpu_omp_threads_bind`` (CPU only; vLLM's ``VLLM_CPU_OMP_THREADS_BIND``; see
    ``LLMEngine.bind_threads`` for which thread it applies to): ``"auto"``
    binds intra-op thread i to the i-th CPU this process may run on when there are as
    many threads as such CPUs (the engine owns them; otherwise nothing is bound, so two
    engines sharing a machine are not stacked on its first cores), ``"nobind"`` leaves
    the threads to the kernel, and a CPU list (``"0-3"``, ``"0,2,4-5"``) binds thread i
    to its i-th CPU. A bound team is never stacked onto one core while other processes
    (the router, the client) take the other: under W1's served load on 2 cores, unbound
    threads cost the decode worker ~13% more CPU time than the same work offline.

    ``tensor_parallel_size`` (vLLM's ``--tensor-parallel-size``): this engine's process
    is rank 0 of that many, the others processes it starts on this machine, each
    holding its share of the weights and of the KV cache (``engine/parallel.py``,
    ``engine/tp_executor.py``): one CUDA device each from ``device``'s index on, or on the
    CPU ``num_threads`` threads each (default: an equal share of the CPUs).
    ``kv_cache_memory_bytes`` is then each rank's.

    ``speculative_config`` (vLLM's ``--speculative-config``, JSON text or a dict, e.g.
    ``{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}``):
    decoding requests propose tokens and verify them in one forward pass
    (``engine/spec_decode.py``).
    """

    model: str
    served_model_name: str | None = None
    tokenizer: str | None = None
    revision: str | None = None
    download_dir: str | None = None
    generation_config: str = "auto"
    chat_template: str | None = None
    dtype: str | torch.dtype = "auto"
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    seed: int = 0
    device: str = "auto"
    num_threads: int | None = None
    cpu_omp_threads_bind: str = "auto"
    load_progress: bool = True
    tensor_parallel_size: int = 1
    speculative_config: str | dict | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.tensor_parallel_size <= 64:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} must be in "
                             "[1, 64]")
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size={self.block_size} must be a power of two <= 128")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        if self.cpu_omp_threads_bind not in ("auto", "nobind"):
            parse_cpu_list(self.cpu_omp_threads_bind)
        canonical_kv_cache_dtype(self.kv_cache_dtype)  # NOTE: raises for an unknown name
        SpeculativeConfig.parse(self.speculative_config)  # NOTE: raises, naming the key


def engine_default(name: str):
    """The default of ``EngineConfig``'s field ``name``: the one default of its engine flag
    (``engine/args.py``) and of the router's settings read from that flag
    (``router/config.py``: ``block_size``, ``kv_cache_dtype``, ...).

    Raises:
        KeyError: ``name`` is no field of ``EngineConfig``, or one without a default
            (``model``).
    """
    default = next((f.default for f in fields(EngineConfig) if f.name == name), MISSING)
    if default is MISSING:
        raise KeyError(f"EngineConfig has no field {name!r} with a default")
    return default
