"""Kernel benchmark: each Triton kernel against its PyTorch reference (and SDPA), on a GPU.

Times (CUDA events, warmup, median of ``--iters``, L2 flushed before each run):

- paged decode attention vs its reference vs dense SDPA over the same (unpaged) K/V, at
  batch 1, 16, 64 x context 1k, 8k, with the decode kernel's achieved memory bandwidth
  (bytes of K/V read + query + output, over time) as a fraction of the GPU's measured
  copy bandwidth (a large ``Tensor.copy_``: bytes read + written, over time);
- prefill attention over a paged prefix vs its reference vs dense causal SDPA, with its
  TFLOP/s and the fraction of copy bandwidth its fewest bytes (context K/V, query and
  output once) reach;
- the KV store and block gather / scatter vs their references, with the same fraction.

Usage: ``python benchmarks/kernels.py [--json results.json]``; the model shape defaults to
Llama-3-8B's attention (32 query heads, 8 kv heads, head_dim 128, bf16, block size 16).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from pdserve.kernels import block_copy, kv_store
from pdserve.kernels import paged_decode_attention as decode
from pdserve.kernels import paged_prefill_attention as prefill

DECODE_BATCHES = (1, 16, 64)
DECODE_CONTEXTS = (1024, 8192)
TARGET_FRACTION = 0.70  # issue target: batch 64, 8k context


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--num-layers", type=int, default=32, help="for gather/scatter")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--skip-reference", action="store_true",
                        help="skip the (slow, memory-hungry) reference timings")
    parser.add_argument("--json", help="also write the results to this JSON file")
    return parser.parse_args()


class Timer:
    """Median CUDA-event time of a callable, with the L2 cache flushed before each run."""

    def __init__(self, warmup: int, iters: int) -> None:
        self.warmup, self.iters = warmup, iters
        self._flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")

    def median_ms(self, fn: Callable[[], object]) -> float:
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.iters):
            self._flush.zero_()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    def try_median_ms(self, fn: Callable[[], object]) -> float | None:
        """``median_ms``, or None where ``fn`` fails (out of memory, unsupported backend)."""
        try:
            return self.median_ms(fn)
        except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
            print(f"    (skipped: {type(exc).__name__}: {str(exc).splitlines()[0][:80]})")
            torch.cuda.empty_cache()
            return None


def copy_bandwidth_gbps(timer: Timer, num_bytes: int = 2**30) -> float:
    """Device copy bandwidth: a ``num_bytes`` tensor copied, bytes read + written / time."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = timer.median_ms(partial(dst.copy_, src))
    return 2 * num_bytes / (ms * 1e-3) / 1e9


def paged_cache(num_seqs: int, context: int, args, dtype, seed: int = 0):
    """K/V caches holding ``num_seqs`` sequences of ``context`` tokens in shuffled blocks."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    blocks_per_seq = -(-context // args.block_size)
    num_blocks = num_seqs * blocks_per_seq
    shape = (num_blocks, args.block_size, args.num_kv_heads, args.head_dim)
    key_cache = torch.randn(shape, device="cuda", dtype=dtype, generator=gen)
    value_cache = torch.randn(shape, device="cuda", dtype=dtype, generator=gen)
    order = torch.randperm(num_blocks, device="cuda", generator=gen)
    block_tables = order.view(num_seqs, blocks_per_seq).int()
    return key_cache, value_cache, block_tables


def dense_kv(cache: torch.Tensor, block_tables: torch.Tensor, context: int) -> torch.Tensor:
    """The same K (or V) laid out densely for SDPA: ``[num_seqs, num_kv_heads, L, D]``."""
    rows = cache[block_tables.long()].flatten(1, 2)[:, :context]  # [S, L, H_kv, D]
    return rows.transpose(1, 2).contiguous()


def bench_decode(timer: Timer, args, dtype, copy_gbps: float) -> list[dict]:
    results = []
    scale = args.head_dim**-0.5
    elem = torch.finfo(dtype).bits // 8
    for batch in DECODE_BATCHES:
        for context in DECODE_CONTEXTS:
            key_cache, value_cache, block_tables = paged_cache(batch, context, args, dtype)
            query = torch.randn(batch, args.num_heads, args.head_dim, device="cuda", dtype=dtype)
            seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
            call = (query, key_cache, value_cache, block_tables, seq_lens, scale)
            triton_ms = timer.median_ms(partial(decode.paged_decode_attention_triton, *call))
            ref_ms = None if args.skip_reference else timer.try_median_ms(
                partial(decode.paged_decode_attention_ref, *call))
            dense = (query[:, :, None],  # [S, H, 1, D]
                     dense_kv(key_cache, block_tables, context),
                     dense_kv(value_cache, block_tables, context))
            sdpa_ms = timer.try_median_ms(
                partial(F.scaled_dot_product_attention, *dense, scale=scale, enable_gqa=True))
            kv_bytes = 2 * batch * context * args.num_kv_heads * args.head_dim * elem
            io_bytes = kv_bytes + 2 * query.numel() * elem
            gbps = io_bytes / (triton_ms * 1e-3) / 1e9
            results.append({"kernel": "paged_decode_attention", "batch": batch,
                            "context": context, "triton_ms": triton_ms, "reference_ms": ref_ms,
                            "sdpa_ms": sdpa_ms, "bytes": io_bytes, "achieved_gbps": gbps,
                            "fraction_of_copy": gbps / copy_gbps})
            del call, dense, key_cache, value_cache
            torch.cuda.empty_cache()
    return results


def bench_prefill(timer: Timer, args, dtype, copy_gbps: float) -> list[dict]:
    """Chunks of 512 tokens, without and with a 1536-token cached prefix. Bytes: the
    context's K/V read once, the query read and the output written."""
    results = []
    scale = args.head_dim**-0.5
    elem = torch.finfo(dtype).bits // 8
    for batch, q_len, prefix in ((4, 512, 0), (4, 512, 1536)):
        context = prefix + q_len
        key_cache, value_cache, block_tables = paged_cache(batch, context, args, dtype)
        query = torch.randn(batch * q_len, args.num_heads, args.head_dim, device="cuda",
                            dtype=dtype)
        cu_seqlens_q = torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32,
                                    device="cuda")
        seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        call = (query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, scale)
        triton_ms = timer.median_ms(partial(prefill.paged_prefill_attention_triton, *call))
        ref_ms = None if args.skip_reference else timer.try_median_ms(
            partial(prefill.paged_prefill_attention_ref, *call))
        dense = (query.view(batch, q_len, args.num_heads, args.head_dim).transpose(1, 2),
                 dense_kv(key_cache, block_tables, context),
                 dense_kv(value_cache, block_tables, context))
        if prefix == 0:
            mask = {"is_causal": True}
        else:
            positions = torch.arange(context, device="cuda")
            mask = {"attn_mask": positions[None, :] <= positions[prefix:, None]}  # [q_len, L]
        sdpa_ms = timer.try_median_ms(
            partial(F.scaled_dot_product_attention, *dense, scale=scale, enable_gqa=True, **mask))
        flops = 4 * batch * args.num_heads * args.head_dim * q_len * (prefix + (q_len + 1) / 2)
        io_bytes = (2 * batch * context * args.num_kv_heads * args.head_dim
                    + 2 * query.numel()) * elem
        gbps = io_bytes / (triton_ms * 1e-3) / 1e9
        results.append({"kernel": "paged_prefill_attention", "batch": batch, "q_len": q_len,
                        "prefix": prefix, "triton_ms": triton_ms, "reference_ms": ref_ms,
                        "sdpa_ms": sdpa_ms, "triton_tflops": flops / (triton_ms * 1e-3) / 1e12,
                        "bytes": io_bytes, "achieved_gbps": gbps,
                        "fraction_of_copy": gbps / copy_gbps})
        del call, dense, key_cache, value_cache
        torch.cuda.empty_cache()
    return results


def bench_store(timer: Timer, args, dtype, copy_gbps: float) -> list[dict]:
    """New K/V rows of 64 and 8192 tokens into random slots. Bytes: the rows read and
    written once."""
    results = []
    for num_tokens in (64, 8192):
        key_cache, value_cache, _ = paged_cache(1, 2 * num_tokens, args, dtype)
        key = torch.randn(num_tokens, args.num_kv_heads, args.head_dim, device="cuda",
                          dtype=dtype)
        value = torch.randn_like(key)
        slot_mapping = torch.randperm(2 * num_tokens, device="cuda")[:num_tokens]
        call = (key, value, key_cache, value_cache, slot_mapping)
        triton_ms = timer.median_ms(partial(kv_store.store_kv_triton, *call))
        io_bytes = 4 * key.numel() * key.element_size()  # K and V, read + written
        gbps = io_bytes / (triton_ms * 1e-3) / 1e9
        results.append({"kernel": "store_kv", "num_tokens": num_tokens, "triton_ms": triton_ms,
                        "reference_ms": timer.median_ms(partial(kv_store.store_kv_ref, *call)),
                        "bytes": io_bytes, "achieved_gbps": gbps,
                        "fraction_of_copy": gbps / copy_gbps})
    return results


def bench_block_copy(timer: Timer, args, dtype, copy_gbps: float) -> list[dict]:
    """128 blocks (2k tokens at block size 16) of a 2048-block cache, all layers."""
    shape = (args.num_layers, 2, 2048, args.block_size, args.num_kv_heads, args.head_dim)
    kv_cache = torch.randn(shape, device="cuda", dtype=dtype)
    block_ids = torch.randperm(2048, device="cuda")[:128]
    packed = block_copy.gather_blocks_triton(kv_cache, block_ids)
    moved = 2 * packed.numel() * packed.element_size()  # read + written
    results = []
    for name, triton_fn, ref_fn, call in (
        ("gather_blocks", block_copy.gather_blocks_triton, block_copy.gather_blocks_ref,
         (kv_cache, block_ids)),
        ("scatter_blocks", block_copy.scatter_blocks_triton, block_copy.scatter_blocks_ref,
         (kv_cache, block_ids, packed)),
    ):
        triton_ms = timer.median_ms(partial(triton_fn, *call))
        gbps = moved / (triton_ms * 1e-3) / 1e9
        results.append({"kernel": name, "num_blocks": 128, "triton_ms": triton_ms,
                        "reference_ms": timer.median_ms(partial(ref_fn, *call)),
                        "achieved_gbps": gbps, "fraction_of_copy": gbps / copy_gbps})
    del kv_cache, packed, call
    torch.cuda.empty_cache()
    return results


def fmt(ms: float | None) -> str:
    return "       -" if ms is None else f"{ms:8.3f}"


def report(results: list[dict], copy_gbps: float) -> None:
    print(f"\ncopy bandwidth: {copy_gbps:.0f} GB/s")
    print(f"\n{'kernel':>24} {'shape':<30} triton ms   ref ms  sdpa ms  extra")
    for r in results:
        shape = ", ".join(f"{k}={r[k]}" for k in ("batch", "context", "q_len", "prefix",
                                                    "num_tokens", "num_blocks") if k in r)
        extra = ""
        if "fraction_of_copy" in r:
            extra = f"{r['achieved_gbps']:.0f} GB/s = {r['fraction_of_copy']:.0%} of copy"
        if "triton_tflops" in r:
            extra += f", {r['triton_tflops']:.1f} TFLOP/s"
        print(f"{r['kernel']:>24} {shape:<30} {fmt(r['triton_ms'])} "
              f"{fmt(r.get('reference_ms'))} {fmt(r.get('sdpa_ms'))}  {extra}")
    target = [r for r in results if r["kernel"] == "paged_decode_attention"
              and r["batch"] == 64 and r["context"] == 8192]
    if target:
        fraction = target[0]["fraction_of_copy"]
        verdict = "meets" if fraction >= TARGET_FRACTION else "misses"
        print(f"\npaged decode, batch 64, 8k context: {fraction:.0%} of copy bandwidth "
              f"({verdict} the {TARGET_FRACTION:.0%} target)")


def main() -> int:
    args = parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/kernels.py needs a CUDA GPU (the Triton kernels are compiled for "
              "it); none is visible here.", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    timer = Timer(args.warmup, args.iters)
    device_name = torch.cuda.get_device_name()
    print(f"{device_name}, {args.dtype}, heads {args.num_heads}/{args.num_kv_heads}, "
          f"head_dim {args.head_dim}, block_size {args.block_size}")
    copy_gbps = copy_bandwidth_gbps(timer)
    results = bench_decode(timer, args, dtype, copy_gbps)
    results += bench_prefill(timer, args, dtype, copy_gbps)
    results += bench_store(timer, args, dtype, copy_gbps)
    results += bench_block_copy(timer, args, dtype, copy_gbps)
    report(results, copy_gbps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device_name, "args": vars(args), "copy_gbps": copy_gbps,
                       "results": results}, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
