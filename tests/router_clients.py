"""Streaming clients of the router's APIs for the lifecycle tests: an SSE completion
over HTTP (httpx), and a gRPC ``Generate``, aborted part-way if asked."""

from __future__ import annotations

import json

import httpx

from pdserve.cluster.wire import sampling_params_to_proto
from pdserve.engine import SamplingParams
from pdserve.proto import router_pb2


async def sse(http: httpx.AsyncClient, body: dict, max_events: int | None = None
              ) -> tuple[int, dict[int, str], dict[int, str | None], dict | None]:
    """POST a streaming completion; read at most ``max_events`` chunks (then close the
    connection, as a client that leaves). Returns (status, text per choice, finish reason
    per choice, usage)."""
    texts: dict[int, str] = {}
    finishes: dict[int, str | None] = {}
    usage = None
    async with http.stream("POST", "/v1/completions", json=body) as reply:
        if reply.status_code != 200:
            await reply.aread()
            return reply.status_code, {}, {}, None
        events = 0
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
                finishes[choice["index"]] = choice["finish_reason"]
            events += 1
            if max_events is not None and events >= max_events:
                return 200, texts, finishes, usage  # leaving closes the stream mid-way
    return 200, texts, finishes, usage


async def grpc_generate(stub, request_id: str, prompt: list[int], params: SamplingParams,
                        abort_after: int | None = None) -> tuple[list[int], str, bool | None]:
    """Stream a generation through the router's gRPC API; with ``abort_after``, call
    ``Abort`` once that many messages came. Returns (token ids, finish reason, what
    ``Abort`` answered: None when not called)."""
    call = stub.Generate(router_pb2.GenerateRequest(
        request_id=request_id, token_ids=router_pb2.TokenIds(ids=prompt),
        sampling_params=sampling_params_to_proto(params)), timeout=120)
    tokens, finish, messages, aborted = [], "", 0, None
    async for message in call:
        tokens += list(message.token_ids)
        finish = message.finish_reason or finish
        messages += 1
        if messages == abort_after:
            reply = await stub.Abort(router_pb2.RouterAbortRequest(request_id=request_id),
                                     timeout=10)
            aborted = reply.aborted
    return tokens, finish, aborted


async def grpc_abort(stub, request_id: str, prompt: list[int], params: SamplingParams,
                     expected: list[int], abort_after: int) -> tuple[str, tuple | None]:
    """``grpc_generate`` with ``Abort`` ``abort_after`` messages in, ``expected`` its
    greedy tokens. Returns the outcome, "grpc_abort", or "grpc_abort_after_the_end" when
    the router had generated it all before the Abort came (the client lagging), and what
    was wrong with it: None, or (tokens, finish reason)."""
    tokens, finish, aborted = await grpc_generate(stub, request_id, prompt, params,
                                                  abort_after)
    if aborted:  # it stops where it was, on the greedy path so far
        ok = finish == "abort" and len(tokens) < params.max_tokens and \
            tokens == expected[:len(tokens)]
        return "grpc_abort", None if ok else (tokens, finish)
    ok = (tokens, finish) == (expected, "length")  # then it is whole
    return "grpc_abort_after_the_end", None if ok else (tokens, finish)
