"""GGUF files' CPU linears as pdserve packs them against the per-group layout, in one run.

``pack_for_cpu`` keeps a K-quant's two levels of scales (an int8 code per group and an
fp32 factor per super-block of 256: ``kernels/quant_linear.py``, ``ScaleCodes``) and no
mins for Q4_0 (``-8 * scale``, computed in the kernel). The layout it replaced kept an
fp32 scale (and min) per group for the K-quants and Q4_0's mins as fp16. Both compute the
same products, so the difference is bytes read a token.

For each ``--gguf`` file: the model is loaded once; its quantized linears' packed copies are
rebuilt in the per-group layout (exact: the codes times their factors, ``-8 * scale``);
then greedy batch-1 decodes of ``--tokens`` tokens run with one layout and the other in
turns (``--turns`` pairs, the order alternating), after a check that both give the same
tokens. Printed per file: the packed linears' MB in each layout, each layout's median ms a
token, and the median of the pairwise ratios compact / per-group (below 1 is faster).

    python benchmarks/gguf_scales.py --gguf w1-q4_k_m.gguf w1-q4_0.gguf [--turns 20]

W1's files come from ``peers.py --gguf-types q4_0,q4_k_m`` (``--gguf-dir``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.models.cpu_decode import CpuDecodeLayers
from pdserve.engine.models.quantization import QuantizedLinear


def per_group(packed: tuple, bits: int) -> tuple:
    """``pack_for_cpu``'s tuple in the per-group layout: the codes expanded to fp32 scales
    and mins, a symmetric int4 weight's mins stored."""
    values, scales, mins, scale_super, min_super = packed
    if scale_super is not None:
        ratio = scales.shape[1] // scale_super.shape[1]
        scales = (scales.float() * scale_super.repeat_interleave(ratio, 1)).contiguous()
        if mins is not None:
            mins = (mins.float() * min_super.repeat_interleave(ratio, 1)).contiguous()
    elif bits == 4 and mins is None:
        mins = (-8 * scales.float()).to(scales.dtype).contiguous()
    return values, scales, mins, None, None


def megabytes(packed: tuple) -> float:
    return sum(t.numel() * t.element_size() for t in packed if t is not None) / 1e6


def measure(path: Path, tokens: int, turns: int) -> dict:
    llm = LLM(str(path), max_model_len=1024, load_progress=False)
    model = llm.engine.model_runner.model
    linears = [m for m in model.modules() if isinstance(m, QuantizedLinear) and m._cpu]
    layouts = {"compact": {m: m._cpu for m in linears},
               "per-group": {m: per_group(m._cpu, m.bits) for m in linears}}

    def use(name: str) -> None:
        for m in linears:
            m._cpu = layouts[name][m]
        model.cpu_decode = CpuDecodeLayers.build(model)  # NOTE: it binds the packed copies

    greedy = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    outputs = {}
    for name in layouts:
        use(name)
        outputs[name] = llm.generate([[5, 6, 7, 8]], greedy)[0].outputs[0].token_ids
    if outputs["compact"] != outputs["per-group"]:
        raise AssertionError(f"{path.name}: the layouts decode differently")
    times: dict[str, list[float]] = {name: [] for name in layouts}
    for turn in range(turns):
        for name in (("per-group", "compact") if turn % 2 == 0 else ("compact", "per-group")):
            use(name)
            start = time.perf_counter()
            llm.generate([[11 + turn, 12, 13, 14]], greedy)
            times[name].append((time.perf_counter() - start) / tokens * 1e3)
    ratios = [c / p for c, p in zip(times["compact"], times["per-group"])]
    return {"file": path.name,
            "mb": {name: sum(megabytes(p) for p in layout.values())
                   for name, layout in layouts.items()},
            "ms": {name: statistics.median(t) for name, t in times.items()},
            "ratio": statistics.median(ratios)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gguf", type=Path, nargs="+", required=True)
    parser.add_argument("--tokens", type=int, default=65)
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print("| file | packed MB, per-group -> compact | ms a token, per-group | compact | "
          "compact / per-group (pairwise median) |")
    print("| --- | --- | ---: | ---: | ---: |")
    for path in args.gguf:
        r = measure(path, args.tokens, args.turns)
        print(f"| {r['file']} | {r['mb']['per-group']:.1f} -> {r['mb']['compact']:.1f} | "
              f"{r['ms']['per-group']:.2f} | {r['ms']['compact']:.2f} | {r['ratio']:.3f} |",
              flush=True)


if __name__ == "__main__":
    main()
