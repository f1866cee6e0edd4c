"""The C++ CPU block gather / scatter (kernels/csrc/cpu_block_copy.cpp) against the
PyTorch references, bit for bit."""

from __future__ import annotations

import os

import pytest
import torch
import triton_interpreter  # noqa: F401  NOTE: before pdserve.kernels, see its docstring

from pdserve.kernels import block_copy, cpu_ext

# NOTE: as in test_kernels.py, where CI requires the C++ kernels a failed build fails these
# tests rather than skipping them.
pytestmark = pytest.mark.skipif(
    os.environ.get("PDSERVE_REQUIRE_CPU_KERNELS") != "1" and not cpu_ext.load(),
    reason="the C++ CPU kernels did not build")

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def make_cache(num_blocks: int, dtype: torch.dtype, block_size: int = 16,
               seed: int = 0) -> torch.Tensor:
    """``[num_layers=3, 2, num_blocks, block_size, num_kv_heads=2, head_dim=64]``."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(3, 2, num_blocks, block_size, 2, 64, generator=gen).to(dtype)


def random_ids(num_blocks: int, n: int, seed: int) -> torch.Tensor:
    return torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))[:n]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 16])
def test_gather_matches_the_reference(dtype, block_size):
    kv_cache = make_cache(40, dtype, block_size)
    for seed, n in [(1, 17), (2, 40), (3, 1)]:
        block_ids = random_ids(40, n, seed)
        packed = block_copy.gather_blocks_cpu(kv_cache, block_ids)
        assert packed.is_contiguous() and packed.shape == (3, 2, n, block_size, 2, 64)
        torch.testing.assert_close(packed, block_copy.gather_blocks_ref(kv_cache, block_ids),
                                   rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_scatter_matches_the_reference(dtype):
    block_ids = random_ids(40, 23, seed=4)
    src = make_cache(23, dtype, seed=5)
    expected, got = make_cache(40, dtype), make_cache(40, dtype)
    block_copy.scatter_blocks_ref(expected, block_ids, src)
    block_copy.scatter_blocks_cpu(got, block_ids, src)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_scatter_casts_src_to_the_cache_dtype():
    block_ids = torch.tensor([7, 0, 3])
    src = make_cache(3, torch.float32, seed=6)
    expected, got = make_cache(8, torch.bfloat16), make_cache(8, torch.bfloat16)
    block_copy.scatter_blocks_ref(expected, block_ids, src)
    block_copy.scatter_blocks_cpu(got, block_ids, src)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_empty_ids_copy_nothing():
    kv_cache = make_cache(5, torch.bfloat16)
    before = kv_cache.clone()
    empty = block_copy.gather_blocks_cpu(kv_cache, torch.tensor([], dtype=torch.int64))
    assert empty.shape == (3, 2, 0, 16, 2, 64)
    block_copy.scatter_blocks_cpu(kv_cache, torch.tensor([], dtype=torch.int64), empty)
    assert torch.equal(kv_cache, before)


def test_out_of_range_and_bad_ids_are_refused():
    kv_cache = make_cache(5, torch.float32)
    with pytest.raises(RuntimeError, match="out of range"):
        block_copy.gather_blocks_cpu(kv_cache, torch.tensor([1, 5]))
    with pytest.raises(RuntimeError, match="out of range"):
        block_copy.scatter_blocks_cpu(kv_cache, torch.tensor([-1]), make_cache(1, torch.float32))
    with pytest.raises(ValueError, match="block_ids"):
        block_copy.gather_blocks_cpu(kv_cache, torch.tensor([1.0]))
    with pytest.raises(RuntimeError, match="packed buffer"):
        block_copy.scatter_blocks_cpu(kv_cache, torch.tensor([1, 2]), make_cache(3, torch.float32))


def test_dispatch_sends_contiguous_cpu_caches_to_the_cpp_kernels(monkeypatch):
    calls = []
    monkeypatch.setattr(block_copy, "gather_blocks_cpu",
                        lambda *args: calls.append("gather") or block_copy.gather_blocks_ref(*args))
    monkeypatch.setattr(block_copy, "scatter_blocks_cpu",
                        lambda *args: calls.append("scatter") or block_copy.scatter_blocks_ref(*args))
    kv_cache = make_cache(6, torch.bfloat16)
    block_ids = torch.tensor([4, 1])
    packed = block_copy.gather_blocks(kv_cache, block_ids)
    block_copy.scatter_blocks(kv_cache, block_ids.flip(0), packed)
    assert calls == ["gather", "scatter"]
    calls.clear()
    strided = kv_cache.transpose(3, 4)  # not contiguous: the reference serves
    block_copy.gather_blocks(strided, block_ids)
    assert calls == []


def test_one_plane_views_as_the_kv_transfer_passes_them():
    kv_cache = make_cache(12, torch.bfloat16)
    block_ids = random_ids(12, 5, seed=7)
    plane = kv_cache[1:2, 0:1]  # [1, 1, num_blocks, ...]: layer 1's K
    packed = block_copy.gather_blocks_cpu(plane, block_ids)
    torch.testing.assert_close(packed, block_copy.gather_blocks_ref(plane, block_ids),
                               rtol=0, atol=0)
    expected = kv_cache.clone()
    block_copy.scatter_blocks_ref(expected[1:2, 0:1], block_ids.flip(0), packed)
    block_copy.scatter_blocks_cpu(plane, block_ids.flip(0), packed)
    torch.testing.assert_close(kv_cache, expected, rtol=0, atol=0)


@pytest.mark.parametrize("gather", ["gather_blocks_cpu", "gather_blocks_ref", "gather_blocks"])
def test_gather_into_a_given_buffer_writes_and_returns_it(gather):
    kv_cache = make_cache(20, torch.bfloat16)
    block_ids = random_ids(20, 6, seed=8)
    out = torch.full((3, 2, 6, 16, 2, 64), 7.0, dtype=torch.bfloat16)
    got = getattr(block_copy, gather)(kv_cache, block_ids, out)
    assert got is out
    torch.testing.assert_close(out, block_copy.gather_blocks_ref(kv_cache, block_ids),
                               rtol=0, atol=0)


@pytest.mark.parametrize("gather", ["gather_blocks_cpu", "gather_blocks_ref"])
def test_gather_refuses_an_out_that_does_not_fit(gather):
    kv_cache = make_cache(20, torch.bfloat16)
    block_ids = random_ids(20, 6, seed=8)
    bad = [torch.empty(3, 2, 5, 16, 2, 64, dtype=torch.bfloat16),  # wrong block count
           torch.empty(3, 2, 6, 16, 2, 64, dtype=torch.float32),  # wrong dtype
           torch.empty(3, 2, 6, 16, 64, 2, dtype=torch.bfloat16).transpose(4, 5)]  # strided
    for out in bad:
        with pytest.raises(ValueError, match="out"):
            getattr(block_copy, gather)(kv_cache, block_ids, out)
