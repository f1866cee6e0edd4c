"""P3: a decode worker's TPOT while long prompts keep arriving, disaggregated against
colocated and against an idle decode worker, with the cores pinned per process.

Three clusters of plain processes (``plain_cluster.py``), one after another, each fresh:

- **idle**: a decode worker alone on the last CPU; only the steady decode streams;
- **colocated**: the same decode worker, no prefill worker: the router prefills the long
  prompts on it, between its decode steps;
- **disaggregated**: a prefill worker on CPU 0 as well; the router (``--disaggregation
  auto``) sees the two pinned apart and sends the long prompts to it; their KV moves to
  the decode worker, which only decodes them.

The router, Redis and this client run on CPU 0 in all three. Load for ``--duration``
seconds: ``--streams`` streaming requests with ``--stream-prompt-len``-token prompts
(below ``--local-prefill-threshold``, so prefilled on the decode worker in every shape)
each generating ``--stream-output-len`` tokens (``ignore_eos``), each restarted when it
ends; and long prompts of ``--long-prompt-len`` tokens with ``--long-output-len`` output
tokens arriving as a Poisson process at ``--long-rate`` per second. Prompts are random
token ids in [0, 2000) from a seeded generator, a new one per request (no prefix-cache
hits). Reports, for the streams: TPOT (``(e2e - TTFT) / (tokens - 1)``) mean, p50, p99, and
p99 ITL, all ms; for the long prompts: mean TTFT; and the ratios of p99 TPOT. Every wait has
a timeout.

    python benchmarks/interference.py --model /path/to/w1 [--duration 60] [--json p3.json]
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
from plain_cluster import PlainCluster, pin_self

REQUEST_TIMEOUT_S = 300.0


async def stream_one(client: httpx.AsyncClient, url: str, model: str, prompt: list[int],
                     max_tokens: int) -> dict:
    """One streamed completion; returns TTFT, TPOT (s) and the gaps between chunks."""
    # NOTE: special tokens are kept in the text, so every token streams a chunk with text
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0.0, "skip_special_tokens": False,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    times, tokens = [], 0
    async with client.stream("POST", f"{url}/v1/completions", json=body,
                             timeout=REQUEST_TIMEOUT_S) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                times.append(time.perf_counter())
    end = time.perf_counter()
    ttft = times[0] - start if times else float("nan")
    return {"ttft": ttft, "tpot": (end - start - ttft) / (tokens - 1) if tokens > 1 else None,
            "itl": list(np.diff(times)), "tokens": tokens}


async def drive(url: str, model: str, args, with_long: bool) -> dict:
    rng = random.Random(args.seed)
    deadline = time.monotonic() + args.duration
    streams, longs, errors = [], [], []

    def prompt(n: int) -> list[int]:
        return [rng.randrange(2000) for _ in range(n)]

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64)) as client:
        async def stream_loop():
            while time.monotonic() < deadline:
                try:
                    streams.append(await stream_one(client, url, model,
                                                    prompt(args.stream_prompt_len),
                                                    args.stream_output_len))
                except (httpx.HTTPError, ValueError) as exc:
                    errors.append(repr(exc))

        async def long_loop():
            pending = []
            while True:
                await asyncio.sleep(rng.expovariate(args.long_rate))
                if time.monotonic() >= deadline:
                    break
                pending.append(asyncio.ensure_future(stream_one(
                    client, url, model, prompt(args.long_prompt_len), args.long_output_len)))
            for result in await asyncio.gather(*pending, return_exceptions=True):
                (errors.append(repr(result)) if isinstance(result, BaseException)
                 else longs.append(result))

        jobs = [stream_loop() for _ in range(args.streams)]
        if with_long:
            jobs.append(long_loop())
        await asyncio.gather(*jobs)
    tpots = np.array([s["tpot"] for s in streams if s["tpot"] is not None]) * 1000
    itls = np.array([g for s in streams for g in s["itl"]]) * 1000
    return {"stream_requests": len(streams), "long_requests": len(longs), "errors": errors,
            "tpot_mean_ms": float(tpots.mean()), "tpot_p50_ms": float(np.percentile(tpots, 50)),
            "tpot_p99_ms": float(np.percentile(tpots, 99)),
            "itl_p99_ms": float(np.percentile(itls, 99)),
            "long_ttft_mean_ms": float(np.mean([r["ttft"] for r in longs]) * 1000)
            if longs else None}


def run_shape(shape: str, args, work: Path, cpus: list[int]) -> dict:
    """Run one cluster shape on ``cpus`` (this machine's, before the client pinned
    itself): prefill worker, router and client on the first, decode worker on the last."""
    first, last = {cpus[0]}, {cpus[-1]}
    worker_args = ["--dtype", "bfloat16", "--max-model-len", "2048"]
    with PlainCluster(args.model, work / shape, worker_args) as cluster:
        cluster.start_worker("decode", "decode", last)
        num_prefill = 0
        if shape == "disaggregated":
            cluster.start_worker("prefill", "prefill", first)
            num_prefill = 1
        url = cluster.start_router(first, ["--local-prefill-threshold",
                                           str(args.local_prefill_threshold),
                                           "--disaggregation", "auto"], num_prefill, 1)
        result = asyncio.run(drive(url, str(args.model), args, shape != "idle"))
        result["prefill_path"] = {r: cluster.metric("pdserve:prefill_path_total",
                                                    {"reason": r})
                                  for r in ("remote", "short_prompt", "shared_compute",
                                            "no_prefill_worker")}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--stream-prompt-len", type=int, default=32)
    parser.add_argument("--stream-output-len", type=int, default=256)
    parser.add_argument("--long-prompt-len", type=int, default=1024)
    parser.add_argument("--long-output-len", type=int, default=16)
    parser.add_argument("--long-rate", type=float, default=0.5, help="long prompts per s")
    parser.add_argument("--local-prefill-threshold", type=int, default=64)
    parser.add_argument("--shapes", nargs="+", default=["idle", "colocated", "disaggregated"],
                        choices=["idle", "colocated", "disaggregated"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        sys.exit("interference.py needs 2 CPUs: the decode worker gets one to itself")
    pin_self({cpus[0]})  # the client beside the router
    work = Path(tempfile.mkdtemp(prefix="pdserve-p3-"))
    results = {}
    for shape in args.shapes:
        results[shape] = run_shape(shape, args, work, cpus)
        r = results[shape]
        print(f"{shape:14s} TPOT mean {r['tpot_mean_ms']:.1f} p50 {r['tpot_p50_ms']:.1f} "
              f"p99 {r['tpot_p99_ms']:.1f} ms, ITL p99 {r['itl_p99_ms']:.1f} ms, "
              f"long TTFT {r['long_ttft_mean_ms'] or float('nan'):.0f} ms, "
              f"{r['stream_requests']} streams, {r['long_requests']} long, "
              f"{len(r['errors'])} errors, prefill path {r['prefill_path']}", flush=True)
    for a, b in (("disaggregated", "colocated"), ("disaggregated", "idle"),
                 ("colocated", "idle")):
        if a in results and b in results:
            print(f"p99 TPOT {a} / {b}: "
                  f"{results[a]['tpot_p99_ms'] / results[b]['tpot_p99_ms']:.2f}")
    if args.json:
        args.json.write_text(json.dumps({"machine": platform.platform(), "args": {
            k: str(v) for k, v in vars(args).items()}, "results": results}, indent=2))


if __name__ == "__main__":
    main()
