"""KV transfer's parts in one process (docs/architecture.md, KV transfer): chunk plans and
tickets, payloads over a real 2-rank gloo pair group (drained, tag refused), the staging
pool and the transfer threads. The pulls between two processes are in
``test_kvtransfer.py``, whose caches and 3 KiB chunks these tests share.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from test_kvtransfer import (  # noqa: F401 - small_chunks: the module's fixture
    KV_KEY,
    NUM_BLOCKS,
    make_cache,
    small_chunks,
)

from pdserve.kvtransfer import KVTransferError, payload
from pdserve.kvtransfer.protocol import KVGeometry, Ticket
from pdserve.kvtransfer.staging import StagingPool
from pdserve.kvtransfer.threads import TransferThreads


def test_chunk_plans_and_their_ticket_encoding():
    layer, block = make_cache(torch.float32, None), make_cache(torch.float32, None, "block")
    geometry = KVGeometry.of(block)  # 1 KiB blocks; CHUNK_BYTES = 3 KiB here
    assert payload.plan_chunks(layer, list(range(8)), geometry) == [3, 3, 2]
    assert payload.plan_chunks(block, list(range(8)), geometry) == [3, 3, 2]
    assert payload.plan_chunks(block, [4, 5, 6, 9, 2, 3, 10, 11, 12, 13], geometry) == [
        3, 1, 2, 3, 1]
    assert payload.plan_chunks(block, [7], geometry) == [1]
    original, payload.BLOCK_MESSAGE_BYTES = payload.BLOCK_MESSAGE_BYTES, geometry.block_bytes
    try:  # NOTE: blocks this large go one per message, whatever the layout or the runs
        assert payload.plan_chunks(block, list(range(8)), geometry) == [1] * 8
        assert payload.plan_chunks(layer, [5, 2, 3], geometry) == [1, 1, 1]
    finally:
        payload.BLOCK_MESSAGE_BYTES = original
    nonce = "0123456789abcdef" * 2
    ticket = Ticket("abc", 2, 5, 10, geometry, (3, 1, 2, 3, 1), nonce)
    # incarnation, nonce, generation, tag, blocks; geometry: layers, block size, kv heads,
    # head dim, dtype code, scales offset (none), block bytes; chunks
    assert ticket.encode() == f"abc {nonce} 2 5 10 2 4 2 8 1 0 1024 3 1 2 3 1"
    assert Ticket.decode(ticket.encode()) == ticket
    many = Ticket("abc", 2, 5, 1030, geometry, (3,) * 300 + (1,) * 130, nonce)
    assert many.encode().endswith(" 3*300 1*130") and Ticket.decode(many.encode()) == many
    for bad in ("3 3", "10 0", ""):
        with pytest.raises(ValueError, match="do not cut 10 blocks"):
            Ticket.decode(f"abc {nonce} 2 5 10 2 4 2 8 1 0 1024 {bad}")
    for nonce in ("", "abc", "0123456789ABCDEF" * 2):  # NOTE: a pull's tag key needs one
        with pytest.raises(ValueError, match="nonce"):
            Ticket("abc", 2, 5, 10, geometry, (10,), nonce)


def _pair_groups(name: str):
    """Both ranks of a real 2-rank gloo pair group in this process, rendezvoused through
    an authenticated KV store; and the store's server (close it)."""
    from pdserve.kvtransfer.channel import PairGroup
    from pdserve.kvtransfer.store import KVStoreServer, RemoteStore

    server = KVStoreServer("127.0.0.1", 0, KV_KEY, timeout_s=10)
    stores = {0: RemoteStore("127.0.0.1", server.port, KV_KEY, 10), 1: server.local()}
    groups: dict = {}
    makers = [threading.Thread(target=lambda r=r: groups.__setitem__(r, PairGroup.make(
        stores[r], name, r, "127.0.0.1", torch.device("cpu"), 10, kv_key=KV_KEY)))
        for r in (0, 1)]
    for thread in makers:
        thread.start()
    for thread in makers:
        thread.join(15)
    return groups, server


def _send_in_thread(group, source, ids, geometry, tag, deadline, digest, records) -> list:
    from pdserve.kvtransfer.protocol import Header

    sent: list = []
    thread = threading.Thread(target=lambda: sent.append(group.send(
        lambda seq: Header(1, len(ids), geometry, seq).encode(), source, tag, deadline,
        digest, lambda: records)))
    thread.start()
    return [thread, sent]


def _tagged(cache, ids, bindings, kv_key=b"k" * 32):
    """Block records of ``ids`` tagged (``auth.BlockTagger``) by prefill worker "p"."""
    from pdserve.kvtransfer.auth import BlockTagger
    from pdserve.kvtransfer.socket_pair import byte_view

    tagger = BlockTagger(kv_key, "p")
    geometry = KVGeometry.of(cache)
    source = payload.PayloadSource(cache, ids, geometry, [1] * len(ids), False)
    tagger.tag(ids, bindings, lambda i: byte_view(source.chunk(i)))
    return tagger.records(ids, bindings)


def test_a_drained_payload_of_more_chunks_than_ring_slots_is_received_whole():
    """A pull cancelled after its sender claimed it, with no receives posted early,
    receives the payload into its ring and discards it: every chunk, re-posting as slots
    free (6 chunks, 2 slots), and the payload's tag, on a real 2-rank gloo group in this
    process."""
    from pdserve.kvtransfer.auth import PayloadDigest, request_bindings
    from pdserve.kvtransfer.protocol import Header

    groups, server = _pair_groups("drain-test")
    source_cache = make_cache(torch.float32, 7, "block")
    geometry = KVGeometry.of(source_cache)
    ids = list(range(NUM_BLOCKS))[::-1]  # 16 blocks of 1 KiB, 3 per chunk
    sizes = payload.plan_chunks(make_cache(torch.float32, None), ids, geometry)
    assert len(sizes) == 6 > payload.RING_SLOTS
    receiving = make_cache(torch.float32, None)
    sink = payload.PayloadSink(receiving, ids, geometry, sizes, False, drain=True)
    deadline = time.monotonic() + 10
    thread, sent = _send_in_thread(
        groups[0], payload.PayloadSource(source_cache, ids, geometry, sizes, False), ids,
        geometry, 5, deadline, PayloadDigest(b"k" * 32),
        _tagged(source_cache, ids, request_bindings("r", len(ids))))
    groups[1].recv(sink, 5, deadline, lambda header: Header.decode(header).seq)
    thread.join(10)
    assert sent == [NUM_BLOCKS * geometry.block_bytes]
    assert not receiving.any()  # drained, not written
    for group in groups.values():
        group.abort()
    server.close()


@pytest.mark.parametrize("layout,small_pieces", [("block", False), ("layer", False),
                                                  ("block", True)])
def test_a_payload_whose_tags_are_not_its_senders_is_refused(layout, small_pieces,
                                                             monkeypatch):
    """The receiver checks each block's tag as it lands (``auth.BlockVerifier``), and
    the transfer's GMAC over header and block records: its own tags pass (bytes equal);
    blocks tagged under another cluster secret, blocks that hold other tokens than the
    receiver expects (another binding: a replayed block of another prompt), a flipped
    byte, and records under another transfer key each fail the pull, however the bytes
    arrived (in place, or through the staging ring), and however the socket's pieces
    cut the blocks (``small_pieces``: 300 bytes, so 1 KiB blocks land over several)."""
    from pdserve.kvtransfer import socket_pair
    from pdserve.kvtransfer.auth import BlockVerifier, PayloadDigest, request_bindings
    from pdserve.kvtransfer.protocol import Header

    if small_pieces:
        monkeypatch.setattr(socket_pair, "PIECE_BYTES", 300)

    groups, server = _pair_groups(f"tag-test-{layout}")
    source_cache = make_cache(torch.float32, 7, layout)
    geometry = KVGeometry.of(source_cache)
    ids = [3, 4, 5, 9, 1]
    bindings = request_bindings("r", len(ids))
    flipped = source_cache.clone()
    flipped[0, 1, 9, 0, 0, 0] += 1  # NOTE: one value of block 9, sent with block 9's tag
    cases = [  # tag, source, block records, transfer key, expected bindings, refusal
        (5, source_cache, _tagged(source_cache, ids, bindings), b"k" * 32, bindings, None),
        (6, source_cache, _tagged(source_cache, ids, bindings, b"x" * 32), b"k" * 32,
         bindings, "a block's tag"),
        (7, source_cache, _tagged(source_cache, ids, bindings), b"k" * 32,
         request_bindings("other", len(ids)), "a block's tag"),
        (8, flipped, _tagged(source_cache, ids, bindings), b"k" * 32, bindings,
         "a block's tag"),
        (9, source_cache, _tagged(source_cache, ids, bindings), b"x" * 32, bindings,
         "payload's tag is not its sender's"),
    ]
    for tag, cache, records, transfer_key, expected, refusal in cases:
        receiving = make_cache(torch.float32, None, layout)
        sizes = payload.plan_chunks(receiving, ids, geometry)
        sink = payload.PayloadSink(receiving, ids, geometry, sizes, False)
        deadline = time.monotonic() + 10
        thread, sent = _send_in_thread(
            groups[0], payload.PayloadSource(cache, ids, geometry, sizes, False), ids,
            geometry, tag, deadline, PayloadDigest(transfer_key), records)
        check = PayloadDigest(b"k" * 32)

        def verifier(recs, expected=expected):
            return BlockVerifier(b"k" * 32, "p", recs, expected, geometry.block_bytes)

        if refusal is None:
            groups[1].recv(sink, tag, deadline, lambda h: Header.decode(h).seq, digest=check,
                           verifier=verifier)
            sink.finish()
            assert torch.equal(receiving[:, :, ids], source_cache[:, :, ids])
        else:
            with pytest.raises(KVTransferError, match=refusal):
                groups[1].recv(sink, tag, deadline, lambda h: Header.decode(h).seq,
                               digest=check, verifier=verifier)
        thread.join(10)
        assert sent == [len(ids) * geometry.block_bytes]
    for group in groups.values():
        group.abort()
    server.close()


MiB = 2**20


def test_staging_pool_reuses_the_smallest_free_buffer_that_fits():
    pool = StagingPool(max_bytes=64 * MiB)
    small, large = pool.take(3 * MiB), pool.take(10 * MiB)
    assert (small.buffer.numel(), large.buffer.numel()) == (3 * MiB, 10 * MiB)
    assert small.pooled and large.pooled and pool.in_use_bytes == 13 * MiB
    pool.give_back(small)
    pool.give_back(large)
    assert pool.num_free == 2 and pool.in_use_bytes == 0 and pool.held_bytes == 13 * MiB
    again = pool.take(2 * MiB)
    assert again.buffer.data_ptr() == small.buffer.data_ptr()
    other = pool.take(2 * MiB)  # the small one is in use: the large one serves
    assert other.buffer.data_ptr() == large.buffer.data_ptr()
    assert pool.held_bytes == 13 * MiB


def test_staging_pool_never_holds_more_than_its_bound():
    pool = StagingPool(max_bytes=16 * MiB)
    first, second = pool.take(6 * MiB), pool.take(6 * MiB)
    third = pool.take(6 * MiB)  # 18 MiB in use would pass the bound: a buffer of its own
    assert (first.pooled, second.pooled, third.pooled) == (True, True, False)
    assert pool.held_bytes == 12 * MiB and pool.in_use_bytes == 12 * MiB
    for lease in (first, second, third):
        pool.give_back(lease)
    assert pool.held_bytes == 12 * MiB and pool.num_free == 2
    bigger = pool.take(9 * MiB)  # makes room by dropping the least recently given back
    assert bigger.pooled and pool.held_bytes == 15 * MiB and pool.num_free == 1
    assert pool.take(17 * MiB).pooled is False  # over the bound alone
    assert pool.held_bytes <= 16 * MiB


def test_staging_pool_drops_failed_buffers_and_frees_everything_on_close():
    pool = StagingPool(max_bytes=16 * MiB)
    failed, ok = pool.take(4 * MiB), pool.take(4 * MiB)
    pool.give_back(failed, reusable=False)
    pool.give_back(failed, reusable=False)  # twice: nothing more happens
    assert pool.held_bytes == 4 * MiB and pool.in_use_bytes == 4 * MiB
    pool.give_back(ok)
    assert pool.take(4 * MiB).buffer.data_ptr() == ok.buffer.data_ptr()
    pool.close()
    assert pool.num_free == 0 and pool.held_bytes == 4 * MiB  # the lease in use
    late = pool.take(1 * MiB)
    assert late.pooled is False
    assert pool.held_bytes == 4 * MiB


def test_staging_pool_disabled_allocates_for_each_transfer():
    pool = StagingPool(max_bytes=0)
    lease = pool.take(1024)
    assert lease.pooled is False and lease.buffer.numel() == 1024
    pool.give_back(lease)
    assert pool.held_bytes == 0 and pool.num_free == 0


def test_staging_pool_never_hands_one_buffer_to_two_transfers_at_once():
    pool = StagingPool(max_bytes=8 * MiB)
    lock, leased, clashes = threading.Lock(), set(), []

    def worker(seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        for _ in range(300):
            lease = pool.take(int(torch.randint(1, 3 * MiB, (1,), generator=gen)))
            ptr = lease.buffer.data_ptr()
            with lock:
                if ptr in leased:
                    clashes.append(ptr)
                leased.add(ptr)
            assert pool.held_bytes <= 8 * MiB
            with lock:
                leased.discard(ptr)
            pool.give_back(lease, reusable=bool(seed % 3))

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not clashes and pool.in_use_bytes == 0 and pool.held_bytes <= 8 * MiB


def test_transfer_threads_reuse_idle_threads_grow_for_concurrent_tasks_and_close():
    threads = TransferThreads("test")
    done = threading.Event()
    ran = []
    for i in range(5):  # one after another: one thread serves them all
        done.clear()
        threads.submit(lambda i=i: (ran.append(i), done.set()))
        assert done.wait(10)
        deadline = time.monotonic() + 10
        while threads._idle == 0 and time.monotonic() < deadline:  # back to idle
            time.sleep(0.001)
    assert ran == [0, 1, 2, 3, 4] and threads.num_threads == 1
    release, started = threading.Event(), threading.Semaphore(0)

    def blocked() -> None:
        started.release()
        assert release.wait(10)

    for _ in range(3):  # in flight together: none waits behind another
        threads.submit(blocked)
    assert all(started.acquire(timeout=10) for _ in range(3))
    assert threads.num_threads == 3
    threads.submit(lambda: 1 / 0)  # a task that raises is logged; its thread lives on
    release.set()
    threads.close()
    with pytest.raises(RuntimeError, match="closed"):
        threads.submit(print)


def test_block_bindings_bind_each_block_to_its_tokens_and_tags_to_their_binding():
    """``block_bindings`` gives one value per block, the partial last one included, that
    changes with any token up to the block, the cache salt and the model's root hash;
    ``BlockTagger`` keeps each block's latest tag and refuses records of a binding the
    block was not tagged with."""
    from pdserve.engine.block_hash import block_bindings, hash_block_chain, root_block_hash
    from pdserve.kvtransfer.auth import BlockTagger, records_numel

    root = root_block_hash("m", 16)
    tokens = list(range(40))
    bindings = block_bindings(tokens, 16, root)
    assert len(bindings) == 3 and all(len(b) == 20 for b in bindings)
    assert [b[4:] for b in bindings[:2]] == hash_block_chain(tokens, 16, root)
    assert [int.from_bytes(b[:4], "little") for b in bindings] == [16, 16, 8]
    assert block_bindings(tokens[:32] + [7] * 8, 16, root)[:2] == bindings[:2]
    assert block_bindings(tokens[:32] + [7] * 8, 16, root)[2] != bindings[2]
    assert block_bindings(tokens[:32], 16, root) == bindings[:2]  # no partial block
    assert block_bindings(tokens, 16, root, "salt")[0] != bindings[0]
    assert block_bindings(tokens, 16, root_block_hash("other", 16))[0] != bindings[0]
    tagger = BlockTagger(b"k" * 32, "p")
    data = [bytes([i]) * 64 for i in range(3)]
    tagger.tag([4, 5, 6], bindings, lambda i: data[i])
    assert tagger.records([4, 5, 6], bindings).numel() == records_numel(3)
    assert tagger.current([4, 5, 6], bindings) == [True] * 3
    assert tagger.current([5], [bindings[0]]) == [False]
    with pytest.raises(KeyError, match="block 5 holds no tag"):
        tagger.records([5], [bindings[0]])
    first = tagger.records([4], [bindings[0]])
    tagger.tag([4], [bindings[0]], lambda i: data[0])  # NOTE: a new serial, a new tag
    assert not torch.equal(tagger.records([4], [bindings[0]]), first)
