"""Grouped expert MLPs of a sparse MoE block (``kernels/moe.py``): the C++ CPU kernel and
the Triton kernel (under triton's interpreter on CPU, on the GPU where one is lent) against
the loop-over-experts reference, on odd shapes: token counts that are multiples of
nothing, experts with no tokens, one token, top-1 and top-k > 2, widths off the tiles."""

from __future__ import annotations

import os

import pytest
import torch
from triton_interpreter import device_params  # NOTE: before pdserve.kernels

from pdserve.kernels import cpu_ext, moe
from pdserve.kernels._triton_utils import HAS_TRITON

DEVICES = device_params()
CPU_KERNELS = pytest.mark.skipif(
    os.environ.get("PDSERVE_REQUIRE_CPU_KERNELS") != "1" and not cpu_ext.load(),
    reason="the C++ CPU kernels did not build here (no g++/ninja?)")
# (tokens, hidden, expert intermediate, experts, top-k)
CASES = [(1, 64, 32, 4, 2), (7, 48, 40, 8, 1), (37, 72, 24, 8, 3), (130, 64, 48, 6, 2)]


def make_case(tokens, hidden, inter, experts, top_k, dtype=torch.float32, seed=0,
              skip_expert=True):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5
    # each token's k distinct experts, never the last one (an expert with no tokens)
    pool = experts - 1 if skip_expert and experts > top_k else experts
    ids = torch.stack([torch.randperm(pool, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen)
    weights = weights / weights.sum(-1, keepdim=True)
    return x.to(dtype), ids, weights, w13.to(dtype), w2.to(dtype)


def naive(x, ids, weights, w13, w2):
    """Token by token, slot by slot, in fp64: the definition."""
    inter = w13.shape[1] // 2
    x, w13, w2 = x.double(), w13.double(), w2.double()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w13[e] @ x[t]
            out[t] += float(weights[t, j]) * (w2[e] @ (torch.nn.functional.silu(h[:inter])
                                                       * h[inter:]))
    return out


@pytest.mark.parametrize("case", CASES)
def test_reference_is_the_definition(case):
    args = make_case(*case)
    torch.testing.assert_close(moe.moe_ref(*args).double(), naive(*args), atol=1e-5,
                               rtol=1e-5)


@CPU_KERNELS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_cpu_kernel_matches_reference(case, dtype):
    x, ids, weights, w13, w2 = make_case(*case, dtype=dtype)
    expected = moe.moe_ref(x, ids, weights, w13, w2)
    for topk_ids in (ids, ids.int()):
        got = torch.ops.pdserve_cpu.moe_grouped(x, topk_ids, weights, w13, w2)
        assert got.dtype == dtype and got.shape == x.shape
        if dtype == torch.float32:
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        else:  # NOTE: the same bf16 roundings; only the fp32 summation order differs
            torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(moe.fused_moe(x, ids, weights, w13, w2),
                       torch.ops.pdserve_cpu.moe_grouped(x, ids, weights, w13, w2))


@CPU_KERNELS
@pytest.mark.parametrize("case", [CASES[2], CASES[3]])  # experts in parallel; in turn
def test_cpu_kernel_runs_in_inference_mode(case):
    """The engine's steps run under ``torch.inference_mode``: the kernel's worker threads
    take the caller's mode."""
    x, ids, weights, w13, w2 = make_case(*case)
    expected = moe.moe_ref(x, ids, weights, w13, w2)
    w13, w2 = torch.nn.Parameter(w13), torch.nn.Parameter(w2)
    with torch.inference_mode():
        got = moe.fused_moe(x.clone(), ids.clone(), weights.clone(), w13, w2)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@CPU_KERNELS
def test_cpu_kernel_handles_no_tokens_and_rejects_bad_ids():
    x, ids, weights, w13, w2 = make_case(3, 32, 16, 4, 2)
    empty = torch.ops.pdserve_cpu.moe_grouped(x[:0], ids[:0], weights[:0], w13, w2)
    assert empty.shape == (0, 32)
    with pytest.raises(RuntimeError, match="topk_ids out of"):
        torch.ops.pdserve_cpu.moe_grouped(x, ids + 4, weights, w13, w2)
    with pytest.raises(ValueError, match="w2"):
        moe.fused_moe(x, ids, weights, w13, w2[:, :, :8])


def test_align_by_expert_pads_each_expert_to_whole_blocks():
    from pdserve.kernels.moe_triton import align_by_expert

    ids = torch.tensor([[2, 0], [2, 3], [0, 2], [3, 2], [2, 0]])
    rows, block_expert = align_by_expert(ids, 5, 4)
    flat = ids.reshape(-1)
    # expert 0: rows 1, 4, 9; expert 2: rows 0, 2, 5, 7, 8 (two blocks); expert 3: 3, 6
    assert block_expert.tolist()[:4] == [0, 2, 2, 3]
    assert all(b == -1 for b in block_expert.tolist()[4:])
    assert rows[:16].tolist() == [1, 4, 9, 10, 0, 2, 5, 7, 8, 10, 10, 10, 3, 6, 10, 10]
    assert sorted(r for r in rows.tolist() if r < 10) == list(range(10))
    for block, expert in enumerate(block_expert.tolist()):
        for r in rows[block * 4:(block + 1) * 4].tolist():
            assert r == 10 or flat[r] == expert


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES[:3] + [(20, 40, 72, 5, 5)])
def test_triton_kernel_matches_reference(case, device):
    from pdserve.kernels.moe_triton import fused_moe_triton

    x, ids, weights, w13, w2 = (t.to(device) for t in make_case(*case))
    got = fused_moe_triton(x, ids, weights, w13, w2)
    torch.testing.assert_close(got, moe.moe_ref(x, ids, weights, w13, w2), atol=1e-5,
                               rtol=1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", CASES)
def test_triton_kernel_bf16_on_cuda(case):
    x, ids, weights, w13, w2 = (t.cuda() for t in make_case(*case, dtype=torch.bfloat16))
    got = moe.fused_moe(x, ids, weights, w13, w2)
    torch.testing.assert_close(got.float(), moe.moe_ref(x, ids, weights, w13, w2).float(),
                               atol=2e-2, rtol=2e-2)
