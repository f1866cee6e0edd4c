"""The router's native hot loop (``cluster/csrc/block_index.cpp``), built on first use like
the CPU kernels (``kernels/cpu_ext.py``: same build-folder lock, CPU and source tags).

- ``hash_chain(token_ids, block_size, root_hash, cache_salt)``: the prompt's chained block
  hashes, byte-identical to ``engine.block_hash.hash_block_chain`` (SHA-256 of OpenSSL,
  about 2 us per block instead of 2.4 us plus the list -> numpy conversion).
- ``BlockIndex(capacity)``: block hash -> the worker slots (small integers below
  ``capacity``) holding it; ``lookup(packed_hashes)`` answers, per slot, how many leading
  blocks of a chain it holds, in O(chain length x capacity / 64), however many workers
  hold a block; ``lookup_tokens`` does it from a prompt's tokens, hashing at most one
  block past the first that no slot continues to.
- ``role_view(arrays)``: the scoring of one role's routing arrays, admission masks
  included, one call per choice (``router/route.py``).

The build needs a C++ compiler, ninja and OpenSSL's ``libcrypto`` (``-lcrypto``); a small
pybind11-only source, it compiles in well under a minute.
"""

from __future__ import annotations

import threading
from pathlib import Path

from pdserve.kernels.cpu_ext import _build_folder_lock, _cpu_tag, _source_tag

_CSRC = Path(__file__).resolve().parent / "csrc"
_lock = threading.Lock()
HASH_BYTES = 16


_built = None  # the module, or the exception its build raised (not retried)


def _module():
    """The built extension module (built on the first call, then cached on disk).

    Raises:
        RuntimeError, OSError, ImportError: the build failed (the same error each call).
    """
    global _built
    if _built is None:
        with _lock:
            if _built is None:
                try:
                    _built = _build()
                except (RuntimeError, OSError, ImportError) as exc:
                    _built = exc
    if isinstance(_built, Exception):
        raise _built
    return _built


def _build():
    from torch.utils import cpp_extension

    name = f"pdserve_block_index_{_cpu_tag()}_{_source_tag(_CSRC)}"
    with _build_folder_lock(name):
        return cpp_extension.load(
            name=name, sources=[str(_CSRC / "block_index.cpp")],
            extra_cflags=["-O3", "-march=native", "-ffp-contract=off"], extra_ldflags=["-lcrypto"],
            is_python_module=True, verbose=False)


def load() -> None:
    """Build (once per checkout and kind of CPU) and load the extension.

    Raises:
        RuntimeError, OSError, ImportError: the build failed (no compiler, no OpenSSL).
    """
    _module()


def hash_chain(token_ids, block_size: int, root_hash: bytes,
               cache_salt: str | None = None) -> list[bytes]:
    """The 16-byte hashes of every full block of ``token_ids`` (a list of ints or an int64
    array), as ``engine.block_hash.hash_block_chain`` computes them."""
    salt = cache_salt.encode() if cache_salt else b""
    return _module().hash_chain(token_ids, block_size, root_hash, salt)


def hash_chain_packed(token_ids, block_size: int, root_hash: bytes,
                      cache_salt: str | None = None) -> bytes:
    """``hash_chain`` as one ``bytes`` of 16 bytes per block (what ``BlockIndex`` takes)."""
    salt = cache_salt.encode() if cache_salt else b""
    return _module().hash_chain_packed(token_ids, block_size, root_hash, salt)


def new_block_index(capacity: int):
    """A native ``BlockIndex`` of ``capacity`` worker slots. Its methods (``packed``: bytes,
    16 per hash; only the first 8 bytes of each are keys):

    - ``add(slot, packed) -> int`` / ``remove(slot, packed) -> int``: hashes new to /
      removed from the slot;
    - ``remove_slot(slot) -> int``: forget every block of a slot, O(its blocks);
    - ``replace(slot, packed) -> int``: ``remove_slot`` then ``add`` in one call (no
      lookup sees the slot in between); the slot's blocks after it;
    - ``lookup(packed) -> numpy int32 [capacity]``: leading blocks held per slot;
    - ``lookup_tokens(token_ids, block_size, root, salt) -> (num_blocks, counts)``: the
      prompt's full blocks and ``lookup`` of its chain (``salt``: bytes), hashing at most
      one block past the first that no slot continues to (tokens past that are not
      read: ints or an int64 array expected);
    - ``num_blocks(slot)``, ``num_hashes()``, ``capacity()``.

    Calls hold the GIL, so one index may be shared by threads.

    Raises:
        ValueError: ``capacity`` <= 0, or ``packed`` not a multiple of 16 bytes;
        IndexError: a slot outside ``[0, capacity)``.
    """
    return _module().BlockIndex(capacity)


def packed(hashes) -> bytes:
    """Concatenate 16-byte hashes."""
    return b"".join(hashes)


def role_view(table, healthy, inflight, others, slots):
    """The native scoring of one role's routing arrays (``router/route.py``'s
    ``RoleArrays``), held by reference (the arrays must stay the same objects, written in
    place): ``table`` float64 [4, n] (KV usage, running, waiting, routed), ``healthy``
    bool [n], ``inflight`` and ``others`` float64 [n], ``slots`` int64 [n]. Its methods,
    one call per choice, compute the live and admission masks as ``RoleArrays.live`` and
    ``below_caps`` do and choose as ``routing_policy`` does:

    - ``decode(counts, exclude, admit, max_inflight, max_kv_usage, block_size,
      num_tokens, min_cached, rotation) -> int``;
    - ``prefill(counts, exclude, admit, max_inflight, apart, choose, round_robin,
      num_blocks, overlap_weight, waiting_blocks, running_blocks, kv_usage_blocks,
      rotation) -> int``.

    ``counts``: int32 leading blocks per index slot (empty: none); ``exclude``: uint8 [n]
    or empty; ``apart``: uint8 [n] (may prefill for the decode worker) or empty (any);
    ``rotation``: an iterator of ints, advanced once when a choice is made. A result is a
    position >= 0, or ``NO_LIVE``, ``ALL_FULL`` (live workers, all at their caps),
    ``SHORT`` (``choose`` false) or ``NONE_APART`` (module constants, < 0).

    Raises:
        ValueError: arrays of the wrong shape or dtype;
        RuntimeError, OSError, ImportError: the extension could not be built.
    """
    return _module().RoleView(table, healthy, inflight, others, slots)


def scoring():
    """The native module, for its scoring functions ``choose_decode`` and
    ``choose_prefill`` (``router/route.py`` calls them; the rules of
    ``router/routing_policy.py``)."""
    return _module()
