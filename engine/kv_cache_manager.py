"""Per-request block allocation over the block pool, with prefix-cache lookups.

Worked example (``block_size=4``): a 10-token prompt whose first 8 tokens match cached
blocks ``[7, 3]`` gets ``get_computed_blocks -> ([7, 3], 8)``; ``allocate_slots(req, 2,
[7, 3])`` then takes one new block for tokens 8-9, so ``block_ids == [7, 3, 12]``. After
the step, the request holds 10 computed tokens; the partial block 12 is not hashed until
two more tokens fill it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdserve.engine.block_hash import hash_block_chain
from pdserve.engine.block_pool import BlockPool, KVCacheBlock, KVEvent
from pdserve.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Owns which blocks each request holds.

    Args:
        num_blocks: blocks in the KV cache.
        block_size: token slots per block.
        root_hash: ``h_{-1}`` of the block hash chain (``block_hash.root_block_hash``).
        enable_prefix_caching: reuse blocks across requests by hash.
        kv_event_callback: receives the pool's ``stored`` / ``removed`` events.
        sliding_window: tokens back from a query beyond which no layer reads K/V (the
            model's ``kv_free_window``: every layer slides), or None. Blocks wholly before
            every future query's window are freed as a request runs (``block_ids`` then
            gives -1 for them: no kernel reads them).
    """

    def __init__(self, num_blocks: int, block_size: int, root_hash: bytes,
                 enable_prefix_caching: bool = True,
                 kv_event_callback: Callable[[KVEvent], None] | None = None,
                 lease_s: float = 30.0, sliding_window: int | None = None) -> None:
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.root_hash = root_hash
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching, kv_event_callback)
        self.lease_s = lease_s
        # None: a block freed before the request's sliding window (see remove_skipped_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock | None]] = {}
        # Blocks of finished prefill requests kept for a decode worker to pull.
        self.held: dict[str, KVLease] = {}
        # Leases replaced by a prefill again under the same request id while a send of
        # them ran: unpinned when that send ends (``end_send``).
        self.superseded: dict[str, KVLease] = {}

    @property
    def usage(self) -> float:
        return self.pool.usage

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table; -1 where a block before its window was freed."""
        return [-1 if b is None else b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def remove_skipped_blocks(self, request: Request) -> None:
        """Free the request's blocks that no later query sees: with every layer sliding,
        the blocks wholly before ``num_computed_tokens - sliding_window + 1``, the first
        key the next query sees (vLLM's sliding-window manager does the same). Freed,
        hashed blocks stay in the prefix cache like any other. A prefill worker's request
        (``remote_decode``) keeps all its blocks for the decode worker that pulls them.

        Worked example (``block_size=4``, window 6): after 13 computed tokens the next
        query (position 13) sees keys 8..13, so blocks 0 and 1 (tokens 0-7) are freed.
        """
        if self.sliding_window is None or request.remote_decode:
            return
        blocks = self.req_to_blocks.get(request.request_id)
        if not blocks:
            return
        first_seen = max(0, request.num_computed_tokens - self.sliding_window + 1)
        skipped = min(first_seen // self.block_size, len(blocks))
        freed = [b for b in blocks[:skipped] if b is not None]
        if freed:
            blocks[:skipped] = [None] * skipped
            self.pool.free_blocks(reversed(freed))

    def update_block_hashes(self, request: Request) -> list[bytes]:
        """Hash any newly full blocks of ``request.all_token_ids``; returns all hashes."""
        if len(request.block_hashes) < request.num_tokens // self.block_size:
            request.block_hashes = hash_block_chain(
                request.all_token_ids, self.block_size, self.root_hash, request.cache_salt,
                parent_hashes=request.block_hashes)
        return request.block_hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached blocks matching the request's leading full blocks.

        At most ``num_tokens - 1`` tokens count as hits, so the last token is always
        computed (its logits give the next token). Returns (blocks, number of tokens).
        """
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0  # NOTE: prompt_logprobs needs every prompt position computed
        hashes = self.update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[KVCacheBlock] = (),
                       cache: bool = True) -> bool:
        """Make room for ``num_new_tokens`` beyond the request's computed (and newly hit)
        tokens. Returns False, changing nothing, when too few blocks are free.

        With ``cache=False`` the new blocks are not entered into the prefix cache (their
        KV is still arriving from another worker; ``cache_blocks`` enters them later).
        """
        self.remove_skipped_blocks(request)
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_needed = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new_blocks = num_needed - len(blocks) - len(new_computed_blocks)
        # Hit blocks with ref count 0 sit in the free queue: touching them uses up free slots.
        num_reclaimed = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_reclaimed:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return False
        self.pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        if num_new_blocks > 0:
            blocks.extend(self.pool.get_new_blocks(num_new_blocks))
        if cache:
            self.cache_blocks(request, num_computed + num_new_tokens)
        return True

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Enter the request's blocks that are full of computed tokens into the cache."""
        if not self.enable_prefix_caching:
            return
        num_full = min(num_computed_tokens, request.num_tokens) // self.block_size
        if num_full == 0:
            return
        hashes = self.update_block_hashes(request)
        pairs = [(b, h) for b, h in zip(self.req_to_blocks[request.request_id][:num_full],
                                        hashes[:num_full]) if b is not None]
        self.pool.cache_full_blocks([b for b, _ in pairs], [h for _, h in pairs])

    def free(self, request: Request) -> None:
        """Release every block the request holds (tail first, so its prefix stays longest)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.pool.free_blocks(reversed([b for b in blocks if b is not None]))

    def hold(self, request: Request) -> None:
        """Move a finished request's blocks under a lease of ``lease_s`` seconds: they stay
        referenced (pinned) until ``release_held``, a successful ``end_send``, or expiry.

        A lease still standing under the same request id (the router prefilled again after
        a failed pull, before its ``Release`` arrived) is given up: unpinned now, or when
        its running send ends."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        old = self.held.pop(request.request_id, None)
        if old is not None and old.sending:
            old.released = True
            self.superseded[request.request_id] = old
        elif old is not None:
            self.pool.free_blocks(reversed(old.blocks))
        self.held[request.request_id] = KVLease(blocks, time.monotonic() + self.lease_s,
                                                consumer=request.kv_consumer)

    def held_block_ids(self, request_id: str) -> list[int] | None:
        lease = self.held.get(request_id)
        return None if lease is None else [b.block_id for b in lease.blocks]

    def begin_send(self, request_id: str, consumer: str | None = None) -> list[int]:
        """Mark a lease as being sent to ``consumer`` (it cannot expire or be released
        meanwhile) and return its block ids.

        Raises:
            KeyError: no lease for ``request_id`` (never held, expired, released or sent),
                or a send of it (or of a lease it replaced) is already running.
            PermissionError: the lease names another consumer.
        """
        lease = self.held.get(request_id)
        if (lease is None or lease.sending or lease.released
                or request_id in self.superseded):
            raise KeyError(f"no KV lease for request {request_id!r} (expired, released or "
                           "already being sent)")
        if lease.consumer is not None and consumer != lease.consumer:
            raise PermissionError(f"the KV lease of request {request_id!r} is for another "
                                  "decode worker")
        lease.sending = True
        return [b.block_id for b in lease.blocks]

    def bind(self, request_id: str, bindings: list[bytes]) -> list[int] | None:
        """Record what the leading blocks of a lease hold (``block_hash.block_bindings``
        of its prompt, one per prompt block) and return their block ids; None without
        such a lease (ended, released, or fewer blocks than bindings)."""
        lease = self.held.get(request_id)
        if lease is None or lease.released or len(bindings) > len(lease.blocks):
            return None
        lease.bindings = list(bindings)
        return [b.block_id for b in lease.blocks[:len(bindings)]]

    def bindings(self, request_id: str) -> list[bytes] | None:
        """What ``bind`` recorded for a lease (None: nothing, or no lease)."""
        lease = self.held.get(request_id)
        return None if lease is None else lease.bindings

    def grant(self, request_id: str, consumer: str | None) -> bool:
        """Let ``consumer`` (instead of the one named so far) take a lease that is not
        being sent; False if there is no such lease."""
        lease = self.held.get(request_id)
        if lease is None or lease.sending or lease.released:
            return False
        lease.consumer = consumer
        return True

    def end_send(self, request_id: str, ok: bool) -> None:
        """A send of the lease ended: sent (``ok``), the blocks are unpinned; failed, the
        lease stands until it expires, so another decode worker may pull it. The send of a
        lease replaced meanwhile (``hold``) unpins that one only."""
        replaced = self.superseded.pop(request_id, None)
        if replaced is not None:  # only it can be sending: begin_send refuses the new one
            self.pool.free_blocks(reversed(replaced.blocks))
            return
        lease = self.held.get(request_id)
        if lease is None:
            return
        lease.sending = False
        if ok or lease.released:
            self.release_held(request_id)

    def release_held(self, request_id: str) -> bool:
        """Unpin held blocks (they stay in the prefix cache); False if none are held. While
        a send of them runs, they are unpinned as soon as it ends, whatever its outcome."""
        lease = self.held.get(request_id)
        if lease is None:
            return False
        if lease.sending:
            lease.released = True
            return True
        del self.held[request_id]
        self.pool.free_blocks(reversed(lease.blocks))
        return True

    def expire_leases(self, now: float) -> list[str]:
        """Unpin every lease past its expiry (``time.monotonic()`` seconds) that is not
        being sent; returns their request ids."""
        expired = [rid for rid, lease in self.held.items()
                   if lease.expires_at <= now and not lease.sending]
        for request_id in expired:
            self.release_held(request_id)
        return expired

    @property
    def num_leased_blocks(self) -> int:
        """Blocks pinned under leases (a block shared by two leases counts twice)."""
        return sum(len(lease.blocks) for lease in self.leases())

    def leases(self) -> list[KVLease]:
        """Every lease pinning blocks: those held and those replaced during their send."""
        return [*self.held.values(), *self.superseded.values()]


@dataclass(slots=True)
class KVLease:
    """A finished prefill's blocks, pinned for a decode worker until ``expires_at``
    (``time.monotonic()`` seconds); ``sending``: a transfer of them is running;
    ``released``: given up during that transfer, so unpinned when it ends; ``consumer``:
    the only decode worker it may be sent to (None: any)."""

    blocks: list[KVCacheBlock]
    expires_at: float
    sending: bool = False
    released: bool = False
    consumer: str | None = None
    bindings: list[bytes] | None = None  # what each block holds (the KV path's tags)
