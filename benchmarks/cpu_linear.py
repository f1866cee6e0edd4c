"""pdserve's packed linear against oneDNN's, on one forward pass's linears.

Times the linears of one forward pass of a Llama-shaped model (per layer: the fused QKV
and gate/up projections, o_proj, down_proj; then the LM head) at each ``--rows`` count
(the step's tokens), in ``--dtype`` (fp32 on AVX2 or AVX-512 builds, bf16 on AVX-512
ones), once with ``torch.ops.pdserve_cpu.linear_packed`` (``kernels/csrc/cpu_gemm.cpp``,
``cpu_gemm_avx512.cpp``) and once with oneDNN's packed linear (``mkldnn._linear_pointwise``,
what ``PackedLinear`` uses where ``cpu_ext.linear_packed_dtypes`` does not name the
dtype), the two alternating in one process for ``--seconds`` per row count, so drift on a
shared machine hits both alike. Every layer has its own weights (the whole model's, ~500
MB in fp32 at the default shape, streamed from memory each step as in an engine). Prints
the median step time of each and their ratio. Default shape: W1's 125M Llama (hidden
768, 12 layers, 12 heads over 4 kv heads of 64, intermediate 2048, vocab 32000).

    python benchmarks/cpu_linear.py
    python benchmarks/cpu_linear.py --dtype bfloat16 --rows 1 32 256 --seconds 20 --json linear.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256, 1024])
    parser.add_argument("--hidden-size", type=int, default=768)
    parser.add_argument("--intermediate-size", type=int, default=2048)
    parser.add_argument("--num-layers", type=int, default=12)
    parser.add_argument("--num-heads", type=int, default=12)
    parser.add_argument("--num-kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--threads", type=int, default=None, help="default: torch's")
    parser.add_argument("--seconds", type=float, default=10.0, help="per row count")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()

    from pdserve.kernels import cpu_ext

    dtype = getattr(torch, args.dtype)
    if not cpu_ext.has_linear_packed():
        raise SystemExit("linear_packed does not run here (needs the C++ kernels built for "
                         "an AVX2 + FMA or an AVX-512 CPU)")
    if dtype == torch.bfloat16 and torch.ops.pdserve_cpu.linear_panel_width() != 32:
        raise SystemExit("linear_packed takes bfloat16 on AVX-512 builds only")
    if args.threads:
        torch.set_num_threads(args.threads)
    hidden, qkv = args.hidden_size, (args.num_heads + 2 * args.num_kv_heads) * args.head_dim
    shapes = [(hidden, qkv), (args.num_heads * args.head_dim, hidden),
              (hidden, 2 * args.intermediate_size), (args.intermediate_size, hidden)]
    shapes = shapes * args.num_layers + [(hidden, args.vocab_size)]
    generator = torch.Generator().manual_seed(0)
    layers = []
    for in_features, out_features in shapes:
        weight = (torch.randn(out_features, in_features, generator=generator) * 0.02).to(dtype)
        layers.append((in_features, out_features,
                       torch.ops.pdserve_cpu.pack_linear_weight(weight),
                       torch.ops.mkldnn._reorder_linear_weight(weight, None)))

    figures = {"machine": platform.processor() or platform.machine(), "dtype": args.dtype,
               "threads": torch.get_num_threads(), "rows": {}}
    print(f"{'rows':>6} {'pdserve ms':>11} {'oneDNN ms':>10} {'GFLOP/s':>8} {'ratio':>6}")
    for rows in args.rows:
        inputs = {k: torch.randn(rows, k, generator=generator).to(dtype) for k, _, _, _ in layers}

        def ours(inputs: dict = inputs) -> None:
            for k, n, packed, _ in layers:
                torch.ops.pdserve_cpu.linear_packed(inputs[k], packed, None, n)

        def onednn(inputs: dict = inputs) -> None:
            for k, _, _, packed in layers:
                torch.ops.mkldnn._linear_pointwise(inputs[k], packed, None, "none", [], "")

        ours()
        onednn()
        times: dict[str, list[float]] = {"pdserve": [], "onednn": []}
        deadline = time.monotonic() + args.seconds
        while time.monotonic() < deadline or len(times["pdserve"]) < 3:
            for name, step in (("pdserve", ours), ("onednn", onednn)):
                start = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - start)
        ours_s, onednn_s = statistics.median(times["pdserve"]), statistics.median(times["onednn"])
        flops = sum(2 * rows * k * n for k, n, _, _ in layers)
        figures["rows"][rows] = {"pdserve_ms": ours_s * 1e3, "onednn_ms": onednn_s * 1e3,
                                 "steps": len(times["pdserve"]), "ratio": onednn_s / ours_s}
        print(f"{rows:>6} {ours_s * 1e3:>11.2f} {onednn_s * 1e3:>10.2f} "
              f"{flops / ours_s / 1e9:>8.1f} {onednn_s / ours_s:>6.2f}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(figures, out, indent=2)


if __name__ == "__main__":
    main()
