"""The block pool: ref-counted KV blocks, an LRU free queue and the prefix cache.

Follows vLLM v1's design (``vllm/v1/core/block_pool.py``): a block whose ref count drops to
zero goes to the tail of the free queue but keeps its hash, so a later request with the
same prefix can take it back (a prefix-cache hit); new blocks are taken from the head,
evicting the least recently freed cached block. Every change to the prefix cache is
reported as a KV event (``stored`` / ``removed`` block hashes).
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass


class KVEventKind(enum.Enum):
    STORED = "stored"
    REMOVED = "removed"


@dataclass(frozen=True, slots=True)
class KVEvent:
    """Block hashes that entered (``STORED``) or left (``REMOVED``) this pool's prefix cache."""

    kind: KVEventKind
    block_hashes: tuple[bytes, ...]


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One block of ``block_size`` token slots; ``block_hash`` set once full and cached."""

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


class NoFreeBlocksError(RuntimeError):
    """More blocks were asked for than the pool has free."""


class BlockPool:
    """``num_blocks`` KV blocks with ref counts, an LRU free queue and a hash -> block map.

    Args:
        num_blocks: blocks in the worker's KV cache.
        enable_prefix_caching: keep freed full blocks findable by hash.
        kv_event_callback: called with each ``KVEvent`` as the cache changes.
    """

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True,
                 kv_event_callback: Callable[[KVEvent], None] | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be >= 1")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.kv_event_callback = kv_event_callback
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # block_id -> block, head = next to evict. O(1) removal on a cache hit.
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[bytes, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref count 0 (cached ones included: they are evictable)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (ref count > 0), in [0, 1]."""
        return 1.0 - len(self._free) / self.num_blocks

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self._cached.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` free blocks (ref count 1), evicting cached ones LRU first.

        Which blocks: the ``num_blocks`` at the free queue's head. In what order: ascending
        block id. Sequences free their blocks tail first, so taken in queue order a
        request reusing another's blocks would hold them in descending ids; ascending, the
        ids of a request's blocks form long runs of consecutive ids, which KV transfer
        moves in place as a few large messages (a run of the block-major cache is one
        region) instead of one message per block.

        Raises:
            NoFreeBlocksError: fewer than ``num_blocks`` are free.
        """
        if num_blocks > len(self._free):
            raise NoFreeBlocksError(f"asked for {num_blocks} blocks, {len(self._free)} free")
        evicted: list[bytes] = []
        taken = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                evicted.append(block.block_hash)
                del self._cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            taken.append(block)
        self._emit(KVEventKind.REMOVED, evicted)
        taken.sort(key=lambda b: b.block_id)
        return taken

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add a reference to each block (a prefix-cache hit or a pin)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference from each block; those reaching 0 join the free queue's tail
        in the given order (pass a sequence's blocks tail first so its prefix is evicted last).
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} freed with ref_cnt={block.ref_cnt}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[bytes]) -> None:
        """Enter ``blocks[i]`` into the prefix cache under ``block_hashes[i]``.

        Blocks already cached are skipped; a hash already held by another block (the same
        prefix computed twice) keeps its first block, and the duplicate stays uncached.
        """
        if not self.enable_prefix_caching:
            return
        stored = []
        for block, block_hash in zip(blocks, block_hashes):
            if block.block_hash is not None or block_hash in self._cached:
                continue
            block.block_hash = block_hash
            self._cached[block_hash] = block
            stored.append(block_hash)
        self._emit(KVEventKind.STORED, stored)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash held by a free block; False if some are still in use."""
        if len(self._free) != self.num_blocks:
            return False
        removed = list(self._cached)
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()
        self._emit(KVEventKind.REMOVED, removed)
        return True

    def _emit(self, kind: KVEventKind, hashes: list[bytes]) -> None:
        if hashes and self.kv_event_callback is not None:
            self.kv_event_callback(KVEvent(kind, tuple(hashes)))
