"""Worker behaviour in one process (real gRPC, real gloo channels, real Redis): KV leases,
Release, failed pulls, local prefill, bad input."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import psutil
import pytest
from conftest import random_prompts
from disagg_client import (
    TEST_AUTH,
    TEST_SECRET,
    decode_stub,
    generate,
    health,
    lease_for,
    prefill_stub,
    start_worker_process,
)

from pdserve.cluster.auth import write_secret_file
from pdserve.cluster.wire import sampling_params_to_proto
from pdserve.cluster.worker_config import WorkerConfig
from pdserve.decode_worker.server import DecodeWorker
from pdserve.engine import LLM, EngineConfig, SamplingParams
from pdserve.entrypoints.redis_server import RedisServer, free_port
from pdserve.prefill_worker.server import PrefillWorker
from pdserve.proto import decode_pb2, prefill_pb2

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def redis_server():
    with RedisServer() as server:
        yield server


def run_with_workers(tiny_checkpoints, redis_server, body, lease_s: float = 30.0):
    """Start a prefill and a decode worker in this process, run ``body(p, d, workers)``."""
    engine = EngineConfig(str(tiny_checkpoints["qwen2"]), dtype="float32", max_model_len=256,
                          load_progress=False, num_gpu_blocks_override=64)

    async def main():
        prefill = PrefillWorker(WorkerConfig("prefill", engine, redis_url=redis_server.url,
                                             lease_s=lease_s, kv_transfer_timeout_s=5.0,
                                             auth=TEST_AUTH))
        decode = DecodeWorker(WorkerConfig("decode", dataclasses.replace(engine),
                                           redis_url=redis_server.url,
                                           kv_transfer_timeout_s=5.0, auth=TEST_AUTH))
        await prefill.start()
        await decode.start()
        try:
            return await body(prefill_stub(prefill.grpc_address),
                              decode_stub(decode.grpc_address), (prefill, decode))
        finally:
            await prefill.stop()
            await decode.stop()

    return asyncio.run(main())


def test_lease_expiry_unpins_blocks_of_a_never_pulled_prefill(tiny_checkpoints, redis_server):
    async def body(p, d, workers):
        reply = await p.Prefill(prefill_pb2.PrefillRequest(
            request_id="orphan", prompt_token_ids=random_prompts([70], 41)[0],
            sampling_params=sampling_params_to_proto(GREEDY), **await lease_for(d)), timeout=30)
        pinned = await health(p)
        await asyncio.sleep(2.0)  # lease is 1 s; the reaper runs every 0.5 s
        after = await health(p)
        return reply, pinned, after

    reply, pinned, after = run_with_workers(tiny_checkpoints, redis_server, body, lease_s=1.0)
    assert len(reply.kv_handle.block_hashes) == 4 and reply.kv_handle.num_tokens == 70
    assert pinned.num_free_blocks == pinned.num_total_blocks - 5
    assert after.num_free_blocks == after.num_total_blocks


def test_release_and_unknown_lease(tiny_checkpoints, redis_server):
    async def body(p, d, workers):
        await p.Prefill(prefill_pb2.PrefillRequest(
            request_id="r", prompt_token_ids=[1, 2, 3, 4, 5],
            sampling_params=sampling_params_to_proto(GREEDY), **await lease_for(d)), timeout=30)
        released = await p.Release(prefill_pb2.ReleaseRequest(request_id="r"), timeout=10)
        again = await p.Release(prefill_pb2.ReleaseRequest(request_id="r"), timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await p.SendKV(prefill_pb2.SendKVRequest(
                request_id="r", decode_worker_id="d", decode_kv_address=workers[1].kv_address,
                block_indices=[0]), timeout=10)
        return released.released, again.released, err.value.code(), await health(p)

    released, again, code, state = run_with_workers(tiny_checkpoints, redis_server, body)
    assert released and not again
    assert code == grpc.StatusCode.NOT_FOUND
    assert state.num_free_blocks == state.num_total_blocks


def test_failed_pull_fails_request_and_frees_blocks(tiny_checkpoints, redis_server):
    """A handle naming a prefill worker nobody knows: the pull fails fast, cleanly."""
    async def body(p, d, workers):
        first = await p.Prefill(prefill_pb2.PrefillRequest(
            request_id="x", prompt_token_ids=random_prompts([40], 42)[0],
            sampling_params=sampling_params_to_proto(GREEDY), **await lease_for(d)), timeout=30)
        handle = first.kv_handle
        handle.prefill_worker_id = "ghost"  # a prefill worker that is gone:
        handle.prefill_grpc_address = f"127.0.0.1:{free_port()}"  # nothing listens there
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in d.Decode(decode_pb2.DecodeRequest(
                    request_id="x", prompt_token_ids=random_prompts([40], 42)[0],
                    first_token_id=first.first_token_id,
                    sampling_params=sampling_params_to_proto(GREEDY), kv_handle=handle),
                    timeout=30):
                pass
        await p.Release(prefill_pb2.ReleaseRequest(request_id="x"), timeout=10)
        return err.value, await health(p), await health(d)

    error, p_state, d_state = run_with_workers(tiny_checkpoints, redis_server, body)
    # FAILED_PRECONDITION: the pull failed, this decode worker is fine (the router resumes
    # the request without that KV)
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "ghost" in error.details()
    assert p_state.num_free_blocks == p_state.num_total_blocks
    assert d_state.num_free_blocks == d_state.num_total_blocks


def test_local_prefill_and_bad_input(tiny_checkpoints, redis_server):
    prompt = random_prompts([9], 43)[0]

    async def body(p, d, workers):
        tokens = []
        async for message in d.Decode(decode_pb2.DecodeRequest(
                request_id="local", prompt_token_ids=prompt,
                sampling_params=sampling_params_to_proto(GREEDY)), timeout=30):
            tokens += list(message.token_ids)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await p.Prefill(prefill_pb2.PrefillRequest(
                request_id="bad", prompt_token_ids=[1] * 300,
                sampling_params=sampling_params_to_proto(GREEDY), **await lease_for(d)), timeout=10)
        bad_params = sampling_params_to_proto(GREEDY)
        bad_params.top_p = 3.0
        with pytest.raises(grpc.aio.AioRpcError) as err2:
            await p.Prefill(prefill_pb2.PrefillRequest(
                request_id="bad2", prompt_token_ids=[1, 2], sampling_params=bad_params, **await lease_for(d)),
                timeout=10)
        ok = await generate(p, d, "still-serving", prompt, GREEDY)
        return tokens, err.value, err2.value, ok

    tokens, err, err2, ok = run_with_workers(tiny_checkpoints, redis_server, body)
    expected = LLM(str(tiny_checkpoints["qwen2"]), dtype="float32", max_model_len=256,
                   load_progress=False).generate([prompt], GREEDY)[0].outputs[0].token_ids
    assert tokens == expected and ok.tokens == expected
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "256" in err.details()
    assert err2.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in err2.details()


def test_plain_process_workers_find_each_other_through_redis(tiny_checkpoints, redis_server,
                                                            tmp_path):
    """``python -m pdserve.prefill_worker`` and ``... decode_worker`` as subprocesses: the
    cluster secret comes from a file for one and from the environment for the other, the
    Redis password from a file (the URL has none), so no secret is on a command line."""
    secret_file = write_secret_file(tmp_path / "cluster-secret", TEST_SECRET.encode())
    password_file = write_secret_file(tmp_path / "redis-password",
                                      redis_server.password.encode())
    plain_url = f"redis://{redis_server.host}:{redis_server.port}/0"
    procs, infos = [], []
    try:
        for role, secret_file_args in (
                ("prefill", ["--cluster-secret-file", str(secret_file)]), ("decode", [])):
            proc, info = start_worker_process(role, [
                "--model", str(tiny_checkpoints["qwen2"]), "--dtype", "float32",
                "--max-model-len", "256", "--redis-url", plain_url, "--redis-password-file",
                str(password_file), "--num-threads", "1", "--log-level", "WARNING",
                *secret_file_args], tmp_path / f"{role}.json", timeout_s=60,
                secret_in_env=not secret_file_args)
            procs.append(proc)
            infos.append(info)
            command_line = " ".join(psutil.Process(proc.pid).cmdline())
            assert TEST_SECRET not in command_line
            assert redis_server.password not in command_line
        prompt = random_prompts([33], 44)[0]

        async def main():
            return await generate(prefill_stub(infos[0]["grpc_address"]),
                                  decode_stub(infos[1]["grpc_address"]), "plain", prompt, GREEDY)

        result = asyncio.run(main())
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)
    expected = LLM(str(tiny_checkpoints["qwen2"]), dtype="float32", max_model_len=256,
                   load_progress=False).generate([prompt], GREEDY)[0].outputs[0].token_ids
    assert result.tokens == expected and result.num_transferred_blocks == 3
    assert all(proc.returncode == 0 for proc in procs)  # SIGTERM stops them cleanly


def test_abort_while_waiting_for_kv_frees_blocks_at_once(tiny_checkpoints, redis_server):
    """The prefill worker named in the handle hangs (a socket that accepts and never
    answers), so the pull waits; an Abort ends it at once."""
    import socket
    import time

    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen()
    prompt = random_prompts([40], 45)[0]

    async def body(p, d, workers):
        first = await p.Prefill(prefill_pb2.PrefillRequest(
            request_id="w", prompt_token_ids=prompt,
            sampling_params=sampling_params_to_proto(GREEDY), **await lease_for(d)), timeout=30)
        handle = first.kv_handle
        handle.prefill_worker_id = "hung-prefill"
        handle.prefill_grpc_address = f"127.0.0.1:{hung.getsockname()[1]}"
        stream = d.Decode(decode_pb2.DecodeRequest(
            request_id="w", prompt_token_ids=prompt, first_token_id=first.first_token_id,
            sampling_params=sampling_params_to_proto(GREEDY), kv_handle=handle), timeout=30)
        reader = asyncio.ensure_future(stream.read())
        await asyncio.sleep(0.5)
        waiting = await health(d)
        started = time.monotonic()
        aborted = await d.Abort(decode_pb2.AbortRequest(request_id="w"), timeout=10)
        message = await asyncio.wait_for(reader, 10)
        elapsed = time.monotonic() - started
        await p.Release(prefill_pb2.ReleaseRequest(request_id="w"), timeout=10)
        return waiting, aborted.aborted, message, elapsed, await health(d), await health(p)

    try:
        waiting, aborted, message, elapsed, d_state, p_state = run_with_workers(
            tiny_checkpoints, redis_server, body)
    finally:
        hung.close()
    assert waiting.num_free_blocks == waiting.num_total_blocks - 3  # held while pulling
    assert aborted and message.finish_reason == "abort"
    assert elapsed < 4.0  # well before the 5 s transfer timeout
    assert d_state.num_free_blocks == d_state.num_total_blocks
    assert p_state.num_free_blocks == p_state.num_total_blocks


def test_mismatched_kv_handle_is_refused_and_nothing_leaks(tiny_checkpoints, redis_server):
    prompt = random_prompts([30], 46)[0]

    async def body(p, d, workers):
        first = await p.Prefill(prefill_pb2.PrefillRequest(
            request_id="m", prompt_token_ids=prompt,
            sampling_params=sampling_params_to_proto(GREEDY), **await lease_for(d)), timeout=30)
        errors = []
        for prompt_ids, token in ((prompt[:-1], first.first_token_id), (prompt, 10**6)):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in d.Decode(decode_pb2.DecodeRequest(
                        request_id="m", prompt_token_ids=prompt_ids, first_token_id=token,
                        sampling_params=sampling_params_to_proto(GREEDY),
                        kv_handle=first.kv_handle), timeout=30):
                    pass
            errors.append(err.value)
        ok = await generate(p, d, "after-bad", prompt, GREEDY)
        await p.Release(prefill_pb2.ReleaseRequest(request_id="m"), timeout=10)
        return errors, ok, await health(p), await health(d)

    errors, ok, p_state, d_state = run_with_workers(tiny_checkpoints, redis_server, body)
    assert [e.code() for e in errors] == [grpc.StatusCode.INVALID_ARGUMENT] * 2
    assert "29 tokens" in errors[0].details() and "first_token_id" in errors[1].details()
    assert len(ok.tokens) == GREEDY.max_tokens
    assert p_state.num_free_blocks == p_state.num_total_blocks
    assert d_state.num_free_blocks == d_state.num_total_blocks


def test_ready_file_appears_whole(tmp_path):
    """A launcher polls for the ready file and reads it at once: a reader polling while it
    is written (and rewritten) never sees it empty or half-written, and no partial file
    is left behind. (An ``open(path, "w")`` then a write fails this: the reader catches
    the truncated file.)"""
    import json
    import threading

    from pdserve.entrypoints.worker_main import write_ready_file

    path = tmp_path / "decode.ready.json"
    infos = [{"worker_id": f"decode-{i}", "pad": "x" * 200_000} for i in range(40)]
    torn: list[str] = []
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            try:
                text = path.read_text()
            except FileNotFoundError:
                continue
            try:
                json.loads(text)
            except ValueError:
                torn.append(text[:40])

    reader = threading.Thread(target=poll, daemon=True)
    reader.start()
    try:
        for info in infos:
            write_ready_file(path, info)
    finally:
        done.set()
        reader.join(10)
    assert not torn, f"{len(torn)} reads saw a partial file: {torn[:3]}"
    assert json.loads(path.read_text()) == infos[-1]
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
