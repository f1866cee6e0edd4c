"""Per-position random seeds: a seeded request draws each token from a generator keyed by
(its seed, the token's output index), so it gets the same tokens on any worker, in any
batch (``engine/sampler.py``, ``engine/spec_decode.py``; docs/architecture.md)."""

from __future__ import annotations

_MASK64 = (1 << 64) - 1


def position_seed(seed: int, index: int) -> int:
    """Mix a request's seed and a token index into a 63-bit generator seed (splitmix64)."""
    z = (seed * 0x9E3779B97F4A7C15 + index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)
