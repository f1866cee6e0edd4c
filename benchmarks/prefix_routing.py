"""P5: mean TTFT with prefix-aware routing against round-robin, on a shared-prefix
workload with 2 prefill workers.

For each policy (``--prefill-routing prefix-aware`` or ``round-robin``), a fresh cluster
of plain processes (``plain_cluster.py``) so every cache starts empty: prefill worker A
pinned to the first CPU, prefill worker B to the last, a decode worker and the router
unpinned, and ``--disaggregation always`` (all share this machine, where ``auto`` would
keep prompts on the decode worker). The policies alternate for ``--runs`` rounds.

Workload: ``--num-prefixes`` distinct prefixes of ``--prefix-len`` random token ids, each
followed by ``--requests-per-prefix`` distinct ``--suffix-len``-token suffixes; the
requests in a seeded shuffled order, arriving as a Poisson process at ``--request-rate``
per second with at most ``--max-concurrency`` in flight, each streaming ``--output-len``
tokens (greedy, ``ignore_eos``). Reports mean, p50 and p99 TTFT (ms), the prefill
workers' prefix-cache hit rate over the run (``vllm:prefix_cache_hits_total /
vllm:prefix_cache_queries_total`` at the router), and the ratio of mean TTFTs.

    python benchmarks/prefix_routing.py --model /path/to/w1 [--runs 2] [--json p5.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from interference import stream_one
from plain_cluster import PlainCluster


def workload(args) -> list[list[int]]:
    rng = random.Random(args.seed)
    prompts = []
    for _ in range(args.num_prefixes):
        prefix = [rng.randrange(2000) for _ in range(args.prefix_len)]
        prompts += [prefix + [rng.randrange(2000) for _ in range(args.suffix_len)]
                    for _ in range(args.requests_per_prefix)]
    rng.shuffle(prompts)
    return prompts


async def drive(url: str, model: str, prompts: list[list[int]], args) -> dict:
    rng = random.Random(args.seed + 1)
    limit = asyncio.Semaphore(args.max_concurrency)
    results, errors = [], []
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64)) as client:
        async def one(prompt):
            async with limit:
                try:
                    results.append(await stream_one(client, url, model, prompt,
                                                    args.output_len))
                except (httpx.HTTPError, ValueError) as exc:
                    errors.append(repr(exc))

        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.ensure_future(one(prompt)))
            await asyncio.sleep(rng.expovariate(args.request_rate))
        await asyncio.gather(*tasks)
    ttfts = np.array([r["ttft"] for r in results]) * 1000
    return {"requests": len(results), "errors": errors,
            "ttft_mean_ms": float(ttfts.mean()), "ttft_p50_ms": float(np.percentile(ttfts, 50)),
            "ttft_p99_ms": float(np.percentile(ttfts, 99))}


def run_policy(policy: str, args, work: Path, cpus: list[int]) -> dict:
    worker_args = ["--dtype", "bfloat16", "--max-model-len", "2048"]
    with PlainCluster(args.model, work, worker_args) as cluster:
        cluster.start_worker("prefill", "prefill-a", {cpus[0]})
        cluster.start_worker("prefill", "prefill-b", {cpus[-1]})
        cluster.start_worker("decode", "decode", set(cpus))
        url = cluster.start_router(set(cpus), ["--disaggregation", "always",
                                               "--prefill-routing", policy], 2, 1)
        start = time.perf_counter()
        result = asyncio.run(drive(url, str(args.model), workload(args), args))
        result["duration_s"] = time.perf_counter() - start
        queries = cluster.metric("vllm:prefix_cache_queries_total")
        result["prefix_hit_rate"] = cluster.metric("vllm:prefix_cache_hits_total") / queries \
            if queries else 0.0
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--num-prefixes", type=int, default=16)
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--suffix-len", type=int, default=32)
    parser.add_argument("--requests-per-prefix", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--request-rate", type=float, default=2.0, help="requests per s")
    parser.add_argument("--max-concurrency", type=int, default=8)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    work = Path(tempfile.mkdtemp(prefix="pdserve-p5-"))
    rounds = []
    for i in range(args.runs):
        rnd = {}
        for policy in ("round-robin", "prefix-aware"):
            rnd[policy] = r = run_policy(policy, args, work / f"{i}-{policy}", cpus)
            print(f"run {i + 1} {policy:13s} TTFT mean {r['ttft_mean_ms']:.0f} p50 "
                  f"{r['ttft_p50_ms']:.0f} p99 {r['ttft_p99_ms']:.0f} ms, prefix hit rate "
                  f"{r['prefix_hit_rate']:.2f}, {r['requests']} ok, {len(r['errors'])} "
                  f"errors, {r['duration_s']:.1f} s", flush=True)
        rnd["ttft_mean_prefix_aware_over_round_robin"] = \
            rnd["prefix-aware"]["ttft_mean_ms"] / rnd["round-robin"]["ttft_mean_ms"]
        print(f"run {i + 1} mean TTFT prefix-aware / round-robin: "
              f"{rnd['ttft_mean_prefix_aware_over_round_robin']:.2f}", flush=True)
        rounds.append(rnd)
    if args.json:
        args.json.write_text(json.dumps({"machine": platform.platform(), "args": {
            k: str(v) for k, v in vars(args).items()}, "runs": rounds}, indent=2))


if __name__ == "__main__":
    main()
