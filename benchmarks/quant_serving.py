"""W1-shaped served throughput with quantized weights against bf16, in one run: ``pdserve
serve`` in its default configuration on W1's model (``model_shapes.write_w1``: the ~125M
Llama with a 32000-id tokenizer, bf16), once per scheme (``bf16``, then ``--quantization int8``
and ``int4``), each started fresh, warmed up, and driven by ``benchmarks/serving.py`` with
W1's shape (32 prompts of ~256 tokens, 128 output tokens each, all at once, at most 32 in
flight), ``--rounds`` times alternating the schemes. Prints each scheme's best output
throughput and its ratio to bf16's.

    python benchmarks/quant_serving.py [--rounds 2] [--schemes bf16,int8] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
from pathlib import Path

import peers
import serving
from model_shapes import write_w1

from pdserve.entrypoints.redis_server import free_port


def serve_once(model: Path, scheme: str, work: Path) -> dict:
    port = free_port()
    quant = [] if scheme == "bf16" else ["--quantization", scheme]
    argv = ["pdserve", "serve", "--model", str(model), "--port", str(port), "--grpc-port", "0",
            "--dtype", "bfloat16", *quant]
    server = peers.Server(f"pdserve serve ({scheme})", argv, work / f"serve-{scheme}.log")
    try:
        url = f"http://127.0.0.1:{port}"
        server.wait_ready(f"{url}/health")
        args = serving.parse_args(["--base-url", url, "--num-prompts", "32", "--input-len",
                                   "256", "--output-len", "128", "--max-concurrency", "32"])
        return asyncio.run(serving.benchmark(args))
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=Path(os.environ.get(
        "PDSERVE_CACHE_DIR", Path(tempfile.gettempdir()) / "pdserve-bench")) / "w1-tokenizer")
    parser.add_argument("--schemes", default="bf16,int8,int4")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    model = write_w1(args.model_dir)
    work = Path(tempfile.mkdtemp(prefix="pdserve-quant-serving-"))
    schemes = args.schemes.split(",")
    runs: dict[str, list[float]] = {s: [] for s in schemes}
    for _ in range(args.rounds):
        for scheme in schemes:
            result = serve_once(model, scheme, work)
            if result["failed"]:
                raise SystemExit(f"{scheme}: {result['failed']} requests failed")
            runs[scheme].append(result["output_throughput"])
    base = max(runs["bf16"]) if "bf16" in runs else None
    for scheme, values in runs.items():
        line = f"{scheme:>5}: {max(values):7.1f} output tok/s (runs: " \
               f"{', '.join(f'{v:.1f}' for v in values)})"
        if base:
            line += f"  {max(values) / base:.2f}x bf16"
        print(line)
    if args.json:
        args.json.write_text(json.dumps(runs, indent=2))


if __name__ == "__main__":
    main()
