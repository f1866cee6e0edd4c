"""The KV kernels on the worker's block-major cache: ``storage.permute(1, 2, 0, 3, 4, 5)``
of a contiguous ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` buffer
(engine/model_runner.py), whose layer views ``kv_cache[l, 0]`` have a block stride of all
layers' K and V. The store and the block gather / scatter (reference, C++, Triton) against
plain indexing and the references on layer-major copies, bit for bit.
"""

from __future__ import annotations

import os

import pytest
import torch
from triton_interpreter import (  # NOTE: before pdserve.kernels
    HAS_CUDA,
    TRITON_IMPORTED_EARLY,
    device_params,
)

from pdserve.engine import model_runner
from pdserve.engine.config import ModelConfig
from pdserve.kernels import block_copy, cpu_ext, kv_store
from pdserve.kernels._triton_utils import HAS_TRITON, interpreting

DEVICES = device_params()
# NOTE: as in test_kernels.py, where CI requires the C++ kernels a failed build fails
# these tests rather than skipping them. load() first: the tests call torch.ops directly.
CPU_KERNELS = pytest.mark.skipif(
    not cpu_ext.load() and os.environ.get("PDSERVE_REQUIRE_CPU_KERNELS") != "1",
    reason="the C++ CPU kernels did not build here (no g++/ninja?)")

LAYERS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 3, 4, 2, 8


def block_major(num_blocks: int, dtype=torch.float32, device="cpu", seed: int = 0,
                head_dim: int = HEAD_DIM) -> torch.Tensor:
    """Random ``[LAYERS, 2, num_blocks, BLOCK_SIZE, KV_HEADS, head_dim]`` over block-major
    storage."""
    gen = torch.Generator().manual_seed(seed)
    storage = torch.randn(num_blocks, LAYERS, 2, BLOCK_SIZE, KV_HEADS, head_dim, generator=gen)
    return storage.to(dtype).to(device).permute(1, 2, 0, 3, 4, 5)


def layer_major(num_blocks: int, dtype=torch.float32, device="cpu", seed: int = 0,
                head_dim: int = HEAD_DIM) -> torch.Tensor:
    return block_major(num_blocks, dtype, device, seed, head_dim).contiguous()


def empty_like_layout(packed_shape, dtype, device, layout: str) -> torch.Tensor:
    """A NaN-filled ``[LAYERS, 2, n, ...]`` buffer, layer- or block-major."""
    num_layers, two, n, *block_shape = packed_shape
    if layout == "layer-major":
        return torch.full(packed_shape, float("nan"), dtype=dtype, device=device)
    buf = torch.full((n, num_layers, two, *block_shape), float("nan"), dtype=dtype,
                     device=device)
    return buf.permute(1, 2, 0, 3, 4, 5)


def test_the_block_major_view_has_the_contract_shape_and_strides():
    kv_cache = block_major(5)
    row = BLOCK_SIZE * KV_HEADS * HEAD_DIM
    assert kv_cache.shape == (LAYERS, 2, 5, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    assert kv_cache.stride()[:3] == (2 * row, row, LAYERS * 2 * row)
    assert kv_cache[1, 0].stride() == (LAYERS * 2 * row, KV_HEADS * HEAD_DIM, HEAD_DIM, 1)
    assert not kv_cache.is_contiguous()


# ---- store_kv -------------------------------------------------------------------------


def store_inputs(dtype, device, num_tokens=6):
    """K and V as views of a fused QKV projection, and distinct slots across blocks (-1:
    padding). NOTE: distinct, as a step's are: two tokens writing one slot would race on
    a GPU, where the kernel's programs run in no fixed order."""
    qkv = torch.randn(num_tokens, 3 * KV_HEADS, HEAD_DIM,
                      generator=torch.Generator().manual_seed(3)).to(dtype).to(device)
    key, value = qkv[:, KV_HEADS:2 * KV_HEADS], qkv[:, 2 * KV_HEADS:]
    last = 5 * BLOCK_SIZE - 1
    slots = torch.tensor([BLOCK_SIZE + 3, -1, 0, last, 3 * BLOCK_SIZE + 2, 9][:num_tokens],
                         device=device)
    return key, value, slots


def store_expected(kv_cache, layer, key, value, slots):
    """The reference on a layer-major contiguous copy of the cache, by the per-token loop."""
    expected = kv_cache.cpu().contiguous()
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[layer, 0, slot // BLOCK_SIZE, slot % BLOCK_SIZE] = key[token].cpu()
            expected[layer, 1, slot // BLOCK_SIZE, slot % BLOCK_SIZE] = value[token].cpu()
    return expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_ref_on_a_block_major_cache(dtype):
    kv_cache = block_major(5, dtype)
    key, value, slots = store_inputs(dtype, "cpu")
    expected = store_expected(kv_cache, 1, key, value, slots)
    kv_store.store_kv_ref(key, value, kv_cache[1, 0], kv_cache[1, 1], slots)
    assert torch.equal(kv_cache, expected)  # other layers and blocks untouched
    with pytest.raises(IndexError):
        kv_store.store_kv_ref(key, value, kv_cache[1, 0], kv_cache[1, 1],
                              torch.tensor([0, -1, 20, 1, 2, 3]))


@CPU_KERNELS
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_store_kv_cpu_kernel_on_a_block_major_cache(slot_dtype):
    kv_cache = block_major(5, torch.bfloat16)
    key, value, slots = store_inputs(torch.bfloat16, "cpu")
    slots = slots.to(slot_dtype)
    expected = store_expected(kv_cache, 2, key, value, slots)
    torch.ops.pdserve_cpu.store_kv(key, value, kv_cache[2, 0], kv_cache[2, 1], slots)
    assert torch.equal(kv_cache, expected)
    with pytest.raises(RuntimeError, match=r"slot_mapping\[2\] = 20"):
        kv_store.store_kv(key, value, kv_cache[2, 0], kv_cache[2, 1],
                          torch.tensor([3, -1, 20, 0, 9, 1], dtype=slot_dtype))
    with pytest.raises(RuntimeError, match="packed"):  # a block's rows not packed
        torch.ops.pdserve_cpu.store_kv(key, value, kv_cache[2, 0].transpose(1, 2)
                                       .contiguous().transpose(1, 2), kv_cache[2, 1], slots)


@CPU_KERNELS
def test_store_kv_dispatch_sends_block_major_caches_to_the_cpp_kernel(monkeypatch):
    kv_cache = block_major(5, torch.bfloat16)
    key, value, slots = store_inputs(torch.bfloat16, "cpu")
    expected = store_expected(kv_cache, 0, key, value, slots)
    monkeypatch.setattr(kv_store, "store_kv_ref", None)  # NOTE: fails if the ref is used
    kv_store.store_kv(key.contiguous(), value.contiguous(), kv_cache[0, 0], kv_cache[0, 1],
                      slots)
    assert torch.equal(kv_cache, expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_triton_on_a_block_major_cache(dtype, device):
    kv_cache = block_major(5, dtype, device)
    key, value, slots = store_inputs(dtype, device)
    expected = store_expected(kv_cache, 1, key, value, slots)
    kv_store.store_kv_triton(key, value, kv_cache[1, 0], kv_cache[1, 1], slots.int())
    assert torch.equal(kv_cache.cpu(), expected)
    # Different block strides for K and V: K block-major, V a contiguous cache.
    value_cache = torch.zeros(5, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    kv_store.store_kv_triton(key, value, kv_cache[0, 0], value_cache, slots)
    expected_v = torch.zeros_like(value_cache)
    kv_store.store_kv_ref(key, value, kv_cache[0, 0].clone(), expected_v, slots)
    assert torch.equal(value_cache, expected_v)
    with pytest.raises(ValueError, match="key_cache: last 3 dims"):
        kv_store.store_kv_triton(key, value, kv_cache[0, 0].transpose(1, 2), value_cache, slots)


# ---- gather / scatter ----------------------------------------------------------------

# The variants' name suffixes: gather_blocks{suffix}, scatter_blocks{suffix}.
VARIANTS = ["_ref", pytest.param("_cpu", marks=CPU_KERNELS), "_triton", ""]
LAYOUTS = ["layer-major", "block-major"]


def variant_device(suffix: str) -> str:
    """The device a variant runs on here: the Triton ones on CUDA, or on the CPU under
    the interpreter (skipped where there is neither)."""
    if suffix != "_triton":
        return "cpu"
    if HAS_CUDA:
        return "cuda"
    if TRITON_IMPORTED_EARLY or not (HAS_TRITON and interpreting()):
        pytest.skip("needs CUDA or triton's interpreter")
    return "cpu"


def make(layout: str, num_blocks: int, dtype, device, seed=0, head_dim=HEAD_DIM):
    return (block_major if layout == "block-major" else layer_major)(
        num_blocks, dtype, device, seed, head_dim)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("out_layout", [None, *LAYOUTS])
@pytest.mark.parametrize("cache_layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_blocks_on_block_major_caches_and_buffers(variant, cache_layout, out_layout,
                                                         dtype):
    device = variant_device(variant)
    kv_cache = make(cache_layout, 9, dtype, device)
    block_ids = torch.tensor([5, 0, 8, 3, 6], device=device)
    out = (None if out_layout is None
           else empty_like_layout((LAYERS, 2, 5, BLOCK_SIZE, KV_HEADS, HEAD_DIM), dtype,
                                  device, out_layout))
    packed = getattr(block_copy, "gather_blocks" + variant)(kv_cache, block_ids, out)
    assert torch.equal(packed.cpu(), kv_cache.cpu()[:, :, block_ids.cpu()])
    if out is None:
        assert packed.is_contiguous()
    else:
        assert packed is out


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("src_layout", LAYOUTS)
@pytest.mark.parametrize("cache_layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scatter_blocks_on_block_major_caches_and_buffers(variant, cache_layout, src_layout,
                                                          dtype):
    device = variant_device(variant)
    kv_cache = make(cache_layout, 9, dtype, device)
    src = make(src_layout, 4, dtype, device, seed=5)
    block_ids = torch.tensor([7, 1, 4, 2], device=device)
    expected = kv_cache.cpu().clone()
    expected[:, :, block_ids.cpu()] = src.cpu()
    getattr(block_copy, "scatter_blocks" + variant)(kv_cache, block_ids, src)
    assert torch.equal(kv_cache.cpu(), expected)


@pytest.mark.parametrize("head_dim", [1, 3])
def test_block_copy_refs_on_rows_that_do_not_fit_int64_words(head_dim):
    kv_cache = block_major(6, torch.bfloat16, head_dim=head_dim)
    block_ids = torch.tensor([4, 1])
    assert torch.equal(block_copy.gather_blocks_ref(kv_cache, block_ids),
                       kv_cache[:, :, block_ids])
    src = layer_major(2, torch.bfloat16, seed=2, head_dim=head_dim)
    expected = kv_cache.clone()
    expected[:, :, block_ids] = src
    block_copy.scatter_blocks_ref(kv_cache, block_ids, src)
    assert torch.equal(kv_cache, expected)


@pytest.mark.parametrize("variant", VARIANTS)
def test_one_plane_of_a_block_major_cache(variant):
    """``kv_cache[l:l+1, kv:kv+1]``, one plane as the KV transfer may pass it."""
    device = variant_device(variant)
    kv_cache = block_major(8, torch.bfloat16, device)
    plane = kv_cache[2:3, 1:2]
    block_ids = torch.tensor([6, 2, 3], device=device)
    packed = getattr(block_copy, "gather_blocks" + variant)(plane, block_ids)
    assert torch.equal(packed.cpu(), plane.cpu()[:, :, block_ids.cpu()])
    expected = kv_cache.cpu().clone()
    expected[2:3, 1:2, block_ids.flip(0).cpu()] = packed.cpu()
    getattr(block_copy, "scatter_blocks" + variant)(plane, block_ids.flip(0), packed)
    assert torch.equal(kv_cache.cpu(), expected)


@pytest.mark.parametrize("gather", ["gather_blocks_ref", pytest.param(
    "gather_blocks_cpu", marks=CPU_KERNELS)])
def test_gather_refuses_an_out_with_uneven_planes(gather):
    kv_cache = block_major(6)
    bad = torch.empty(2, LAYERS, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM).transpose(0, 1)
    with pytest.raises(ValueError, match=r"out: expected .*stride\(0\) == size\(1\)"):
        getattr(block_copy, gather)(kv_cache, torch.tensor([1, 2]), bad)


@CPU_KERNELS
def test_cpp_block_copy_refuses_caches_of_other_layouts():
    uneven = torch.zeros(2, LAYERS, 6, BLOCK_SIZE, KV_HEADS, HEAD_DIM).transpose(0, 1)
    packed = torch.zeros(LAYERS, 2, 1, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    with pytest.raises(RuntimeError, match="kv_cache must have stride"):
        torch.ops.pdserve_cpu.gather_block_rows(packed, uneven, torch.tensor([0]))
    strided = layer_major(6).transpose(4, 5)
    with pytest.raises(RuntimeError, match="rows must be packed"):
        torch.ops.pdserve_cpu.scatter_block_rows(strided, torch.tensor([0]),
                                                 packed.transpose(4, 5))


def test_triton_block_copy_names_a_cache_of_another_layout():
    device = variant_device("_triton")
    uneven = torch.zeros(2, LAYERS, 6, BLOCK_SIZE, KV_HEADS, HEAD_DIM,
                         device=device).transpose(0, 1)
    with pytest.raises(ValueError, match="kv_cache: expected"):
        block_copy.gather_blocks_triton(uneven, torch.tensor([0], device=device))
    cache = block_major(6, device=device)
    with pytest.raises(ValueError, match="src: expected"):
        src = torch.zeros(LAYERS, 2, 1, BLOCK_SIZE, HEAD_DIM, KV_HEADS, device=device)
        block_copy.scatter_blocks_triton(cache, torch.tensor([0], device=device),
                                         src.transpose(4, 5))


@CPU_KERNELS
def test_dispatch_sends_block_major_cpu_caches_to_the_cpp_kernels(monkeypatch):
    calls = []
    monkeypatch.setattr(block_copy, "gather_blocks_cpu",
                        lambda *args: calls.append("gather") or block_copy.gather_blocks_ref(*args))
    monkeypatch.setattr(block_copy, "scatter_blocks_cpu",
                        lambda *args: calls.append("scatter") or block_copy.scatter_blocks_ref(*args))
    kv_cache = block_major(6, torch.bfloat16)
    packed = block_copy.gather_blocks(kv_cache, torch.tensor([4, 1]))
    block_copy.scatter_blocks(kv_cache, torch.tensor([0, 5]), packed)
    block_copy.gather_blocks(kv_cache[1:2, 0:1], torch.tensor([4, 1]))
    assert calls == ["gather", "scatter", "gather"]


# ---- the worker's cache --------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_allocate_kv_cache_is_layer_major_over_block_major_storage(monkeypatch, dtype):
    monkeypatch.setattr(model_runner, "load_model", lambda *args: None)  # NOTE: no weights
    config = ModelConfig(
        model="tiny", architecture="LlamaForCausalLM", vocab_size=32, hidden_size=64,
        num_layers=LAYERS, num_heads=4, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
        intermediate_size=128, rms_norm_eps=1e-6, rope_theta=1e4,
        max_position_embeddings=64, max_model_len=64, dtype=dtype)
    runner = model_runner.ModelRunner(config, BLOCK_SIZE, torch.device("cpu"), progress=False)
    runner.allocate_kv_cache(7)
    kv = runner.kv_cache
    assert kv.shape == (LAYERS, 2, 7, BLOCK_SIZE, KV_HEADS, HEAD_DIM) and kv.dtype == dtype
    assert not kv.any()
    by_block = kv.permute(2, 0, 1, 3, 4, 5)  # back to the storage's [num_blocks, L, 2, ...]
    assert by_block.is_contiguous()
    for block in range(7):
        assert by_block[block].is_contiguous()
    block_bytes = model_runner.kv_cache_block_bytes(config, BLOCK_SIZE)
    assert kv.stride(2) * kv.element_size() == block_bytes
    layer = kv[1, 0]  # what the model hands the kernels
    assert layer.stride() == (block_bytes // kv.element_size(), KV_HEADS * HEAD_DIM,
                              HEAD_DIM, 1)
