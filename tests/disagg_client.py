"""A minimal gRPC client of the two worker services, for the integration tests: what the
router does for one request (Prefill, then Decode with the KV handle)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass, field

import grpc

from pdserve.cluster.wire import sampling_params_to_proto
from pdserve.proto import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc


@dataclass
class Result:
    tokens: list[int]
    finish_reason: str
    num_cached_tokens_prefill: int
    num_cached_tokens_decode: int = 0
    num_transferred_blocks: int = 0
    num_transferred_bytes: int = 0
    logprobs: list = field(default_factory=list)


def prefill_stub(address: str) -> prefill_pb2_grpc.PrefillWorkerStub:
    return prefill_pb2_grpc.PrefillWorkerStub(grpc.aio.insecure_channel(address))


def decode_stub(address: str) -> decode_pb2_grpc.DecodeWorkerStub:
    return decode_pb2_grpc.DecodeWorkerStub(grpc.aio.insecure_channel(address))


async def health(stub) -> common_pb2.HealthResponse:
    return await stub.Health(common_pb2.HealthRequest(), timeout=10)


async def generate(prefill, decode, request_id: str, prompt: list[int], params,
                   timeout_s: float = 60) -> Result:
    wire_params = sampling_params_to_proto(params)
    first = await prefill.Prefill(prefill_pb2.PrefillRequest(
        request_id=request_id, prompt_token_ids=prompt, sampling_params=wire_params),
        timeout=timeout_s)
    result = Result([first.first_token_id], first.finish_reason, first.num_cached_tokens)
    if first.finish_reason:
        return result
    request = decode_pb2.DecodeRequest(
        request_id=request_id, prompt_token_ids=prompt, first_token_id=first.first_token_id,
        sampling_params=wire_params, kv_handle=first.kv_handle)
    async for message in decode.Decode(request, timeout=timeout_s):
        result.tokens += list(message.token_ids)
        result.num_cached_tokens_decode = max(result.num_cached_tokens_decode,
                                              message.num_cached_tokens)
        result.num_transferred_blocks += message.num_transferred_blocks
        result.num_transferred_bytes += message.num_transferred_bytes
        if message.finish_reason:
            result.finish_reason = message.finish_reason
    return result


def start_worker_process(role: str, args: list[str], ready_file, timeout_s: float = 120
                         ) -> tuple[subprocess.Popen, dict]:
    """``python -m pdserve.<role>_worker *args`` as a plain process; waits (``timeout_s``
    at most) for its ready file and returns the process and its addresses."""
    proc = subprocess.Popen([sys.executable, "-m", f"pdserve.{role}_worker", *args,
                             "--ready-file", str(ready_file)], stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout_s
    while not ready_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"{role} worker did not start (exit code {proc.poll()})")
        time.sleep(0.1)
    return proc, json.loads(ready_file.read_text())
