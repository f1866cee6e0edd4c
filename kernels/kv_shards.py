"""A tensor-parallel worker's KV cache as KV transfer sees it: every rank's share of the KV
heads, assembled into whole blocks (../shared/DESIGN.md, Tensor parallelism).

Each rank of a worker at ``--tensor-parallel-size N`` caches its own KV heads
(``engine/parallel.py``) under the same block ids. Rank 0 maps the other ranks' caches
(shared memory: ``engine/model_runner.py``), and its sender and receiver move whole
blocks, all ``num_kv_heads`` of them, exactly as a worker at TP=1 does: the sender
gathers each rank's heads into the payload's head range, the receiver scatters each
rank's head range into that rank's cache (into every rank that holds a replicated head).
So any tensor-parallel size pairs with any other (2 -> 1, 1 -> 2, 4 -> 2): the wire holds
the model's KV heads in the model's order, whatever the split on either side, the
geometries compare as at TP=1, and a delta transfer moves the same blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class KVShard:
    """One rank's cache ``[num_layers, 2, num_blocks, block_size, heads, head_dim]`` and
    the model's KV heads it holds, from ``first_head``."""

    kv_cache: torch.Tensor
    first_head: int

    @property
    def num_heads(self) -> int:
        return self.kv_cache.shape[4]


class KVShards:
    """Every rank's KV heads of one worker, as one cache of ``shape`` ``[num_layers, 2,
    num_blocks, block_size, num_kv_heads, head_dim]`` that KV transfer gathers blocks
    from and scatters blocks into (never in place: every chunk is staged).

    Raises:
        ValueError: the shards disagree on anything but their heads, are not float
            caches, or do not cover the heads ``0 .. num_kv_heads - 1``.
    """

    def __init__(self, shards: list[KVShard]) -> None:
        first = shards[0].kv_cache
        for shard in shards:
            cache = shard.kv_cache
            if (cache.dim() != 6 or cache.shape[:4] != first.shape[:4]
                    or cache.shape[5] != first.shape[5] or cache.dtype != first.dtype
                    or cache.device != first.device):
                raise ValueError(f"KV shards differ: {tuple(cache.shape)} {cache.dtype} "
                                 f"{cache.device} against {tuple(first.shape)} {first.dtype}")
            if not cache.is_floating_point() or cache.element_size() == 1:
                raise ValueError(f"KV shards of {cache.dtype}: a quantized cache is not "
                                 "transferred between tensor-parallel workers")
        self.shards = shards
        num_heads = max(s.first_head + s.num_heads for s in shards)
        # NOTE: a replicated head is read from its first holder, written to every one
        self._sources: list[KVShard] = []
        covered: set[int] = set()
        for shard in shards:
            heads = set(range(shard.first_head, shard.first_head + shard.num_heads))
            if not heads <= covered:
                if heads & covered:
                    raise ValueError("KV shards overlap in part")
                self._sources.append(shard)
                covered |= heads
        if covered != set(range(num_heads)):
            raise ValueError(f"KV shards hold heads {sorted(covered)}, not 0..{num_heads - 1}")
        self.shape = torch.Size((*first.shape[:4], num_heads, first.shape[5]))
        self.dtype, self.device = first.dtype, first.device
        self.is_cuda = first.is_cuda

    def element_size(self) -> int:
        return self.shards[0].kv_cache.element_size()

    def gather(self, block_ids: torch.Tensor, out: torch.Tensor) -> None:
        """Copy blocks ``block_ids`` ``[n]`` int64 of every head into ``out``
        ``[num_layers, 2, n, block_size, num_kv_heads, head_dim]`` (any strides)."""
        for shard in self._sources:
            heads = slice(shard.first_head, shard.first_head + shard.num_heads)
            out[:, :, :, :, heads].copy_(shard.kv_cache.index_select(2, block_ids))

    def scatter(self, block_ids: torch.Tensor, src: torch.Tensor) -> None:
        """Write ``src`` ``[num_layers, 2, n, block_size, num_kv_heads, head_dim]`` into
        blocks ``block_ids`` ``[n]`` int64 of every rank, each rank its heads."""
        for shard in self.shards:
            heads = slice(shard.first_head, shard.first_head + shard.num_heads)
            shard.kv_cache.index_copy_(2, block_ids, src[:, :, :, :, heads])
