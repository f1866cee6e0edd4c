"""The engine's command-line flags, with vLLM's names (as vLLM's ``engine/arg_utils.py``):
``add_engine_args`` declares them on a parser and ``engine_kwargs`` turns parsed flags into
``EngineConfig`` keyword arguments. Every command that builds an engine uses both: ``pdserve
generate``, ``pdserve serve`` and the plain-process workers."""

from __future__ import annotations

import argparse

from pdserve.engine.engine_config import engine_default
from pdserve.engine.models.quantization import QUANTIZATION_CHOICES
from pdserve.kernels.kv_quant import KV_CACHE_DTYPE_NAMES


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Flags shared by every command that builds an engine (vLLM's names). Each flag is
    ``EngineConfig``'s field of its name, with that field's default (``engine_default``);
    one without ``default=`` has None, the field's too (not given)."""
    d = engine_default
    parser.add_argument("--model", help="a Hugging Face checkpoint folder, a .gguf file (or "
                        "a folder holding one), or a Hugging Face hub id (org/name), "
                        "downloaded once into the cache (default: the demo model, written "
                        "on first use)")
    parser.add_argument("--served-model-name", nargs="+", metavar="NAME",
                        help="model name(s) clients use; the first is the one responses "
                        "name (default: --model)")
    parser.add_argument("--tokenizer", help="take the tokenizer from this folder, .gguf "
                        "file or hub id instead of --model's")
    parser.add_argument("--revision", help="the hub id's branch, tag or commit (default: main)")
    parser.add_argument("--download-dir", help="Hugging Face cache for hub ids (default: "
                        "$HF_HOME/hub)")
    parser.add_argument("--generation-config", default=d("generation_config"), metavar="auto|vllm|FOLDER",
                        help="sampling defaults and EOS ids: auto reads the model's "
                        "generation_config.json, vllm none, FOLDER that folder's")
    parser.add_argument("--chat-template", help="a Jinja chat template, or a file holding "
                        "one, instead of the tokenizer's")
    parser.add_argument("--dtype", default=d("dtype"),
                        choices=["auto", "float32", "bfloat16", "float16", "half", "float"],
                        help="weights and KV cache dtype; auto: the checkpoint's (bfloat16 "
                        "for a GGUF file), except float32 on an x86 CPU without AVX-512 "
                        "(no bf16/fp16 arithmetic)")
    parser.add_argument("--quantization", "-q", default=d("quantization"),
                        choices=QUANTIZATION_CHOICES,
                        help="weight quantization (vLLM's flag): int8 (as GGUF Q8_0) or int4 "
                        "(as Q4_1), in groups of 32, quantize a float checkpoint's linears "
                        "at load, round to nearest; a GGUF file keeps its quantized tensors "
                        "whatever is given; awq, gptq and compressed-tensors must name a "
                        "quantized checkpoint's quant_method (default: the checkpoint's)")
    parser.add_argument("--kv-cache-dtype", default=d("kv_cache_dtype"),
                        choices=KV_CACHE_DTYPE_NAMES,
                        help="KV cache storage: auto is --dtype; int8, fp8 (= fp8_e4m3) and "
                        "fp8_e5m2 store one byte per value and an fp32 scale per (block, "
                        "layer, K/V, kv head): about twice the blocks in the same memory")
    parser.add_argument("--max-model-len", type=int, help="tokens per sequence (prompt + output)")
    parser.add_argument("--block-size", type=int, default=d("block_size"),
                        help="tokens per KV block")
    parser.add_argument("--max-num-seqs", type=int, default=d("max_num_seqs"))
    parser.add_argument("--max-num-batched-tokens", type=int,
                        default=d("max_num_batched_tokens"),
                        help="per-step token budget (chunked prefill; default 1024 on CPU, "
                        "8192 on GPU)")
    parser.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching",
                        action="store_false")
    parser.add_argument("--num-gpu-blocks-override", type=int)
    parser.add_argument("--kv-cache-memory-bytes", type=int)
    parser.add_argument("--gpu-memory-utilization", type=float,
                        default=d("gpu_memory_utilization"))
    parser.add_argument("--seed", type=int, default=d("seed"))
    parser.add_argument("--device", default=d("device"), help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int,
                        default=d("tensor_parallel_size"),
                        help="ranks the model is split over, each a process of its own on "
                        "this machine (one GPU each, or a share of the CPUs over gloo)")
    parser.add_argument("--speculative-config", metavar="JSON",
                        help="speculative decoding (vLLM's keys), e.g. '{\"method\": "
                        "\"ngram\", \"num_speculative_tokens\": 3, "
                        "\"prompt_lookup_max\": 4}'")
    parser.add_argument("--num-threads", type=int, help="torch CPU threads for this engine "
                        "(each rank's, under tensor parallelism)")
    parser.add_argument("--cpu-omp-threads-bind", default=d("cpu_omp_threads_bind"),
                        help="CPU only (vLLM's VLLM_CPU_OMP_THREADS_BIND): auto binds "
                        "intra-op thread i to the i-th CPU this process may use when the "
                        "engine has one thread per such CPU; nobind; or a CPU list (0-3)")


def served_model_aliases(args: argparse.Namespace) -> tuple[str, ...]:
    """The names after the first of ``--served-model-name`` (the API accepts and lists
    them too; responses name the first)."""
    return tuple((args.served_model_name or [])[1:])


def engine_kwargs(args: argparse.Namespace) -> dict:
    """``EngineConfig`` keyword arguments from parsed engine flags (no ``--model``: the
    demo model, written on first use; a hub id stays one until the engine or ``pdserve
    serve`` resolves it). ``served_model_name`` is the first name given."""
    from pdserve.engine.demo_model import ensure_demo_model

    names = args.served_model_name or [None]
    return {
        "served_model_name": names[0], "tokenizer": args.tokenizer,
        "revision": args.revision, "download_dir": args.download_dir,
        "generation_config": args.generation_config, "chat_template": args.chat_template,
        "dtype": args.dtype, "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
        "max_model_len": args.max_model_len, "block_size": args.block_size,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "enable_prefix_caching": args.enable_prefix_caching,
        "num_gpu_blocks_override": args.num_gpu_blocks_override,
        "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
        "gpu_memory_utilization": args.gpu_memory_utilization, "seed": args.seed,
        "device": args.device, "num_threads": args.num_threads,
        "tensor_parallel_size": args.tensor_parallel_size,
        "speculative_config": args.speculative_config,
        "cpu_omp_threads_bind": args.cpu_omp_threads_bind,
        "model": args.model or str(ensure_demo_model()),
    }


__all__ = ["add_engine_args", "engine_kwargs", "served_model_aliases"]
