"""KV transfer between two processes on one CUDA GPU (two CUDA contexts): over NCCL when
the two ends count as distinct devices (``NCCL_HOSTID`` differs: NCCL's network transport),
over gloo staged through pinned host memory when they are one device. Caches are laid out
as a worker's (block-major storage). Skipped without CUDA (marked ``cuda``).

This process is the decode side (``KVReceiver``); the prefill side (``KVSender``) runs in
a spawned child driven over a pipe.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import threading
import time

import pytest
import torch

from pdserve.kvtransfer import KVPollState, KVReceiver, KVSender, KVTransferError

KV_KEY = hashlib.sha256(b"pdserve test cluster: kv").digest()  # both processes

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

NUM_BLOCKS = 64
# [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]: 64 KiB blocks in bf16
STORAGE = (NUM_BLOCKS, 4, 2, 16, 2, 64)
DECODE_HOST_ID = "pdserve-test-decode"


def make_cuda_cache(seed: int | None) -> torch.Tensor:
    """``[num_layers, 2, NUM_BLOCKS, block_size, num_kv_heads, head_dim]`` bf16 on the GPU,
    the view of block-major storage (``ModelRunner.allocate_kv_cache``'s layout)."""
    if seed is None:
        storage = torch.zeros(STORAGE, dtype=torch.bfloat16, device="cuda")
    else:
        gen = torch.Generator().manual_seed(seed)
        storage = torch.randn(STORAGE, generator=gen).to(torch.bfloat16).cuda()
    return storage.permute(1, 2, 0, 3, 4, 5)


def _sender_main(conn, worker_id: str, host_id: str, stall_s: float) -> None:
    """Child: one KVSender on a seed-7 cache. A request whose id starts with
    "stall-gather" stalls ``stall_s`` while its payload is gathered (before its header
    goes); one starting with "stall-payload" stalls before the payload's NCCL send,
    after its header went."""
    os.environ["NCCL_HOSTID"] = host_id
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    import pdserve.kvtransfer.channel as channel_module
    import pdserve.kvtransfer.sender as sender_module

    original = sender_module.PayloadSource
    stall_payload = threading.Event()

    class StallingGather(original):
        def chunk(self, c: int) -> torch.Tensor:
            if c == 0:
                time.sleep(stall_s)
            return super().chunk(c)

    class StallingSends:
        """An NCCL group whose sends wait while ``stall_payload`` is set."""

        def __init__(self, group) -> None:
            self.group = group

        def send(self, tensors, peer, tag):
            if stall_payload.is_set():
                time.sleep(stall_s)
            return self.group.send(tensors, peer, tag)

        def __getattr__(self, name):
            return getattr(self.group, name)

    make_nccl = channel_module._make_nccl
    channel_module._make_nccl = lambda *args: StallingSends(make_nccl(*args))
    sender = KVSender(worker_id, make_cuda_cache(7),
                      kv_key=KV_KEY, timeout_s=20, connect_timeout_s=20)
    conn.send("ready")
    while (cmd := conn.recv()) is not None:
        rid, decode_id, address, block_ids, timeout_s = cmd
        sender_module.PayloadSource = (StallingGather if rid.startswith("stall-gather")
                                       else original)
        if rid.startswith("stall-payload"):
            stall_payload.set()
        else:
            stall_payload.clear()
        try:
            conn.send(("ok", sender.send(rid, decode_id, address, block_ids, timeout_s)))
        except KVTransferError as exc:
            conn.send(("error", str(exc)))
    sender.close()


class SenderProcess:
    def __init__(self, worker_id: str, host_id: str, stall_s: float = 0.0) -> None:
        self.worker_id = worker_id
        ctx = mp.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(target=_sender_main, daemon=True,
                                   args=(child_conn, worker_id, host_id, stall_s))
        self.process.start()
        assert self.conn.poll(120), "sender process did not start"
        assert self.conn.recv() == "ready"

    def send(self, rid: str, receiver: KVReceiver, block_ids: list[int], timeout_s: float):
        self.conn.send((rid, receiver.worker_id, receiver.address, block_ids, timeout_s))

    def reply(self, timeout_s: float = 60.0):
        assert self.conn.poll(timeout_s), "sender process did not answer"
        return self.conn.recv()

    def stop(self) -> None:
        try:
            self.conn.send(None)
            self.process.join(20)
        except OSError:
            pass
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)


@pytest.fixture(scope="module")
def receiver():
    os.environ["NCCL_HOSTID"] = DECODE_HOST_ID
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    made = KVReceiver("decode-cuda", make_cuda_cache(None), "127.0.0.1:0",
                      kv_key=KV_KEY, timeout_s=20,
                      connect_timeout_s=60)
    yield made
    made.close()
    os.environ.pop("NCCL_HOSTID", None)


def pull(proc: SenderProcess, receiver: KVReceiver, rid: str, src, dst, timeout_s=20.0):
    handle = receiver.init(rid, proc.worker_id, dst, timeout_s=timeout_s)
    proc.send(rid, receiver, src, timeout_s)
    handle.wait(timeout_s + 10)
    return handle, proc.reply()


CASES = [(list(range(8, 16)), list(range(40, 48))),  # consecutive -> consecutive: in place
         ([5, 2, 9, 33], [0, 7, 3, 60]),             # scattered -> scattered
         (list(range(20, 26)), [1, 50, 2, 51, 3, 52])]  # consecutive -> scattered


@pytest.mark.parametrize(("backend", "host_id"), [("nccl", "pdserve-test-prefill"),
                                                  ("gloo", DECODE_HOST_ID)])
def test_blocks_move_bit_exactly_between_two_processes_on_one_gpu(receiver, backend, host_id):
    source = make_cuda_cache(7)
    proc = SenderProcess(f"prefill-{backend}", host_id)
    try:
        for i, (src, dst) in enumerate(CASES):
            receiver.kv_cache.zero_()
            handle, reply = pull(proc, receiver, f"{backend}-{i}", src, dst)
            assert handle.poll() == KVPollState.SUCCESS, handle.failure_exception()
            assert reply[0] == "ok", reply
            assert handle.channel.group.device_payload == (backend == "nccl")
            assert torch.equal(receiver.kv_cache[:, :, dst], source[:, :, src]), (src, dst)
            untouched = [b for b in range(NUM_BLOCKS) if b not in dst]
            assert not receiver.kv_cache[:, :, untouched].any()
    finally:
        proc.stop()


def _kill_mid_transfer(receiver: KVReceiver, proc: SenderProcess, rid: str) -> None:
    """Start pulling ``rid`` (a stalling request), kill the sender once the pull is
    TRANSFERRING, and check that it fails within its deadline, freeing its slot."""
    handle = receiver.init(rid, proc.worker_id, [3], timeout_s=6.0)
    proc.send(rid, receiver, [4], 6.0)
    deadline = time.monotonic() + 10.0
    while handle.poll() != KVPollState.TRANSFERRING and time.monotonic() < deadline:
        time.sleep(0.01)
    assert handle.poll() == KVPollState.TRANSFERRING
    time.sleep(0.5)  # NOTE: "stall-payload": the header is in, the NCCL receive posted
    os.kill(proc.process.pid, 9)
    killed_at = time.monotonic()
    assert handle.wait(15.0) == KVPollState.FAILED
    assert time.monotonic() - killed_at < 8.0
    assert isinstance(handle.failure_exception(), KVTransferError)
    assert receiver.counters().num_in_flight == 0


def _pull_after_restart(receiver: KVReceiver, source: torch.Tensor, worker_id: str) -> None:
    restarted = SenderProcess(worker_id, "pdserve-test-prefill")
    try:
        handle, _ = pull(restarted, receiver, "after-restart", [8, 9], [10, 11])
        if handle.poll() == KVPollState.FAILED:  # NOTE: the first pull may meet the dead pair
            handle, _ = pull(restarted, receiver, "retry", [8, 9], [10, 11])
        assert handle.poll() == KVPollState.SUCCESS, handle.failure_exception()
        assert torch.equal(receiver.kv_cache[:, :, [10, 11]], source[:, :, [8, 9]])
    finally:
        restarted.stop()


@pytest.mark.parametrize("stall", ["stall-gather", "stall-payload"])
def test_a_killed_nccl_sender_fails_the_pull_in_time_and_a_restarted_one_works(receiver,
                                                                              stall):
    """The sender dies while it gathers its payload (before its header: no NCCL op is
    posted yet), or after its header with the receiver's NCCL receive posted: the pull
    fails within its deadline, this process lives on (no NCCL watchdog ends it, no abort
    blocks a transfer thread), and a restarted sender with the same id gets a fresh
    channel."""
    source = make_cuda_cache(7)
    worker_id = f"prefill-killed-{stall}"
    proc = SenderProcess(worker_id, "pdserve-test-prefill", stall_s=30.0)
    try:
        handle, _ = pull(proc, receiver, "warm", [1], [2])  # the channel is up
        assert handle.poll() == KVPollState.SUCCESS, handle.failure_exception()
        assert handle.channel.group.device_payload
        _kill_mid_transfer(receiver, proc, f"{stall}-1")
    finally:
        proc.stop()
    _pull_after_restart(receiver, source, worker_id)
