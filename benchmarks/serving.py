"""Serving benchmark: drives a running pdserve cluster through its OpenAI HTTP API.

Shaped like vLLM's ``benchmarks/benchmark_serving.py``, with the same metric names and
definitions (docs/architecture.md, Terms):

- TTFT: seconds from sending a request to the first streamed chunk of a token step (its
  text may be empty, as in vLLM's client: a token whose text is not out yet).
- TPOT: ``(e2e - TTFT) / (output_tokens - 1)``, the time per output token after the first;
  requests with a single output token have none.
- ITL: the gaps between successive streamed chunks with tokens, pooled over all requests.
- E2EL: seconds from sending a request to the end of its stream.
- goodput: requests per second that met every SLO given (``--slo-ttft-ms``,
  ``--slo-tpot-ms``); not computed when neither is given.

Requests arrive as a Poisson process at ``--request-rate`` per second (``inf``: all at once),
at most ``--max-concurrency`` in flight. Each streams (``stream_options.include_usage``), with
``ignore_eos`` and ``max_tokens = --output-len``, so every output has the asked length; output
and prompt token counts come from the final usage chunk.

Prompts are strings of ``--input-len`` random words drawn from a fixed list with a seeded
generator (``--seed``), the same text for both endpoints; the tokenizer decides their token
count, which the result reports as measured (``total_input_tokens``). A separate warm-up
request (other words) checks the setup first and is left out of the figures.

Every wait has a timeout (``--request-timeout`` per request; connect and per-chunk read limits
within it); a request that errors, times out, or streams no tokens counts as failed and its
error is reported. The run ends when every request has finished or failed.

    python benchmarks/serving.py --num-prompts 32 --input-len 64 --output-len 32 \\
        --request-rate 4 --max-concurrency 8 --slo-ttft-ms 2000 --slo-tpot-ms 200 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone

import httpx
import numpy as np

# Common short English words; most are one token in a byte-level BPE vocabulary.
_WORD_TEXT = (
    "the of and to in is was he for it with as his on be at by had are but from or have an "
    "they which one you were her all she there would their we him been has when who will more "
    "no if out so said what up its about into than them can only other new some could time "
    "these two may then do first any my now such like our over man me even most made after "
    "also did many before must through back years where much your way well down should because "
    "each just those people how too little state good very make world still own see men work "
    "long get here between both life being under never day same another know while last might "
    "us great old year off come since against go came right used take three"
)
WORDS = _WORD_TEXT.split()


# ---------------------------------------------------------------- requests and their results


@dataclass
class RequestInput:
    """One benchmark request: its prompt text and the number of output tokens to ask for."""

    prompt: str
    output_len: int


@dataclass
class RequestOutput:
    """What one request measured. Times are seconds; ``start_time`` is ``time.perf_counter``."""

    success: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    start_time: float = 0.0
    usage_missing: bool = False
    generated_text: str = ""
    error: str = ""


def make_prompts(num_prompts: int, input_len: int, output_len: int,
                 seed: int) -> list[RequestInput]:
    """``num_prompts`` prompts of ``input_len`` random words each (seeded by ``seed``)."""
    rng = random.Random(seed)
    return [RequestInput(" ".join(rng.choice(WORDS) for _ in range(input_len)), output_len)
            for _ in range(num_prompts)]


def arrival_intervals(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """Seconds to wait after each request before the next: exponential gaps with mean
    ``1 / request_rate`` (Poisson arrivals at ``request_rate`` requests per second), all 0
    when it is ``inf``."""
    if math.isinf(request_rate):
        return [0.0] * num_requests
    if request_rate <= 0:
        raise ValueError("request_rate must be positive")
    rng = random.Random(seed)
    return [rng.expovariate(request_rate) for _ in range(num_requests)]


def build_payload(endpoint: str, model: str, request: RequestInput) -> dict:
    """The JSON body of a streamed, greedy, ``ignore_eos`` request for ``endpoint``
    (``completions`` or ``chat``)."""
    body: dict = {
        "model": model,
        "max_tokens": request.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        body["prompt"] = request.prompt
    return body


def _chunk_text(endpoint: str, choice: dict) -> str | None:
    """A streamed choice's new text: ``""`` for a token step whose text is not out yet
    (an incomplete UTF-8 character, or a token that decodes to nothing), None for a chunk
    that carries no token step (a chat stream's role-only delta)."""
    if endpoint == "chat":
        return (choice.get("delta") or {}).get("content")
    return choice.get("text")


async def send_request(client: httpx.AsyncClient, url: str, endpoint: str, model: str,
                       request: RequestInput, timeout_s: float) -> RequestOutput:
    """Send one streamed request and time it; never raises. ``timeout_s`` bounds the whole
    request (seconds)."""
    out = RequestOutput(start_time=time.perf_counter())
    try:
        await asyncio.wait_for(_stream(client, url, endpoint, model, request, out), timeout_s)
    except asyncio.TimeoutError:
        out.success, out.error = False, f"timed out after {timeout_s:g} s"
    except Exception as exc:  # noqa: BLE001 - every failure is counted and reported
        out.success, out.error = False, f"{type(exc).__name__}: {exc}"
    return out


async def _stream(client: httpx.AsyncClient, url: str, endpoint: str, model: str,
                  request: RequestInput, out: RequestOutput) -> None:
    start = out.start_time
    last_token_time = None
    text_parts: list[str] = []
    content_chunks = 0
    done = False
    async with client.stream("POST", url, json=build_payload(endpoint, model, request)) as resp:
        if resp.status_code != 200:
            body = (await resp.aread()).decode(errors="replace")
            out.error = f"HTTP {resp.status_code}: {body[:300]}"
            return
        async for line in resp.aiter_lines():
            now = time.perf_counter()
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                out.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
                return
            choices = chunk.get("choices") or []
            text = _chunk_text(endpoint, choices[0]) if choices else None
            # NOTE: as vLLM's client, every chunk of a token step counts, its text empty
            # or not (random weights often give tokens that decode to nothing)
            if text is not None:
                if last_token_time is None:
                    out.ttft = now - start
                else:
                    out.itl.append(now - last_token_time)
                last_token_time = now
                content_chunks += 1
                text_parts.append(text)
            usage = chunk.get("usage")
            if usage:
                out.output_tokens = int(usage.get("completion_tokens") or 0)
                out.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    out.latency = time.perf_counter() - start
    out.generated_text = "".join(text_parts)
    if not done:
        out.error = "stream ended without [DONE]"
        return
    if last_token_time is None:
        out.error = "no tokens streamed"
        return
    if not out.output_tokens:
        # No usage chunk: fall back to one token per chunk, and say so in the result.
        out.usage_missing = True
        out.output_tokens = content_chunks
    out.success = True


# ---------------------------------------------------------------- metrics (pure functions)


def tpot_s(latency_s: float, ttft_s: float, output_tokens: int) -> float | None:
    """Time per output token after the first, in seconds: ``(latency - ttft) /
    (output_tokens - 1)``; ``None`` for fewer than 2 output tokens."""
    if output_tokens < 2:
        return None
    return (latency_s - ttft_s) / (output_tokens - 1)


def summarize_ms(values_s: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    """Mean, median, std and the given percentiles (linear interpolation, as numpy) of
    ``values_s`` (seconds), in milliseconds; keys ``mean``, ``median``, ``std``, ``p<P>``.
    All 0 for no values, as vLLM reports them."""
    arr = np.asarray(values_s, dtype=float) * 1000.0
    if arr.size == 0:
        arr = np.zeros(1)
    stats = {"mean": float(arr.mean()), "median": float(np.median(arr)),
             "std": float(arr.std())}
    for p in percentiles:
        stats[f"p{p:g}"] = float(np.percentile(arr, p))
    return stats


def meets_slos(out: RequestOutput, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    """Whether a successful request met every SLO given (milliseconds; ``None``: no SLO).
    A request with one output token has no TPOT and meets the TPOT SLO, as in vLLM."""
    if not out.success:
        return False
    if slo_ttft_ms is not None and out.ttft * 1000.0 > slo_ttft_ms:
        return False
    tpot = tpot_s(out.latency, out.ttft, out.output_tokens)
    return not (slo_tpot_ms is not None and tpot is not None and tpot * 1000.0 > slo_tpot_ms)


def calculate_metrics(outputs: Sequence[RequestOutput], duration_s: float,
                      slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None,
                      percentiles: Sequence[float] = (99,)) -> dict:
    """The run's metrics, with vLLM's names: counts, ``duration`` (s), throughputs
    (``request_throughput`` and ``request_goodput`` in requests/s, ``output_throughput`` and
    ``total_token_throughput`` in tokens/s) and ``{mean,median,std,p<P>}_{ttft,tpot,itl,e2el}_ms``
    over successful requests. ``request_goodput`` is ``None`` when no SLO is given."""
    ok = [o for o in outputs if o.success]
    tpots = [t for o in ok if (t := tpot_s(o.latency, o.ttft, o.output_tokens)) is not None]
    total_input = sum(o.prompt_tokens for o in ok)
    total_output = sum(o.output_tokens for o in ok)
    has_slo = slo_ttft_ms is not None or slo_tpot_ms is not None
    good = sum(meets_slos(o, slo_ttft_ms, slo_tpot_ms) for o in ok)
    metrics: dict = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(outputs) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration_s,
        "request_goodput": good / duration_s if has_slo else None,
        "good_requests": good if has_slo else None,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
    }
    series = {"ttft": [o.ttft for o in ok], "tpot": tpots,
              "itl": [g for o in ok for g in o.itl], "e2el": [o.latency for o in ok]}
    for name, values in series.items():
        for stat, value in summarize_ms(values, percentiles).items():
            metrics[f"{stat}_{name}_ms"] = value
    return metrics


# ---------------------------------------------------------------- the run


async def fetch_model(client: httpx.AsyncClient, base_url: str) -> str:
    """The first model id that ``GET /v1/models`` lists."""
    resp = await client.get(f"{base_url}/v1/models")
    resp.raise_for_status()
    models = resp.json().get("data") or []
    if not models:
        raise RuntimeError(f"{base_url}/v1/models lists no model")
    return models[0]["id"]


async def benchmark(args: argparse.Namespace) -> dict:
    """Run the benchmark that ``args`` describes; returns the result dict (also printed)."""
    base_url = args.base_url.rstrip("/")
    url = f"{base_url}/v1/" + ("chat/completions" if args.endpoint == "chat" else "completions")
    timeout = httpx.Timeout(args.request_timeout, connect=10.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    api_key = os.environ.get("OPENAI_API_KEY")  # as vLLM's benchmark client reads it
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers) as client:
        model = args.model or await asyncio.wait_for(fetch_model(client, base_url), 30.0)
        requests = make_prompts(args.num_prompts, args.input_len, args.output_len, args.seed)
        # Warm-up with other words, so no benchmark prompt is prefix-cached by it.
        warmup = make_prompts(1, args.input_len, args.output_len, args.seed + 1)[0]
        print("Starting initial single prompt test run...", flush=True)
        test = await send_request(client, url, args.endpoint, model, warmup,
                                  args.request_timeout)
        if not test.success:
            raise RuntimeError(f"test request failed: {test.error}")
        print("Initial test run completed. Starting main benchmark run...", flush=True)
        print(f"Traffic request rate: {args.request_rate}")
        print(f"Maximum request concurrency: {args.max_concurrency}", flush=True)

        semaphore = (asyncio.Semaphore(args.max_concurrency) if args.max_concurrency
                     else None)

        async def limited(request: RequestInput) -> RequestOutput:
            if semaphore is None:
                return await send_request(client, url, args.endpoint, model, request,
                                          args.request_timeout)
            async with semaphore:
                return await send_request(client, url, args.endpoint, model, request,
                                          args.request_timeout)

        intervals = arrival_intervals(len(requests), args.request_rate, args.seed)
        start = time.perf_counter()
        tasks = []
        for i, request in enumerate(requests):
            tasks.append(asyncio.create_task(limited(request)))
            if i + 1 < len(requests) and intervals[i]:
                await asyncio.sleep(intervals[i])  # the first request goes at once, as vLLM's
        outputs = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start

    percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    metrics = calculate_metrics(outputs, duration, args.slo_ttft_ms, args.slo_tpot_ms,
                                percentiles)
    print_table(metrics, percentiles, args)
    errors = [o.error for o in outputs if not o.success]
    result = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "base_url": base_url,
        "endpoint": args.endpoint,
        "model_id": model,
        "num_prompts": args.num_prompts,
        "input_len_words": args.input_len,
        "output_len": args.output_len,
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "max_concurrency": args.max_concurrency,
        "seed": args.seed,
        "slo_ttft_ms": args.slo_ttft_ms,
        "slo_tpot_ms": args.slo_tpot_ms,
        **metrics,
        "usage_missing": sum(o.usage_missing for o in outputs),
        "wrong_output_len": sum(o.success and o.output_tokens != args.output_len
                                for o in outputs),
        "input_lens": [o.prompt_tokens for o in outputs],
        "output_lens": [o.output_tokens for o in outputs],
        "ttfts": [o.ttft for o in outputs],
        "itls": [o.itl for o in outputs],
        "errors": errors,
        "machine": machine_info(),
    }
    print_problems(result, args.output_len)
    return result


def print_problems(result: dict, output_len: int) -> None:
    """Print to stderr what went wrong in a run's ``result``: the failed requests (the
    first five errors), streams without a usage chunk, and requests that did not produce
    ``output_len`` tokens. Prints nothing for a clean run."""
    errors = result["errors"]
    if errors:
        print(f"{len(errors)} failed requests; first errors:", file=sys.stderr)
        for error in errors[:5]:
            print(f"  {error}", file=sys.stderr)
    if result["usage_missing"]:
        print(f"warning: {result['usage_missing']} streams had no usage chunk", file=sys.stderr)
    if result["wrong_output_len"]:
        print(f"warning: {result['wrong_output_len']} requests did not produce "
              f"{output_len} tokens", file=sys.stderr)


def print_table(metrics: dict, percentiles: Sequence[float], args: argparse.Namespace) -> None:
    """Print the result table in vLLM's layout."""
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    row = "{:<40} {:<10}".format
    rowf = "{:<40} {:<10.2f}".format
    print(row("Successful requests:", metrics["completed"]))
    print(row("Failed requests:", metrics["failed"]))
    print(rowf("Benchmark duration (s):", metrics["duration"]))
    print(row("Total input tokens:", metrics["total_input_tokens"]))
    print(row("Total generated tokens:", metrics["total_output_tokens"]))
    print(rowf("Request throughput (req/s):", metrics["request_throughput"]))
    if metrics["request_goodput"] is not None:
        print(rowf("Request goodput (req/s):", metrics["request_goodput"]))
    print(rowf("Output token throughput (tok/s):", metrics["output_throughput"]))
    print(rowf("Total Token throughput (tok/s):", metrics["total_token_throughput"]))
    sections = (("ttft", "TTFT", "Time to First Token"),
                ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
                ("itl", "ITL", "Inter-token Latency"),
                ("e2el", "E2EL", "End-to-end Latency"))
    for key, short, title in sections:
        print("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        print(rowf(f"Mean {short} (ms):", metrics[f"mean_{key}_ms"]))
        print(rowf(f"Median {short} (ms):", metrics[f"median_{key}_ms"]))
        for p in percentiles:
            print(rowf(f"P{p:g} {short} (ms):", metrics[f"p{p:g}_{key}_ms"]))
    print("=" * 50, flush=True)


def machine_info() -> dict:
    """CPU model, core count, load average and Python/platform of the benchmarking host."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cpu_count": os.cpu_count(),
            "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
            "platform": platform.platform(), "python": platform.python_version()}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command-line flags (vLLM's names where it has one)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="the server; its API key, if it has one, from $OPENAI_API_KEY")
    p.add_argument("--model", default=None, help="default: the first id from /v1/models")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=64,
                   help="random words per prompt (the tokenizer sets the token count)")
    p.add_argument("--output-len", type=int, default=32, help="output tokens per request")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals; inf: all at once")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="most requests in flight (default: no limit)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="TTFT SLO for goodput (ms)")
    p.add_argument("--slo-tpot-ms", type=float, default=None, help="TPOT SLO for goodput (ms)")
    p.add_argument("--metric-percentiles", default="99",
                   help="comma-separated percentiles to report besides mean and median (p50)")
    p.add_argument("--request-timeout", type=float, default=300.0,
                   help="seconds one request may take in all")
    p.add_argument("--json", default=None, metavar="PATH", help="write the result here")
    args = p.parse_args(argv)
    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1:
        p.error("--num-prompts, --input-len and --output-len must be at least 1")
    if args.request_rate <= 0:
        p.error("--request-rate must be positive (inf: all at once)")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        p.error("--max-concurrency must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; 0 when every request succeeded, 1 otherwise."""
    args = parse_args(argv)
    try:
        result = asyncio.run(benchmark(args))
    except (RuntimeError, httpx.HTTPError, asyncio.TimeoutError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if result["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
