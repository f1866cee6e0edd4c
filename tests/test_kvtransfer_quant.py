"""KV transfer of quantized caches between two real processes over loopback gloo: blocks
move as their bytes (int8 / fp8 values and their fp32 scales, in each block's region),
bit for bit, in place or staged; caches of different KV dtypes are refused at pairing,
naming both, within a few seconds."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import time

import pytest
import torch

from pdserve.engine.kv_cache_layout import KVCacheLayout
from pdserve.kvtransfer import KVPollState, KVReceiver, KVSender, KVTransferError, payload
from pdserve.kvtransfer.protocol import KVGeometry

KV_KEY = hashlib.sha256(b"pdserve test cluster: kv").digest()  # both processes

NUM_BLOCKS = 16
CHUNK_BYTES = 2 * 1024  # several chunks per payload, so rings are reused
DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16}
SENDERS = {"prefill-int8": "int8", "prefill-fp8": "fp8", "prefill-bf16": "bf16"}


def make_cache(name: str, seed: int | None):
    """A worker's cache as ``ModelRunner`` allocates it (2 layers, blocks of 4 tokens, 2
    kv heads of 8): ``(kv_cache, kv_scales)``; every byte random with ``seed`` (padding
    and scales included), zeros without."""
    layout = KVCacheLayout(2, 4, 2, 8, DTYPES[name])
    kv_cache, kv_scales = layout.allocate(NUM_BLOCKS, torch.device("cpu"))
    if seed is not None:
        raw = payload.wire_view(kv_cache, kv_scales) if kv_scales is not None else \
            kv_cache.permute(2, 0, 1, 3, 4, 5).reshape(NUM_BLOCKS, -1).view(torch.uint8)
        gen = torch.Generator().manual_seed(seed)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8))
    return kv_cache, kv_scales


def _prefill_main(conn) -> None:
    torch.set_num_threads(1)
    payload.CHUNK_BYTES = CHUNK_BYTES
    senders = {}
    for worker_id, name in SENDERS.items():
        kv_cache, kv_scales = make_cache(name, 7)
        senders[worker_id] = KVSender(worker_id, kv_cache,
                                      kv_key=KV_KEY, kv_scales=kv_scales, timeout_s=10,
                                      connect_timeout_s=10)
    conn.send("ready")
    while (cmd := conn.recv()) is not None:
        worker_id, request_id, decode_id, address, block_ids = cmd
        try:
            conn.send(("ok", senders[worker_id].send(request_id, decode_id, address, block_ids)))
        except KVTransferError as exc:
            conn.send(("error", str(exc)))


@pytest.fixture(scope="module")
def prefill():
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    process = ctx.Process(target=_prefill_main, args=(child,), daemon=True)
    process.start()
    assert conn.poll(60) and conn.recv() == "ready"
    yield conn
    conn.send(None)
    process.join(10)
    if process.is_alive():
        process.kill()


@pytest.fixture(scope="module")
def receivers():
    original, payload.CHUNK_BYTES = payload.CHUNK_BYTES, CHUNK_BYTES
    made = {}
    for name in ("int8", "bf16"):
        kv_cache, kv_scales = make_cache(name, None)
        made[name] = KVReceiver(f"decode-{name}", kv_cache,
                                kv_key=KV_KEY, kv_scales=kv_scales, timeout_s=10,
                                connect_timeout_s=10)
    yield made
    for receiver in made.values():
        receiver.close()
    payload.CHUNK_BYTES = original


def pull(conn, receiver, prefill_id, request_id, src, dst):
    handle = receiver.init(request_id, prefill_id, dst)
    conn.send((prefill_id, request_id, receiver.worker_id, receiver.address, src))
    handle.wait(15)
    assert conn.poll(15)
    return handle, conn.recv()


def test_geometry_describes_block_bytes_with_scales_and_the_dtype():
    int8, bf16 = (KVGeometry.of(*make_cache(name, None)) for name in ("int8", "bf16"))
    # 2 layers x 2 x 4 tokens x 2 heads x 8: 256 values; 16 fp32 scales at byte 256, the
    # block padded to 64 bytes
    assert (int8.dtype, int8.scales_offset, int8.block_bytes) == (torch.int8, 256, 320)
    assert (bf16.dtype, bf16.scales_offset, bf16.block_bytes) == (torch.bfloat16, 0, 512)
    assert KVGeometry.from_fields(int8.fields()) == int8
    with pytest.raises(ValueError, match="block storage"):  # scales outside the blocks
        KVGeometry.of(make_cache("int8", None)[0], torch.zeros(2, 2, NUM_BLOCKS, 2))


def test_quantized_blocks_move_bit_exactly_with_their_scales(receivers, prefill):
    receiver = receivers["int8"]
    source = payload.wire_view(*make_cache("int8", 7))
    cases = [([5, 2, 9], [0, 7, 3]),                        # scattered -> scattered
             (list(range(3, 13)), list(range(4, 14))),       # consecutive, several chunks
             (list(range(NUM_BLOCKS))[::-1], list(range(NUM_BLOCKS)))]
    for i, (src, dst) in enumerate(cases):
        receiver.kv_cache.zero_()
        handle, reply = pull(prefill, receiver, "prefill-int8", f"q-{i}", src, dst)
        assert handle.poll() == KVPollState.SUCCESS, handle.failure_exception()
        assert reply[0] == "ok" and reply[1].num_bytes == len(src) * 320
        assert torch.equal(receiver.kv_cache[:, :, dst], source[:, :, src])
        untouched = [b for b in range(NUM_BLOCKS) if b not in dst]
        assert not receiver.kv_cache[:, :, untouched].any()


@pytest.mark.parametrize("prefill_id,receiver_name", [("prefill-bf16", "int8"),
                                                      ("prefill-int8", "bf16"),
                                                      ("prefill-fp8", "int8")])
def test_different_kv_dtypes_are_refused_at_pairing_naming_both(receivers, prefill, prefill_id,
                                                                 receiver_name):
    receiver = receivers[receiver_name]
    receiver.kv_cache.zero_()
    start = time.monotonic()
    handle, reply = pull(prefill, receiver, prefill_id, f"mixed-{prefill_id}", [1, 2], [3, 4])
    assert time.monotonic() - start < 5
    assert handle.poll() == KVPollState.FAILED and reply[0] == "error"
    message = str(handle.failure_exception())
    prefill_dtype = {"prefill-bf16": "bfloat16", "prefill-int8": "int8",
                     "prefill-fp8": "float8_e4m3fn"}[prefill_id]
    receiver_dtype = {"int8": "int8", "bf16": "bfloat16"}[receiver_name]
    assert "KV cache dtypes differ" in message and "--kv-cache-dtype" in message
    assert f"decode worker decode-{receiver_name} holds {receiver_dtype}" in message
    assert f"prefill worker {prefill_id} holds {prefill_dtype}" in message
    assert "KV cache dtypes differ" in reply[1]
    assert not receiver.kv_cache.any()  # nothing was written
