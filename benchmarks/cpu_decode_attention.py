"""The C++ CPU paged decode attention's achieved bandwidth against this machine's.

Times ``paged_decode_attention`` (``kernels/csrc/cpu_attention.cpp``) at one decode
step's shape, with each sequence's blocks scattered over a cache far larger than the
last-level cache (as a serving engine's are), a new set of blocks per call (as the
layers of a step read theirs), and reports the bytes of K and V read per second against
the machine's copy bandwidth measured in the same run (bytes read + written by a
``Tensor.copy_`` of ``--copy-mib`` MiB). Default shape: W1's served decode step (32
sequences of 320 tokens, 12 query heads over 4 kv heads of 64, fp32, block 16). The
cache sits on 2 MiB pages where Linux allows, as the engine's CPU KV cache does.

    python benchmarks/cpu_decode_attention.py
    python benchmarks/cpu_decode_attention.py --dtype bfloat16 --context-len 1024
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch


def timed(fn, repeats: int) -> float:
    """Best of ``repeats`` seconds per call of ``fn`` (after two warm-up calls)."""
    fn()
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=32)
    parser.add_argument("--context-len", type=int, default=320, help="tokens per sequence")
    parser.add_argument("--num-heads", type=int, default=12)
    parser.add_argument("--num-kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--cache-mib", type=int, default=512, help="K + V cache size")
    parser.add_argument("--copy-mib", type=int, default=256)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=None, help="default: torch's")
    parser.add_argument("--calls", type=int, default=48, help="calls per timed run")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()

    from pdserve.engine.kv_cache_layout import cpu_zeros_on_huge_pages
    from pdserve.kernels import cpu_ext
    from pdserve.kernels.paged_decode_attention import paged_decode_attention

    if not cpu_ext.load():
        raise SystemExit("the C++ CPU kernels did not build here")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    itemsize = torch.finfo(dtype).bits // 8
    block_bytes = args.block_size * args.num_kv_heads * args.head_dim * itemsize
    num_blocks = max(1, args.cache_mib * 2**20 // (2 * block_bytes))
    per_seq = -(-args.context_len // args.block_size)
    if num_blocks < args.num_seqs * per_seq:
        raise SystemExit(f"--cache-mib {args.cache_mib} holds {num_blocks} blocks, fewer "
                         f"than one step's {args.num_seqs * per_seq}")
    generator = torch.Generator().manual_seed(0)
    shape = (num_blocks, args.block_size, args.num_kv_heads, args.head_dim)
    # NOTE: on 2 MiB pages where Linux allows, as the engine's CPU KV cache
    key_cache = cpu_zeros_on_huge_pages(shape, dtype)
    value_cache = cpu_zeros_on_huge_pages(shape, dtype)
    key_cache.copy_(torch.randn(shape, generator=generator))
    value_cache.copy_(torch.randn(shape, generator=generator))
    query = torch.randn(args.num_seqs, args.num_heads, args.head_dim,
                        generator=generator).to(dtype)
    seq_lens = torch.full((args.num_seqs,), args.context_len, dtype=torch.int32)
    tables = [torch.randperm(num_blocks, generator=generator)[:args.num_seqs * per_seq]
              .view(args.num_seqs, per_seq).to(torch.int32) for _ in range(args.calls)]
    scale = args.head_dim ** -0.5

    def step() -> None:
        for table in tables:
            paged_decode_attention(query, key_cache, value_cache, table, seq_lens, scale)

    kv_bytes = 2 * args.num_seqs * args.context_len * args.num_kv_heads * args.head_dim * itemsize
    attention_s = timed(step, 5) / args.calls
    source = torch.empty(args.copy_mib * 2**20 // 4)
    target = torch.empty_like(source)
    copy_s = timed(lambda: target.copy_(source), 5)
    copy_gbs = 2 * source.numel() * 4 / copy_s / 1e9
    attention_gbs = kv_bytes / attention_s / 1e9
    figures = {"machine": platform.processor() or platform.machine(),
               "threads": torch.get_num_threads(), "dtype": args.dtype,
               "shape": {k: getattr(args, k) for k in ("num_seqs", "context_len", "num_heads",
                                                       "num_kv_heads", "head_dim", "block_size")},
               "attention_ms": attention_s * 1e3, "attention_gbs": attention_gbs,
               "copy_gbs": copy_gbs, "fraction_of_copy": attention_gbs / copy_gbs}
    print(f"paged decode attention: {attention_s * 1e3:.3f} ms per call, K/V read at "
          f"{attention_gbs:.1f} GB/s; copy bandwidth {copy_gbs:.1f} GB/s; ratio "
          f"{attention_gbs / copy_gbs:.2f} ({torch.get_num_threads()} threads, {args.dtype})")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(figures, out, indent=2)


if __name__ == "__main__":
    main()
