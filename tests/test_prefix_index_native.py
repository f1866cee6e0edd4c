"""The native hash chain and block index (``cluster/block_index.py``) against their Python
specifications: ``engine.block_hash.hash_block_chain`` and a set-based leading-run count."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pdserve.cluster import block_index
from pdserve.engine.block_hash import hash_block_chain, root_block_hash


@pytest.mark.parametrize("seed", range(20))
def test_hash_chain_is_byte_identical(seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 4, 16, 32])
    tokens = [rng.randrange(0, 2**31) for _ in range(rng.randrange(0, 300))]
    salt = rng.choice([None, "", "tenant-7", "ünïcode"])
    root = root_block_hash(f"model-{seed}", block_size)
    expected = hash_block_chain(tokens, block_size, root, salt)
    assert block_index.hash_chain(tokens, block_size, root, salt) == expected
    assert block_index.hash_chain(np.array(tokens, dtype=np.int64), block_size, root,
                                  salt) == expected
    assert block_index.hash_chain_packed(tuple(tokens), block_size, root, salt) == \
        b"".join(expected)


def test_hash_chain_rejects_bad_input():
    with pytest.raises(ValueError):
        block_index.hash_chain([1, 2], 0, bytes(16))
    with pytest.raises(ValueError):
        block_index.hash_chain([1, 2], 1, bytes(8))


def reference(held: dict[int, set[bytes]], chain: list[bytes], capacity: int) -> np.ndarray:
    out = np.zeros(capacity, dtype=np.int32)
    for slot, blocks in held.items():
        run = 0
        while run < len(chain) and chain[run] in blocks:
            run += 1
        out[slot] = run
    return out


@pytest.mark.parametrize("seed", range(10))
def test_lookup_matches_the_leading_run_of_each_slot(seed):
    rng = random.Random(seed)
    capacity = rng.choice([1, 63, 64, 130, 1000])
    index = block_index.new_block_index(capacity)
    chains = [hash_block_chain(list(range(i, i + 16 * 20)), 16, bytes(16)) for i in range(5)]
    universe = [h for c in chains for h in c]
    held: dict[int, set[bytes]] = {s: set() for s in range(capacity)}
    for _ in range(3000):
        slot = rng.randrange(capacity)
        chain = rng.choice(chains)
        n = rng.randrange(0, 21)
        if rng.random() < 0.7:  # a worker caches a prefix (popular blocks go to bitmaps)
            index.add(slot, block_index.packed(chain[:n]))
            held[slot].update(chain[:n])
        elif rng.random() < 0.9:
            gone = rng.sample(universe, rng.randrange(0, 10))
            assert index.remove(slot, block_index.packed(gone)) == len(held[slot] & set(gone))
            held[slot] -= set(gone)
        elif rng.random() < 0.5:
            assert index.remove_slot(slot) == len(held[slot])
            held[slot] = set()
        else:  # a republished set
            kept = chain[:n]
            assert index.replace(slot, block_index.packed(kept)) == len(set(kept))
            held[slot] = set(kept)
    for chain in chains:
        for length in (0, 1, 7, 20):
            got = index.lookup(block_index.packed(chain[:length]))
            assert got.dtype == np.int32 and got.shape == (capacity,)
            np.testing.assert_array_equal(got, reference(held, chain[:length], capacity))
    for slot in range(capacity):
        assert index.num_blocks(slot) == len(held[slot])
    assert index.num_hashes() == len(set().union(*held.values()))


def test_a_run_stops_at_the_first_miss():
    h = hash_block_chain(list(range(64)), 16, bytes(16))
    index = block_index.new_block_index(4)
    index.add(0, block_index.packed([h[0], h[2], h[3]]))
    index.add(1, block_index.packed(h[1:3]))
    index.add(2, block_index.packed(h))
    assert index.lookup(block_index.packed(h)).tolist() == [1, 0, 4, 0]
    with pytest.raises(IndexError):
        index.add(4, h[0])
    with pytest.raises(ValueError):
        index.lookup(b"x" * 17)


def test_many_blocks_come_and_go():
    """The block map's growth and deletions (open addressing, backward shifts) against a
    set: thousands of hashes added and removed in random order, each looked up alone."""
    rng = random.Random(7)
    index = block_index.new_block_index(2)
    universe = [rng.randbytes(16) for _ in range(6000)]
    held: dict[int, set[bytes]] = {0: set(), 1: set()}
    for _ in range(40):
        slot = rng.randrange(2)
        batch = rng.sample(universe, rng.randrange(1, 800))
        if rng.random() < 0.6:
            assert index.add(slot, block_index.packed(batch)) == len(set(batch) - held[slot])
            held[slot].update(batch)
        else:
            assert index.remove(slot, block_index.packed(batch)) == len(held[slot] & set(batch))
            held[slot] -= set(batch)
        assert index.num_hashes() == len(held[0] | held[1])
    for h in universe:
        assert index.lookup(h).tolist() == [int(h in held[0]), int(h in held[1])]
    assert index.remove_slot(0) == len(held[0])
    assert index.num_hashes() == len(held[1])
    for h in rng.sample(universe, 500):
        assert index.lookup(h).tolist() == [0, int(h in held[1])]
