"""Whole-history reuse across chat turns: ``--conversations`` concurrent 3-turn chats
against ``pdserve serve``, with prefix caching (reuse) on and then off
(``--no-enable-prefix-caching``), each on a fresh server.

Each conversation opens with ``--opening-words`` random words (seeded per conversation)
and then asks a short follow-up per turn; every turn streams ``--output-len`` tokens
(``temperature`` 0.8 with a per-conversation seed, ``ignore_eos``), and its reply goes
back into the history as the assistant's message, as chat clients do. The tokenizer's
special tokens are banned with ``logit_bias`` -100: random weights would otherwise write
turn markers inside a reply (a third of replies on the demo model), which no trained chat
model does and which no client sends back. Per turn it reports
mean and p50 TTFT (ms) and, from turn 2 on, the history coverage: the turn's
``usage.prompt_tokens_details.cached_tokens`` over the previous turn's prompt and reply
(prompt + completion tokens). The TTFT ratio is reuse off over reuse on.

    python benchmarks/chat_reuse.py [--model DIR] [--conversations 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import Server
from serving import WORDS, machine_info

from pdserve.entrypoints.redis_server import free_port

FOLLOW_UPS = ["And then what happened to the captain of the ship?",
              "Why did the crew decide to sail north after the storm?"]


async def turn(client: httpx.AsyncClient, url: str, model: str, messages: list[dict],
               seed: int, args) -> dict:
    """Stream one turn; its TTFT (s), reply text and usage."""
    start = time.perf_counter()
    ttft, text, usage = None, "", None
    async with client.stream("POST", f"{url}/v1/chat/completions", json={
            "model": model, "messages": messages, "max_tokens": args.output_len,
            "temperature": 0.8, "seed": seed, "ignore_eos": True, "stream": True,
            "logit_bias": args.logit_bias, "stream_options": {"include_usage": True}},
            timeout=args.request_timeout) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"HTTP {reply.status_code}: {(await reply.aread())[:300]!r}")
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", ()):
                piece = choice["delta"].get("content") or ""
                if piece and ttft is None:
                    ttft = time.perf_counter() - start
                text += piece
            usage = chunk.get("usage") or usage
    if ttft is None or usage is None:
        raise RuntimeError("no tokens or no usage in the stream")
    return {"ttft_s": ttft, "text": text, "usage": usage}


async def converse(client, url: str, model: str, index: int, args) -> list[dict]:
    rng = random.Random(args.seed + index)
    messages = [{"role": "user", "content": " ".join(
        rng.choice(WORDS) for _ in range(args.opening_words))}]
    turns, history = [], None
    for n in range(3):
        result = await turn(client, url, model, messages, args.seed * 1000 + index * 10 + n,
                            args)
        usage = result["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        turns.append({"ttft_s": result["ttft_s"], "prompt_tokens": usage["prompt_tokens"],
                      "cached_tokens": cached,
                      "coverage": None if history is None else min(cached / history, 1.0)})
        history = usage["prompt_tokens"] + usage["completion_tokens"]
        messages += [{"role": "assistant", "content": result["text"]},
                     {"role": "user", "content": FOLLOW_UPS[n % len(FOLLOW_UPS)]}]
    return turns


async def drive(url: str, model: str, args) -> list[list[dict]]:
    limits = httpx.Limits(max_connections=args.conversations + 4)
    async with httpx.AsyncClient(limits=limits) as client:
        return await asyncio.gather(*(converse(client, url, model, i, args)
                                      for i in range(args.conversations)))


def summarize(conversations: list[list[dict]]) -> list[dict]:
    rows = []
    for n in range(3):
        turns = [c[n] for c in conversations]
        ttft_ms = np.array([t["ttft_s"] * 1000 for t in turns])
        coverage = [t["coverage"] for t in turns if t["coverage"] is not None]
        rows.append({"turn": n + 1, "mean_ttft_ms": float(ttft_ms.mean()),
                     "p50_ttft_ms": float(np.median(ttft_ms)),
                     "mean_prompt_tokens": float(np.mean([t["prompt_tokens"] for t in turns])),
                     "mean_coverage": float(np.mean(coverage)) if coverage else None,
                     "min_coverage": float(np.min(coverage)) if coverage else None})
    return rows


def run(args, reuse: bool, work: Path) -> list[dict]:
    port = free_port()
    argv = ["pdserve", "serve", "--port", str(port), "--grpc-port", "0",
            *(["--model", args.model] if args.model else []), *args.pdserve_args.split()]
    if not reuse:
        argv.append("--no-enable-prefix-caching")
    server = Server("pdserve serve", argv, work / f"serve-{'on' if reuse else 'off'}.log")
    try:
        url = f"http://127.0.0.1:{port}"
        server.wait_ready(f"{url}/ready")
        card = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]
        model = card["id"]
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(card["root"])
        args.logit_bias = {str(i): -100 for i, t in tokenizer.added_tokens_decoder.items()
                           if t.special}
        return summarize(asyncio.run(drive(url, model, args)))
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint (default: the demo model)")
    parser.add_argument("--conversations", type=int, default=30)
    parser.add_argument("--opening-words", type=int, default=120)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--pdserve-args", default="", help="more `pdserve serve` flags")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pdserve-chat-") as tmp:
        result = {"machine": machine_info(), "args": vars(args),
                  "reuse_on": run(args, True, Path(tmp)),
                  "reuse_off": run(args, False, Path(tmp))}
    print(f"{'turn':>4} {'reuse':>5} {'prompt tok':>10} {'mean TTFT ms':>12} "
          f"{'p50 TTFT ms':>11} {'history coverage (mean, min)':>29}")
    for name in ("reuse_on", "reuse_off"):
        for row in result[name]:
            cov = "" if row["mean_coverage"] is None else \
                f"{row['mean_coverage']:.3f}, {row['min_coverage']:.3f}"
            print(f"{row['turn']:>4} {name[6:]:>5} {row['mean_prompt_tokens']:>10.0f} "
                  f"{row['mean_ttft_ms']:>12.0f} {row['p50_ttft_ms']:>11.0f} {cov:>29}")
    for on, off in zip(result["reuse_on"], result["reuse_off"], strict=True):
        print(f"turn {on['turn']}: mean TTFT reuse off / on = "
              f"{off['mean_ttft_ms'] / on['mean_ttft_ms']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
