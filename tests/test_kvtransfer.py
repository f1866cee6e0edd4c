"""KV transfer between two real processes over loopback, on the pair socket
(docs/architecture.md, KV transfer).

This process is the decode side (``KVReceiver``); prefill sides (``KVSender``) run in
spawned child processes driven over a pipe.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import time

import pytest
import torch

from pdserve.kvtransfer import KVPollState, KVReceiver, KVSender, KVTransferError, payload
from pdserve.kvtransfer.staging import size_class

KV_KEY = hashlib.sha256(b"pdserve test cluster: kv").digest()  # both processes

NUM_BLOCKS = 16
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
CHUNK_BYTES = 3 * 1024
"""Messages of 3 KiB (3 fp32 or 6 bf16 blocks of these caches), on both sides, so that
payloads here span several chunks and reuse the ring slots (the default, 2 MiB, would
move them in one)."""
SENDERS = {"prefill-f32": ("f32", "layer"), "prefill-bf16": ("bf16", "block"),
           "prefill-f32-block": ("f32", "block")}
PREFILL_IN_PLACE = {"prefill-in-place": ("f32", "block")}  # never stages, so its pool stays empty
"""Prefill worker id -> (dtype, layout of its cache); the receivers' layouts are the other
way round (``receivers``), so each direction has a staged side and an in-place side."""


def make_cache(dtype: torch.dtype, seed: int | None, layout: str = "layer") -> torch.Tensor:
    """``[num_layers=2, 2, NUM_BLOCKS, block_size=4, num_kv_heads=2, head_dim=8]``:
    seeded random values, or zeros when ``seed`` is None. ``layout``: "layer"
    (contiguous) or "block" (the view of block-major storage, as ``ModelRunner``'s)."""
    shape = (2, 2, NUM_BLOCKS, 4, 2, 8)
    if seed is None:
        cache = torch.zeros(shape, dtype=dtype)
    else:
        cache = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    if layout == "block":
        cache = cache.permute(2, 0, 1, 3, 4, 5).contiguous().permute(1, 2, 0, 3, 4, 5)
    return cache


@pytest.fixture(scope="module", autouse=True)
def small_chunks():
    original, payload.CHUNK_BYTES = payload.CHUNK_BYTES, CHUNK_BYTES
    yield
    payload.CHUNK_BYTES = original


def _prefill_main(conn, senders: dict[str, tuple[str, str]], stall_s: float) -> None:
    """Child process: one KVSender per worker id (value: dtype name and layout, cache
    seed 7). Requests whose id starts with "stall" send their header, then stall
    ``stall_s`` before the payload."""
    import pdserve.kvtransfer.sender as sender_module

    torch.set_num_threads(1)
    payload.CHUNK_BYTES = CHUNK_BYTES
    original = sender_module.PayloadSource

    class Stalling(original):
        def chunk(self, c: int) -> torch.Tensor:
            if c == 0:
                time.sleep(stall_s)
            return super().chunk(c)

    by_id = {wid: KVSender(wid, make_cache(DTYPES[name], 7, layout), kv_key=KV_KEY, timeout_s=10,
                           connect_timeout_s=10)
             for wid, (name, layout) in senders.items()}
    conn.send("ready")
    while (cmd := conn.recv()) is not None:
        verb, wid, rid, decode_id, address, block_ids, timeout_s = cmd
        sender_module.PayloadSource = Stalling if rid.startswith("stall") else original
        try:
            if verb == "staging":
                pool = by_id[wid].staging
                conn.send(("ok", (pool.held_bytes, pool.in_use_bytes, pool.num_free)))
            elif verb == "fail":
                conn.send(("ok", by_id[wid].send_failure(rid, decode_id, address, "lease expired")))
            else:
                conn.send(("ok", by_id[wid].send(rid, decode_id, address, block_ids, timeout_s)))
        except KVTransferError as exc:
            conn.send(("error", str(exc)))


class PrefillProcess:
    """A spawned prefill-side process hosting ``senders`` (worker id -> (dtype name,
    layout))."""

    def __init__(self, senders: dict[str, tuple[str, str]], stall_s: float = 0.0) -> None:
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
    """One decode-side receiver per dtype, each with a zeroed cache: fp32 block-major,
    bf16 layer-major."""
    layouts = {"f32": "block", "bf16": "layer"}
    made = {name: KVReceiver(f"decode-{name}", make_cache(dtype, None, layouts[name]),
                             "127.0.0.1:0",
                             kv_key=KV_KEY, timeout_s=10, connect_timeout_s=10)
            for name, dtype in DTYPES.items()}
    yield made
    for receiver in made.values():
        receiver.close()


@pytest.fixture(scope="module")
def prefill():
    proc = PrefillProcess({**SENDERS, **PREFILL_IN_PLACE})
    yield proc
    proc.stop()


def pull(proc: PrefillProcess, receiver: KVReceiver, prefill_id: str, request_id: str,
         src: list[int], dst: list[int], timeout_s: float = 10.0):
    """One whole transfer; returns (final pull, the prefill side's reply)."""
    handle = receiver.init(request_id, prefill_id, dst, timeout_s=timeout_s)
    proc.request("send", prefill_id, request_id, receiver, src, timeout_s)
    handle.wait(timeout_s + 5)
    return handle, proc.reply()


def sender_staging(proc: PrefillProcess, prefill_id: str,
                   receiver: KVReceiver) -> tuple[int, int, int]:
    """The prefill side's staging pool: (held bytes, bytes in use, free buffers)."""
    proc.request("staging", prefill_id, "", receiver, [], 0.0)
    status, value = proc.reply()
    assert status == "ok", value
    return value


@pytest.mark.parametrize("sender", list(SENDERS))
def test_blocks_move_bit_exactly_into_other_block_ids(receivers, prefill, sender):
    """Every mix of in-place and staged chunks on either side, across several chunks."""
    name, layout = SENDERS[sender]
    receiver, source = receivers[name], make_cache(DTYPES[name], 7, layout)
    receiver.kv_cache.zero_()
    per_chunk = CHUNK_BYTES // receiver.geometry.block_bytes
    cases = [([5, 2, 9], [0, 7, 3]),     # scattered -> scattered (gather and scatter)
             ([4, 5, 6], [10, 11, 12]),  # consecutive -> consecutive
             ([13, 14], [1, 8]),         # consecutive -> scattered
             ([0, 15], [14, 15]),        # scattered -> consecutive
             # several chunks, some consecutive on one side or both, ring slots reused
             (list(range(2, 2 + 2 * per_chunk)) + [15, 0, 1],
              list(range(NUM_BLOCKS - 1, NUM_BLOCKS - 4 - 2 * per_chunk, -1))),
             (list(range(NUM_BLOCKS)), list(range(NUM_BLOCKS))),
             (list(range(NUM_BLOCKS))[::-1], list(range(NUM_BLOCKS)))]
    for i, (src, dst) in enumerate(cases):
        receiver.kv_cache.zero_()
        handle, reply = pull(prefill, receiver, sender, f"exact-{sender}-{i}", src, dst)
        assert handle.poll() == KVPollState.SUCCESS, handle.failure_exception()
        assert reply[0] == "ok" and reply[1].num_blocks == len(src)
        assert handle.stats.num_bytes == reply[1].num_bytes == len(src) * 2 * 2 * 4 * 2 * 8 * (
            4 if name == "f32" else 2)
        assert torch.equal(receiver.kv_cache[:, :, dst], source[:, :, src]), (src, dst)
        untouched = [b for b in range(NUM_BLOCKS) if b not in dst]
        assert not receiver.kv_cache[:, :, untouched].any()
    assert receiver.staging.in_use_bytes == 0


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
    while handle.early_receives is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert handle.early_receives is not None and handle.poll() == KVPollState.WAITING_FOR_INPUT
    assert handle.cancel() == KVPollState.FAILED
    assert handle.early_receives is None  # the posted receives were dropped
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
    stalling = PrefillProcess({"prefill-stall": ("f32", "layer")}, stall_s=4.0)
    try:
        # 1. header sent, payload stalls past the deadline: gloo times out, channel aborted;
        # the sender staged the payload (a layer-major cache) and dropped its ring
        start = time.monotonic()
        handle, reply = pull(stalling, receiver, "prefill-stall", "stall-1", [1, 0], [5, 2], 1.0)
        assert handle.poll() == KVPollState.FAILED and reply[0] == "error"
        assert time.monotonic() - start < 8.0
        assert sender_staging(stalling, "prefill-stall", receiver) == (0, 0, 0)
        assert receiver.staging.in_use_bytes == 0
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
    restarted = PrefillProcess({"prefill-stall": ("f32", "layer")})
    try:
        handle, reply = pull(restarted, receiver, "prefill-stall", "after-restart", [8, 9], [6, 7])
        assert handle.poll() == KVPollState.SUCCESS, handle.failure_exception()
        assert torch.equal(receiver.kv_cache[:, :, [6, 7]], source[:, :, [8, 9]])
    finally:
        restarted.kill()
    # 5. one that died while idle: the decode side's group looks fine; the first pull
    # after the restart fails fast, and the next one makes a new channel
    again = PrefillProcess({"prefill-stall": ("f32", "layer")})
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


def test_scattered_pulls_reuse_one_staging_buffer_on_each_side(receivers, prefill):
    """A layer-major receiver cuts fixed chunks, so neither side moves [6, 1, 11] -> [8, 3,
    14] in place: both stage it, in a ring taken from and given back to their pools."""
    receiver, source = receivers["bf16"], make_cache(torch.bfloat16, 7)
    held = []
    for i in range(3):
        handle, reply = pull(prefill, receiver, "prefill-bf16", f"staged-{i}", [6, 1, 11],
                             [8, 3, 14])
        assert handle.poll() == KVPollState.SUCCESS and reply[0] == "ok"
        assert torch.equal(receiver.kv_cache[:, :, [8, 3, 14]], source[:, :, [6, 1, 11]])
        assert receiver.staging.in_use_bytes == 0
        sent = sender_staging(prefill, "prefill-bf16", receiver)
        assert sent[1] == 0 and sent[2] >= 1 and sent[0] >= size_class(3 * 512)
        held.append((receiver.staging.held_bytes, sent[0]))
    assert held[0][0] >= size_class(3 * 512)
    assert held[1] == held[2] == held[0]  # nothing allocated after the first pull


def test_block_major_caches_move_scattered_blocks_in_place(receivers, prefill):
    """Both caches block-major: the receiver cuts at every break in its ids, so every
    message is one run on both sides and nothing is staged, however scattered."""
    receiver, source = receivers["f32"], make_cache(torch.float32, 7)
    src, dst = [9, 3, 4, 5, 6, 14, 15, 7], [2, 11, 6, 7, 8, 1, 0, 13]
    handle, reply = pull(prefill, receiver, "prefill-in-place", "in-place", src, dst)
    assert handle.poll() == KVPollState.SUCCESS and reply[0] == "ok"
    assert handle.ticket.chunks == (1, 1, 3, 1, 1, 1)  # 3 fp32 blocks per message at most
    assert torch.equal(receiver.kv_cache[:, :, dst], source[:, :, src])
    assert sender_staging(prefill, "prefill-in-place", receiver) == (0, 0, 0)
    assert receiver.staging.in_use_bytes == 0


def test_large_blocks_go_one_per_message_so_scattered_sender_ids_move_in_place(
        receivers, prefill, monkeypatch):
    """Blocks of ``BLOCK_MESSAGE_BYTES`` or more: the receiver's consecutive run is cut into
    one message per block, so the sender, whose ids are scattered, gathers nothing."""
    receiver, source = receivers["f32"], make_cache(torch.float32, 7)
    monkeypatch.setattr(payload, "BLOCK_MESSAGE_BYTES", receiver.geometry.block_bytes)
    src, dst = [12, 2, 9, 5], [3, 4, 5, 6]
    handle, reply = pull(prefill, receiver, "prefill-in-place", "large-blocks", src, dst)
    assert handle.poll() == KVPollState.SUCCESS and reply[0] == "ok"
    assert handle.ticket.chunks == (1, 1, 1, 1)
    assert torch.equal(receiver.kv_cache[:, :, dst], source[:, :, src])
    assert sender_staging(prefill, "prefill-in-place", receiver) == (0, 0, 0)
    assert receiver.staging.in_use_bytes == 0


def test_a_failed_pull_gives_back_its_staging_buffer_and_drops_it(receivers, prefill):
    receiver, source = receivers["bf16"], make_cache(torch.bfloat16, 7)
    handle, reply = pull(prefill, receiver, "prefill-bf16", "before-lonely", [2, 9], [10, 4])
    assert handle.poll() == KVPollState.SUCCESS  # the channel is up: receives post early
    held = receiver.staging.held_bytes
    lonely = receiver.init("lonely-staged", "prefill-bf16", [4, 10], timeout_s=1.0)
    deadline = time.monotonic() + 5.0
    while lonely.early_receives is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert lonely.early_receives is not None and receiver.staging.in_use_bytes > 0
    assert lonely.wait(5.0) == KVPollState.FAILED
    assert receiver.staging.in_use_bytes == 0
    assert receiver.staging.held_bytes < held  # dropped: an aborted receive may hold it
    handle, reply = pull(prefill, receiver, "prefill-bf16", "after-lonely", [2, 9], [10, 4])
    assert handle.poll() == KVPollState.SUCCESS and reply[0] == "ok"
    assert torch.equal(receiver.kv_cache[:, :, [10, 4]], source[:, :, [2, 9]])
    assert receiver.staging.in_use_bytes == 0 and receiver.staging.held_bytes == held
