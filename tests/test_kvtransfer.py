"""KV transfer between two real processes over loopback gloo (DESIGN.md, KV transfer).

This process is the decode side (``KVReceiver``); prefill sides (``KVSender``) run in
spawned child processes driven over a pipe.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest
import torch

from pdserve.kvtransfer import KVPollState, KVReceiver, KVSender, KVTransferError

NUM_BLOCKS = 16
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def make_cache(dtype: torch.dtype, seed: int | None) -> torch.Tensor:
    """``[num_layers=2, 2, NUM_BLOCKS, block_size=4, num_kv_heads=2, head_dim=8]``:
    seeded random values, or zeros when ``seed`` is None."""
    shape = (2, 2, NUM_BLOCKS, 4, 2, 8)
    if seed is None:
        return torch.zeros(shape, dtype=dtype)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _prefill_main(conn, senders: dict[str, str], stall_s: float) -> None:
    """Child process: one KVSender per worker id (value: dtype name, cache seed 7).
    Requests whose id starts with "stall" send their header, then stall ``stall_s``."""
    import pdserve.kvtransfer.sender as sender_module

    torch.set_num_threads(1)
    original = sender_module.iter_send_planes

    def stalling(*args):
        time.sleep(stall_s)
        yield from original(*args)

    by_id = {wid: KVSender(wid, make_cache(DTYPES[name], 7), timeout_s=10, connect_timeout_s=10)
             for wid, name in senders.items()}
    conn.send("ready")
    while (cmd := conn.recv()) is not None:
        verb, wid, rid, decode_id, address, block_ids, timeout_s = cmd
        sender_module.iter_send_planes = stalling if rid.startswith("stall") else original
        try:
            if verb == "fail":
                conn.send(("ok", by_id[wid].send_failure(rid, decode_id, address, "lease expired")))
            else:
                conn.send(("ok", by_id[wid].send(rid, decode_id, address, block_ids, timeout_s)))
        except KVTransferError as exc:
            conn.send(("error", str(exc)))


class PrefillProcess:
    """A spawned prefill-side process hosting ``senders`` (worker id -> dtype name)."""

    def __init__(self, senders: dict[str, str], stall_s: float = 0.0) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(target=_prefill_main, args=(child_conn, senders, stall_s),
                                   daemon=True)
        self.process.start()
        assert self.conn.poll(60), "prefill process did not start"
        assert self.conn.recv() == "ready"

    def request(self, verb: str, worker_id: str, request_id: str, receiver: KVReceiver,
                block_ids: list[int], timeout_s: float = 10.0) -> None:
        self.conn.send((verb, worker_id, request_id, receiver.worker_id, receiver.address,
                        block_ids, timeout_s))

    def reply(self, timeout_s: float = 15.0):
        assert self.conn.poll(timeout_s), "prefill process did not answer"
        return self.conn.recv()

    def kill(self) -> None:
        self.process.kill()
        self.process.join(5)

    def stop(self) -> None:
        try:
            self.conn.send(None)
            self.process.join(10)
        except OSError:  # the process was killed
            pass
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)


@pytest.fixture(scope="module")
def receivers():
    """One decode-side receiver per dtype, each with a zeroed cache."""
    made = {name: KVReceiver(f"decode-{name}", make_cache(dtype, None), "127.0.0.1:0",
                             timeout_s=10, connect_timeout_s=10)
            for name, dtype in DTYPES.items()}
    yield made
    for receiver in made.values():
        receiver.close()


@pytest.fixture(scope="module")
def prefill():
    proc = PrefillProcess({"prefill-f32": "f32", "prefill-bf16": "bf16"})
    yield proc
    proc.stop()


def pull(proc: PrefillProcess, receiver: KVReceiver, prefill_id: str, request_id: str,
         src: list[int], dst: list[int], timeout_s: float = 10.0):
    """One whole transfer; returns (final pull, the prefill side's reply)."""
    handle = receiver.init(request_id, prefill_id, dst, timeout_s=timeout_s)
    proc.request("send", prefill_id, request_id, receiver, src, timeout_s)
    handle.wait(timeout_s + 5)
    return handle, proc.reply()


@pytest.mark.parametrize("name", ["f32", "bf16"])
def test_blocks_move_bit_exactly_into_other_block_ids(receivers, prefill, name):
    receiver, source = receivers[name], make_cache(DTYPES[name], 7)
    cases = [([5, 2, 9], [0, 7, 3]),     # scattered -> scattered (gather and scatter)
             ([4, 5, 6], [10, 11, 12]),  # consecutive -> consecutive (straight from/to cache)
             ([13, 14], [1, 8]),         # consecutive -> scattered
             ([0, 15], [14, 15])]        # scattered -> consecutive
    for i, (src, dst) in enumerate(cases):
        handle, reply = pull(prefill, receiver, f"prefill-{name}", f"exact-{name}-{i}", src, dst)
        assert handle.poll() == KVPollState.SUCCESS, handle.failure_exception()
        assert reply[0] == "ok" and reply[1].num_blocks == len(src)
        assert handle.stats.num_bytes == reply[1].num_bytes == len(src) * 2 * 2 * 4 * 2 * 8 * (
            4 if name == "f32" else 2)
        assert torch.equal(receiver.kv_cache[:, :, dst], source[:, :, src])
    written = sorted(b for _, dst in cases for b in dst)
    untouched = [b for b in range(NUM_BLOCKS) if b not in written]
    assert not receiver.kv_cache[:, :, untouched].any()


def test_transfers_in_sequence_reuse_one_channel(receivers, prefill):
    receiver = receivers["f32"]
    before = receiver.counters()
    generations = set()
    for i in range(5):
        handle, reply = pull(prefill, receiver, "prefill-f32", f"seq-{i}", [i, i + 1], [9, 2])
        assert handle.poll() == KVPollState.SUCCESS and reply[0] == "ok"
        generations.add(handle.channel.generation)
    assert len(generations) == 1
    after = receiver.counters()
    assert after.num_transfers - before.num_transfers == 5 and after.num_in_flight == 0
    assert after.num_bytes - before.num_bytes == 5 * 2 * 1024  # 1 KiB per fp32 block


def test_pulls_in_flight_together_are_matched_by_their_headers(receivers, prefill):
    receiver, source = receivers["f32"], make_cache(torch.float32, 7)
    plans = {f"together-{i}": ([i], [12 + i]) for i in range(4)}
    handles = {rid: receiver.init(rid, "prefill-f32", dst) for rid, (_, dst) in plans.items()}
    for rid in reversed(list(plans)):  # sent in the opposite order
        prefill.request("send", "prefill-f32", rid, receiver, plans[rid][0])
        assert prefill.reply()[0] == "ok"
    for rid, (src, dst) in plans.items():
        assert handles[rid].wait(5.0) == KVPollState.SUCCESS
        assert torch.equal(receiver.kv_cache[:, :, dst], source[:, :, src])


def test_pull_times_out_when_sender_never_sends_and_next_one_works(receivers, prefill):
    receiver = receivers["f32"]
    start = time.monotonic()
    lonely = receiver.init("never-sent", "prefill-f32", [4], timeout_s=1.0)
    assert lonely.wait(5.0) == KVPollState.FAILED
    assert 0.9 < time.monotonic() - start < 3.0
    assert isinstance(lonely.failure_exception(), KVTransferError)
    assert "did not start sending" in str(lonely.failure_exception())
    handle, reply = pull(prefill, receiver, "prefill-f32", "after-timeout", [3], [4])
    assert handle.poll() == KVPollState.SUCCESS and reply[0] == "ok"
    # NOTE: a pull given up before the sender started leaves the channel as it was
    assert handle.channel is lonely.channel


def test_sender_reported_failure_fails_the_pull_at_once(receivers, prefill):
    receiver = receivers["bf16"]
    start = time.monotonic()
    handle = receiver.init("expired", "prefill-bf16", [6], timeout_s=10.0)
    prefill.request("fail", "prefill-bf16", "expired", receiver, [6])
    assert handle.wait(5.0) == KVPollState.FAILED
    assert prefill.reply() == ("ok", True)
    assert time.monotonic() - start < 3.0
    assert "lease expired" in str(handle.failure_exception())


def test_a_cancelled_pull_never_writes_its_blocks(receivers, prefill):
    receiver = receivers["bf16"]
    before = receiver.kv_cache[:, :, [13]].clone()
    handle = receiver.init("cancelled", "prefill-bf16", [13], timeout_s=10.0)
    assert handle.cancel() == KVPollState.FAILED
    prefill.request("send", "prefill-bf16", "cancelled", receiver, [1], timeout_s=2.0)
    status, detail = prefill.reply()
    # the pull was given up (and maybe already forgotten) before the sender claimed it,
    # or the sender won and the payload was received and discarded
    assert status == "ok" or "gave up" in detail or "no pull" in detail
    assert torch.equal(receiver.kv_cache[:, :, [13]], before)
    handle, reply = pull(prefill, receiver, "prefill-bf16", "after-cancel", [2], [13])
    assert handle.poll() == KVPollState.SUCCESS and reply[0] == "ok"


def test_a_pull_cancelled_with_its_receives_posted_gets_nothing(receivers, prefill):
    """Over gloo a pull posts its receives (into its blocks) before the sender claims it.
    Cancelled then, it is given up: the late sender sends nothing, the blocks keep their
    contents, and the next pull on the same channel (a new tag) lands right."""
    receiver, source = receivers["bf16"], make_cache(torch.bfloat16, 7)
    handle, reply = pull(prefill, receiver, "prefill-bf16", "before-posted", [3], [12])
    assert handle.poll() == KVPollState.SUCCESS and reply[0] == "ok"  # the channel is up
    before = receiver.kv_cache[:, :, [12]].clone()
    handle = receiver.init("posted-then-cancelled", "prefill-bf16", [12], timeout_s=10.0)
    deadline = time.monotonic() + 5.0
    while handle._early is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert handle._early is not None and handle.poll() == KVPollState.WAITING_FOR_INPUT
    assert handle.cancel() == KVPollState.FAILED
    assert handle._early is None  # the posted receives were dropped
    prefill.request("send", "prefill-bf16", "posted-then-cancelled", receiver, [5],
                    timeout_s=2.0)
    status, detail = prefill.reply()
    assert status == "error" and ("gave up" in detail or "no pull" in detail), detail
    assert torch.equal(receiver.kv_cache[:, :, [12]], before)
    again, reply = pull(prefill, receiver, "prefill-bf16", "after-posted", [7], [12])
    assert again.poll() == KVPollState.SUCCESS and reply[0] == "ok"
    assert again.channel is handle.channel
    assert torch.equal(receiver.kv_cache[:, :, [12]], source[:, :, [7]])


def test_stalled_payload_times_out_then_killed_sender_fails_fast_then_restart_works(receivers):
    receiver, source = receivers["f32"], make_cache(torch.float32, 7)
    stalling = PrefillProcess({"prefill-stall": "f32"}, stall_s=4.0)
    try:
        # 1. header sent, payload stalls past the deadline: gloo times out, channel aborted
        start = time.monotonic()
        handle, reply = pull(stalling, receiver, "prefill-stall", "stall-1", [1], [5], 1.0)
        assert handle.poll() == KVPollState.FAILED and reply[0] == "error"
        assert time.monotonic() - start < 8.0
        first_generation = handle.channel.generation
        # 2. the next transfer on that pair makes a new group and works
        handle, reply = pull(stalling, receiver, "prefill-stall", "normal-1", [2], [5])
        assert handle.poll() == KVPollState.SUCCESS, handle.failure_exception()
        assert handle.channel.generation > first_generation
        # 3. the sender dies mid-transfer: the pull fails well within its timeout
        handle = receiver.init("stall-2", "prefill-stall", [6], timeout_s=8.0)
        stalling.request("send", "prefill-stall", "stall-2", receiver, [3], 8.0)
        deadline = time.monotonic() + 5.0
        while handle.poll() != KVPollState.TRANSFERRING and time.monotonic() < deadline:
            time.sleep(0.01)
        assert handle.poll() == KVPollState.TRANSFERRING
        assert receiver.counters().num_in_flight == 1  # the payload is moving (stalled)
        os.kill(stalling.process.pid, 9)
        killed_at = time.monotonic()
        assert handle.wait(8.0) == KVPollState.FAILED
        assert time.monotonic() - killed_at < 4.0
        assert receiver.counters().num_in_flight == 0
        assert isinstance(handle.failure_exception(), KVTransferError)
    finally:
        stalling.stop()
    # 4. a restarted prefill worker with the same id gets a fresh channel
    restarted = PrefillProcess({"prefill-stall": "f32"})
    try:
        handle, reply = pull(restarted, receiver, "prefill-stall", "after-restart", [8, 9], [6, 7])
        assert handle.poll() == KVPollState.SUCCESS, handle.failure_exception()
        assert torch.equal(receiver.kv_cache[:, :, [6, 7]], source[:, :, [8, 9]])
    finally:
        restarted.kill()
    # 5. one that died while idle: the decode side's group looks fine; the first pull
    # after the restart fails fast, and the next one makes a new channel
    again = PrefillProcess({"prefill-stall": "f32"})
    try:
        start = time.monotonic()
        handle, reply = pull(again, receiver, "prefill-stall", "after-idle-death", [4], [6])
        assert time.monotonic() - start < 3.0
        if handle.poll() == KVPollState.FAILED:
            assert "earlier sender" in str(handle.failure_exception())
            handle, reply = pull(again, receiver, "prefill-stall", "retry", [4], [6])
        assert handle.poll() == KVPollState.SUCCESS, handle.failure_exception()
        assert torch.equal(receiver.kv_cache[:, :, [6]], source[:, :, [4]])
    finally:
        again.stop()
