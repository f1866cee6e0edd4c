"""Router CPU per streamed token: what the router process spends on each token it streams.

Every CPU-second the router spends beside a CPU decode worker is taken from the engine, so
this measures CPU time (``time.process_time``), not wall time, in microseconds per token.
No engine runs: the tokens are the demo corpus encoded by the demo model's tokenizer
(``ensure_demo_model``), and the sections time the router's own work on them.

- ``detokenize``: ``IncrementalDetokenizer.add_tokens``, one token at a time.
- ``format``: a stream chunk's JSON event (``Formatter.stream_chunk`` and ``sse_event``) for
  completions and chat, without and with logprobs (5 alternatives).
- ``asgi``: the whole HTTP streaming path in this process: ``build_app``'s FastAPI app
  (its middlewares, ``_Merged``, ``_sse``, the SSE response) driven through ASGI by
  ``--streams`` concurrent ``stream=true`` completions. A stand-in for ``ModelService`` yields
  each stream's chunks from a real ``SequenceOutput`` (detokenizer and stop strings), one
  token per stream per decode step of ``--step-ms``, as a decode batch produces them;
  uvicorn, h11 and the socket are left out.
- ``uvicorn``: the same app served by uvicorn (h11) in a child process over loopback; the
  child's CPU time (``/proc``) per token received by a raw-socket client in this process.

    python benchmarks/router_stream.py                      # every section
    python benchmarks/router_stream.py --sections detokenize format --tokens 10000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from pdserve.engine.demo_model import ensure_demo_model, read_demo_corpus
from pdserve.engine.generation_config import GenerationDefaults
from pdserve.engine.request import Logprob
from pdserve.engine.tokenizer import load_tokenizer
from pdserve.router.config import RouterConfig
from pdserve.router.detokenizer import IncrementalDetokenizer
from pdserve.router.http import build_app
from pdserve.router.http_format import ChatFormatter, CompletionFormatter
from pdserve.router.model_service import ModelService
from pdserve.router.output import GenerationChunk, SequenceOutput
from pdserve.router.protocol import ChatCompletionRequest, CompletionRequest, sse_event

SECTIONS = ("detokenize", "format", "asgi", "uvicorn")


def corpus_token_ids(tokenizer, num_tokens: int) -> list[int]:
    """``num_tokens`` token ids of the demo corpus (repeated as needed)."""
    ids = tokenizer.encode(read_demo_corpus(), add_special_tokens=False)
    return (ids * (num_tokens // len(ids) + 1))[:num_tokens]


def cpu_us_per_token(work, num_tokens: int, repeats: int = 3) -> float:
    """Best of ``repeats`` runs of ``work()`` in CPU microseconds per token."""
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        work()
        best = min(best, time.process_time() - start)
    return best / num_tokens * 1e6


def bench_detokenize(tokenizer, token_ids: list[int]) -> dict[str, float]:
    def work():
        detok = IncrementalDetokenizer(tokenizer, token_ids[:8])
        for token_id in token_ids:
            detok.add_tokens([token_id])
    return {"detokenize": cpu_us_per_token(work, len(token_ids))}


def bench_format(tokenizer, token_ids: list[int]) -> dict[str, float]:
    router = SimpleNamespace(served_model_name="demo", tokenizer=tokenizer,
                             config=RouterConfig("demo", "redis://127.0.0.1:1"))
    texts = [tokenizer.decode([t]) for t in token_ids]
    top = True  # 5 alternatives: the corpus's next 5 tokens, as varied as a real model's
    cases = {
        "completion": (CompletionFormatter, CompletionRequest, {"prompt": "x"}, None),
        "completion+logprobs": (CompletionFormatter, CompletionRequest,
                                {"prompt": "x", "logprobs": 5}, top),
        "chat": (ChatFormatter, ChatCompletionRequest,
                 {"messages": [{"role": "user", "content": "x"}]}, None),
        "chat+logprobs": (ChatFormatter, ChatCompletionRequest,
                          {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                           "top_logprobs": 5}, top),
    }
    results = {}
    for name, (formatter_cls, request_cls, body, top_logprobs) in cases.items():
        request = request_cls.model_validate({**body, "stream": True})
        chunks = [GenerationChunk(text, [t], [] if top_logprobs is None else [Logprob(
            t, -1.0, 1, {a: -2.5 - j for j, a in enumerate(token_ids[i + 1:i + 6])})])
                  for i, (t, text) in enumerate(zip(token_ids, texts))]

        def work(formatter_cls=formatter_cls, request=request, chunks=chunks):
            args = (router, request, "cmpl-0", [[1, 2, 3]])
            formatter = formatter_cls(*args, None) if formatter_cls is CompletionFormatter \
                else formatter_cls(*args)
            for chunk in chunks:
                sse_event(formatter.stream_chunk(0, chunk))
        results[f"format {name}"] = cpu_us_per_token(work, len(chunks))
    return results


class StandInRouter:
    """What ``build_app`` needs of a ``ModelService``, with ``generate`` replaced by a decode
    batch's rhythm: every ``step_s`` each running stream gets its next corpus token, run
    through a real ``SequenceOutput`` as ``router/attempt.py`` does."""

    def __init__(self, tokenizer, token_ids: list[int], step_s: float) -> None:
        self.tokenizer = tokenizer
        self.token_ids = token_ids
        self.step_s = step_s
        self.vocab_size = len(tokenizer)
        self.served_model_name = "demo"
        self.served_model_names = ("demo",)
        self.generation_defaults = GenerationDefaults()
        self.max_model_len = 1 << 20
        self.config = RouterConfig("demo", "redis://127.0.0.1:1")  # the defaults

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def check_available(self, num_sequences: int) -> None:
        pass

    check_priority = ModelService.check_priority  # the router's own rule, on its config

    def validation_context(self) -> dict:
        return {"vocab_size": self.vocab_size}

    async def generate(self, request):
        output = SequenceOutput(self.tokenizer, request.prompt_token_ids, request.stop,
                                request.include_stop_str_in_output, request.skip_special_tokens)
        max_tokens = request.params.max_tokens
        offset = len(request.prompt_token_ids) * 7 % len(self.token_ids)
        loop = asyncio.get_running_loop()
        next_step = loop.time()
        for i in range(max_tokens):
            next_step += self.step_s
            await asyncio.sleep(max(0.0, next_step - loop.time()))
            token_id = self.token_ids[(offset + i) % len(self.token_ids)]
            yield output.add([token_id], [], "length" if i == max_tokens - 1 else "", None)


def request_body(stream_index: int, max_tokens: int) -> bytes:
    """A streamed completion whose prompt differs per stream (so each has its own text)."""
    return json.dumps({"prompt": [1 + stream_index % 50] * (1 + stream_index),
                       "max_tokens": max_tokens, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()


async def asgi_stream(app, body: bytes) -> int:
    """Drive one streamed request through ``app`` over ASGI; return the tokens received."""
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
             "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "root_path": "",
             "query_string": b"", "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000),
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())]}
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    done = asyncio.get_running_loop().create_future()
    received = bytearray()

    async def receive():
        if messages:
            return messages.pop()
        await done
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.body":
            received.extend(message.get("body", b""))
            if not message.get("more_body", False) and not done.done():
                done.set_result(None)

    await app(scope, receive, send)
    return count_tokens(bytes(received))


def count_tokens(sse: bytes) -> int:
    """Completion tokens of a stream, from its usage chunk."""
    match = _USAGE.search(sse)
    if match is None:
        raise ValueError(f"no usage chunk in the stream: {sse[-300:]!r}")
    return int(match[1])


_USAGE = re.compile(rb'"usage":\{"prompt_tokens":\d+,"completion_tokens":(\d+)')


def make_app(tokenizer, token_ids: list[int], step_ms: float):
    return build_app([StandInRouter(tokenizer, token_ids, step_ms / 1000)])


def bench_asgi(tokenizer, token_ids: list[int], args) -> dict[str, float]:
    app = make_app(tokenizer, token_ids, args.step_ms)

    async def run() -> int:
        bodies = [request_body(i, args.stream_tokens) for i in range(args.streams)]
        return sum(await asyncio.gather(*(asgi_stream(app, b) for b in bodies)))

    asyncio.run(asgi_stream(app, request_body(0, 4)))  # warm-up
    start = time.process_time()
    num_tokens = asyncio.run(run())
    return {"asgi": (time.process_time() - start) / num_tokens * 1e6}


def serve(args) -> None:
    """The ``uvicorn`` section's child: serve the app on ``args.serve`` (a port)."""
    import uvicorn
    tokenizer = load_tokenizer(ensure_demo_model())
    app = make_app(tokenizer, corpus_token_ids(tokenizer, args.tokens), args.step_ms)
    uvicorn.run(app, host="127.0.0.1", port=args.serve, http="h11", log_level="warning",
                access_log=False)


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds of process ``pid``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def http_stream(port: int, body: bytes) -> int:
    """POST ``body`` over a raw socket (a cheap client); return the tokens streamed."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
                 b"\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
    data = await reader.read()
    writer.close()
    return count_tokens(data)


def bench_uvicorn(args) -> dict[str, float]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    child = subprocess.Popen([sys.executable, __file__, "--serve", str(port), "--tokens",
                              str(args.tokens), "--step-ms", str(args.step_ms)])
    try:
        for _ in range(600):
            try:
                asyncio.run(http_stream(port, request_body(0, 4)))  # warm-up
                break
            except (OSError, ValueError):
                time.sleep(0.1)
        bodies = [request_body(i, args.stream_tokens) for i in range(args.streams)]

        async def run() -> int:
            return sum(await asyncio.gather(*(http_stream(port, b) for b in bodies)))

        start = cpu_seconds(child.pid)
        num_tokens = asyncio.run(run())
        return {"uvicorn": (cpu_seconds(child.pid) - start) / num_tokens * 1e6}
    finally:
        child.terminate()
        child.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--tokens", type=int, default=10_000, help="tokens per micro run")
    parser.add_argument("--streams", type=int, default=32, help="concurrent streams")
    parser.add_argument("--stream-tokens", type=int, default=128, help="tokens per stream")
    parser.add_argument("--step-ms", type=float, default=40.0,
                        help="decode step: one token per stream per step")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args)
        return
    tokenizer = load_tokenizer(ensure_demo_model())
    token_ids = corpus_token_ids(tokenizer, args.tokens)
    results = {}
    if "detokenize" in args.sections:
        results.update(bench_detokenize(tokenizer, token_ids))
    if "format" in args.sections:
        results.update(bench_format(tokenizer, token_ids))
    if "asgi" in args.sections:
        results.update(bench_asgi(tokenizer, token_ids, args))
    if "uvicorn" in args.sections:
        results.update(bench_uvicorn(args))
    for name, us in results.items():
        print(f"{name:28s} {us:8.2f} us/token")


if __name__ == "__main__":
    main()
