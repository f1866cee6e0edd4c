"""Serving on plain processes: a private Redis, one prefill and one decode worker and the
router, each its own process (``python -m pdserve.<role>``, no Ray: how a GPU machine
without Ray runs pdserve), driven by ``benchmarks/serving.py``.

The model is W1's (``model_shapes.write_w1``: the ~125M Llama of ``offline_throughput.py``
with a 32000-id tokenizer, bf16, random weights). Every prompt is prefilled by the prefill
worker and its KV pulled by the decode worker (``--disaggregation always``). On a GPU
both workers share GPU 0, each sized to ``--gpu-memory-utilization`` of it; their KV
moves over gloo through pinned host memory (one device: no NCCL). Prints serving.py's
table and how the router placed the prefills; ``--json`` writes both.

    python benchmarks/plain_serving.py --num-prompts 32 --input-len 256 --output-len 128
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
from pathlib import Path

import serving
import torch
from model_shapes import write_w1
from plain_cluster import PlainCluster, pin_self

from pdserve.router.routing_policy import PREFILL_PATH_REASONS


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=Path(os.environ.get(
        "PDSERVE_CACHE_DIR", Path(tempfile.gettempdir()) / "pdserve-bench")) / "w1-tokenizer")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.35,
                        help="each worker's share of the GPU (both share GPU 0)")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=256, help="words per prompt")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-concurrency", type=int, default=32)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir())
                        / "pdserve-plain-serving", help="logs of the processes")
    parser.add_argument("--json", type=Path)
    return parser.parse_args()


def split_cpus() -> tuple[set[int], set[int], set[int], set[int]]:
    """This machine's CPUs in four groups: prefill worker, decode worker, router, client
    (with fewer than four CPUs, groups share them)."""
    cpus = sorted(os.sched_getaffinity(0))
    quarter = max(1, len(cpus) // 4)
    groups = [set(cpus[i * quarter:(i + 1) * quarter]) or {cpus[-1]} for i in range(4)]
    return groups[0], groups[1], groups[2], groups[3] | set(cpus[4 * quarter:])


def main() -> None:
    args = parse_args()
    model = write_w1(args.model_dir)
    worker_args = ["--dtype", "bfloat16", "--max-model-len", "1024", "--device", args.device]
    if args.device.startswith("cuda"):
        worker_args += ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    prefill_cpus, decode_cpus, router_cpus, client_cpus = split_cpus()
    with PlainCluster(model, args.work, worker_args) as cluster:
        cluster.start_worker("prefill", "prefill", prefill_cpus)
        cluster.start_worker("decode", "decode", decode_cpus)
        url = cluster.start_router(router_cpus, ["--disaggregation", "always"], 1, 1)
        pin_self(client_cpus)
        bench_args = serving.parse_args([
            "--base-url", url, "--num-prompts", str(args.num_prompts),
            "--input-len", str(args.input_len), "--output-len", str(args.output_len),
            "--max-concurrency", str(args.max_concurrency)])
        result = asyncio.run(serving.benchmark(bench_args))
        result["prefill_path"] = {r: cluster.metric("pdserve:prefill_path_total", {"reason": r})
                                  for r in PREFILL_PATH_REASONS}
        result["device"] = (torch.cuda.get_device_name() if args.device.startswith("cuda")
                            else "cpu")
    print(f"prefills by path: {result['prefill_path']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    if result["failed"]:
        raise SystemExit(f"{result['failed']} requests failed")


if __name__ == "__main__":
    main()
