"""Chained, process-stable block hashes for prefix caching (docs/architecture.md, The KV cache).

``h_i = H(h_{i-1} || token_ids of block i as int64 little-endian || extra)`` with ``H``
SHA-256 truncated to 16 bytes, ``h_{-1}`` derived from the model name, the block size and
the KV cache dtype (where it is not ``auto``: blocks of an int8 cache never match a bf16
one's, in the engine or in the Redis index), and
``extra`` the request's ``cache_salt`` (UTF-8) where given. Only full blocks are hashed.
The router and every worker call these functions, so the same prompt hashes the same on
every machine (never Python's ``hash()``, which is salted per process).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from pdserve.kernels.kv_quant import canonical_kv_cache_dtype

BLOCK_HASH_BYTES = 16


def root_block_hash(model_name: str, block_size: int, kv_cache_dtype: str = "auto") -> bytes:
    """``h_{-1}``: 16 bytes derived from the served model name, the block size (tokens)
    and ``kv_cache_dtype`` (``--kv-cache-dtype``; ``auto`` adds nothing, so float caches
    hash as before; ``fp8`` and ``fp8_e4m3`` are one dtype).

    Raises:
        ValueError: an unknown ``kv_cache_dtype``.
    """
    seed = f"pdserve-block-hash-v1\x00{model_name}\x00{block_size}"
    kv_cache_dtype = canonical_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype != "auto":
        seed += f"\x00kv-cache-dtype={kv_cache_dtype}"
    return hashlib.sha256(seed.encode()).digest()[:BLOCK_HASH_BYTES]


def hash_block_tokens(parent_hash: bytes, token_ids: Sequence[int], extra: bytes = b"") -> bytes:
    """``H(parent_hash || token_ids as int64 LE || extra)``, 16 bytes."""
    payload = np.asarray(token_ids, dtype="<i8").tobytes()
    return hashlib.sha256(parent_hash + payload + extra).digest()[:BLOCK_HASH_BYTES]


def hash_block_chain(
    token_ids: Sequence[int],
    block_size: int,
    root_hash: bytes,
    cache_salt: str | None = None,
    *,
    parent_hashes: Sequence[bytes] = (),
) -> list[bytes]:
    """Hashes of every full block of ``token_ids``; a trailing partial block is not hashed.

    ``parent_hashes`` are already-known hashes of the leading blocks (extended, not
    recomputed), so a growing sequence hashes each block once.

    Example: 40 tokens with ``block_size=16`` give 2 hashes (tokens 0-15, 16-31).
    """
    extra = cache_salt.encode() if cache_salt else b""
    hashes = list(parent_hashes)
    parent = hashes[-1] if hashes else root_hash
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start:start + block_size], extra)
        hashes.append(parent)
    return hashes


def block_bindings(
    token_ids: Sequence[int],
    block_size: int,
    root_hash: bytes,
    cache_salt: str | None = None,
    *,
    full_hashes: Sequence[bytes] | None = None,
) -> list[bytes]:
    """What each block of a prompt's KV holds, for the KV path's block tags
    (``kvtransfer.auth.BlockTagger``): one 20-byte value per block, a trailing partial
    block included: the number of tokens in the block (4 bytes, little-endian) and the
    chain hash up to and including it (``hash_block_tokens`` over the partial block's
    tokens for the last one). Prefill and decode worker compute it from the prompt alike.

    ``full_hashes``: ``hash_block_chain`` of the same arguments, if already computed.
    """
    if full_hashes is None:
        full_hashes = hash_block_chain(token_ids, block_size, root_hash, cache_salt)
    bindings = [block_size.to_bytes(4, "little") + h for h in full_hashes]
    tail = len(token_ids) - len(full_hashes) * block_size
    if tail:
        parent = full_hashes[-1] if full_hashes else root_hash
        extra = cache_salt.encode() if cache_salt else b""
        bindings.append(tail.to_bytes(4, "little")
                        + hash_block_tokens(parent, token_ids[-tail:], extra))
    return bindings
