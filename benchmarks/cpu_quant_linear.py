"""CPU quantized linears (W8A16, W4A16) against the bf16 linear they replace, in one run.

For each linear shape of W1's model and of Llama-3.2-1B's (``--shapes``), each weight
format (int8, int4: ``quantize_rtn`` in groups of 32, fp16 scales) and each row count of x
(``--rows``; bf16 x), the same call is timed three ways, in turns:

- ``bf16``: what a bf16 checkpoint's linears run on this CPU, ``PackedLinear``
  (``engine/models/layers.py``): oneDNN's packed bf16 linear on an AMD CPU and on Intel's
  with AMX, pdserve's own fp32-FMA GEMM (``linear_packed``) on Intel's without AMX (the
  header names which);
- ``tiles``: ``linear_quant_cpu`` on its fp32 FMA tiles, each k dequantized again for
  each 8 rows (``set_cpu_bf16_path(0)``, ``set_cpu_slice_rows`` past every row count);
- ``slices``: the same FMA path as it runs by default, where calls of 9 rows or more
  dequantize each 128-k slice of a panel once into fp32 and run ``linear_packed``'s
  12 x 32 register tiles over it (below 9 rows it is the tiles again);
- ``vdpbf16ps``: ``linear_quant_cpu`` on the raw integers widened to bf16
  (``set_cpu_bf16_path(1)``: ``kernels/csrc/cpu_gemm_quant_bf16.cpp``, needs AVX512-BF16;
  elsewhere it falls back to the FMA path, and the table says so).

Printed per row: the median microseconds of ``--iters`` calls of each (the weight stays in
cache between calls: this times the kernels' arithmetic, not DRAM), and the bf16 linear's
time over each quantized path's (the quantized linear's speed against the bf16 one;
above 1 is faster). The default path on this CPU is named at the top.

    python benchmarks/cpu_quant_linear.py [--rows 1 4 5 8 32 256] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch

from pdserve.engine.models.layers import PackedLinear
from pdserve.kernels import cpu_ext
from pdserve.kernels import quant_linear as ql

SHAPES = {  # (out_features, in_features) of each distinct linear
    "w1": [(1536, 768), (768, 768), (4096, 768), (768, 2048), (32000, 768)],
    "llama-3.2-1b": [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)],
}


def median_us(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["w1"])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 4, 5, 8, 32, 256])
    parser.add_argument("--bits", nargs="+", type=int, choices=[8, 4], default=[8, 4])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if not cpu_ext.load():
        raise SystemExit("the C++ CPU kernels did not build here")
    torch.set_num_threads(args.threads)
    has_bf16_path = ql.set_cpu_bf16_path(-1)
    print(f"threads {args.threads}; vdpbf16ps path built: {has_bf16_path} (if False, the "
          "vdpbf16ps column times the tiles again); default: AMD CPUs, 5 rows or more, int4 at any")
    print("bf16 column: " + ("pdserve's linear_packed" if torch.bfloat16 in
                             cpu_ext.linear_packed_dtypes() else "oneDNN's packed linear"))
    print(f"{'shape':<16}{'bits':>5}{'rows':>6}{'bf16 us':>10}{'tiles us':>10}"
          f"{'slices us':>11}{'vdpbf16ps us':>14}{'bf16/tiles':>12}{'bf16/slices':>13}"
          f"{'bf16/vdp':>10}")
    paths = (("tiles", 0, 1 << 40), ("slices", 0, 0), ("vdpbf16ps", 1, 0))
    try:
        for name in args.shapes:
            for n, k in SHAPES[name]:
                weight = torch.randn(n, k) * 0.02
                linear = torch.nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
                with torch.no_grad():
                    linear.weight.copy_(weight)
                dense = PackedLinear(linear)
                for bits in args.bits:
                    qw = ql.quantize_rtn(weight, bits, 32, torch.float16)
                    packed = ql.pack_for_cpu(qw)
                    for m in args.rows:
                        x = torch.randn(m, k).bfloat16()
                        times = {"bf16": median_us(partial(dense, x), args.iters)}
                        for path, mode, slice_rows in paths:
                            ql.set_cpu_bf16_path(mode)
                            ql.set_cpu_slice_rows(slice_rows)
                            times[path] = median_us(partial(
                                ql.linear_quant_cpu, x, packed, bits, 32, n), args.iters)
                        bf16 = times["bf16"]
                        print(f"{f'{n}x{k}':<16}{bits:>5}{m:>6}{bf16:>10.1f}"
                              f"{times['tiles']:>10.1f}{times['slices']:>11.1f}"
                              f"{times['vdpbf16ps']:>14.1f}{bf16 / times['tiles']:>12.2f}"
                              f"{bf16 / times['slices']:>13.2f}{bf16 / times['vdpbf16ps']:>10.2f}",
                              flush=True)
    finally:
        ql.set_cpu_bf16_path(-1)
        ql.set_cpu_slice_rows(0)


if __name__ == "__main__":
    main()
