// Block gather / scatter for KV transfer on CPUs (pdserve/kernels/block_copy.py): one
// memcpy per block row, no per-element work; built on first use by
// pdserve/kernels/cpu_ext.py.
//
// A cache [num_layers, 2, num_blocks, block...] is num_layers * 2 planes (plane
// layer * 2 + kv) of num_blocks rows of row_bytes each (a row: one block of one layer's K
// or V, e.g. 16 * 4 * 64 bf16 = 8 KiB). The packed buffer [num_layers, 2, n, block...]
// has the same planes with n rows. The first two dims may be any sizes (one plane:
// [1, 1, ...]). Either tensor may have any plane stride and any block stride as long as
// its planes are evenly spaced (stride(0) == size(1) * stride(1)) and each row is packed:
// layer-major (contiguous) and block-major (a block's rows of all planes together, the
// worker's cache: a permuted [num_blocks, num_layers, 2, block...] tensor) both fit.
// Gather copies cache row block_ids[i] of each plane to packed row i; scatter the
// reverse: one memcpy per (block, plane) row, or one per block of all planes where both
// sides are block-major (plane stride == row). Bytes are copied as they are, so any dtype
// works (the caller casts). The copies run on the calling thread alone: a KV transfer's
// threads are not the engine's, and an OpenMP team started on one of them would outlive
// the copy and outnumber the CPUs with the engine's team, which then stops spinning at
// its barriers (see AsyncEngine.build); a memcpy-bound copy gains little from a second
// thread on cores the engine is using anyway.

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

namespace {

struct Side {
  char* base;
  int64_t plane;  // bytes between consecutive planes (layer * 2 + kv)
  int64_t block;  // bytes between consecutive blocks of a plane
};

struct RowCopy {
  int64_t planes;  // num_layers * 2
  int64_t n;       // rows per plane in the packed buffer (block_ids.size(0))
  int64_t row_bytes;
  Side cache, packed;
};

// The strides of a 6-D [L, K, N, block...] tensor named `name`; fails unless its block
// rows are packed and its planes evenly spaced. Size-1 dims may have any stride.
Side side(const at::Tensor& t, const char* name, const char* op) {
  int64_t expected = 1;
  for (int64_t d = 5; d >= 3; --d) {
    TORCH_CHECK(t.size(d) <= 1 || t.stride(d) == expected, op, ": ", name,
                "'s [block_size, num_kv_heads, head_dim] rows must be packed, got strides ",
                t.strides());
    expected *= t.size(d);
  }
  int64_t plane = t.stride(0);
  if (t.size(1) > 1) {
    plane = t.stride(1);
    TORCH_CHECK(t.size(0) <= 1 || t.stride(0) == t.size(1) * t.stride(1), op, ": ", name,
                " must have stride(0) == size(1) * stride(1) (evenly spaced planes), got "
                "strides ", t.strides());
  }
  const int64_t itemsize = static_cast<int64_t>(t.element_size());
  return {static_cast<char*>(t.data_ptr()), plane * itemsize, t.stride(2) * itemsize};
}

// Checks shapes, dtypes, strides and ids; returns the geometry. `packed` is
// [L, 2, n, block...].
RowCopy check(const at::Tensor& cache, const at::Tensor& packed, const at::Tensor& block_ids,
              const char* op) {
  TORCH_CHECK(cache.device().is_cpu() && packed.device().is_cpu() && block_ids.device().is_cpu(),
              op, ": all tensors must be on the CPU");
  TORCH_CHECK(cache.dim() == 6, op,
              ": kv_cache must be [num_layers, 2, num_blocks, block_size, num_kv_heads, "
              "head_dim], got ", cache.sizes());
  TORCH_CHECK(packed.scalar_type() == cache.scalar_type(), op,
              ": the packed buffer must have kv_cache's dtype ", cache.scalar_type(), ", got ",
              packed.scalar_type());
  TORCH_CHECK(block_ids.dim() == 1 && block_ids.scalar_type() == at::kLong &&
                  block_ids.is_contiguous(),
              op, ": block_ids must be a contiguous 1-D int64 tensor");
  const int64_t n = block_ids.size(0);
  TORCH_CHECK(packed.dim() == 6 && packed.size(0) == cache.size(0) &&
                  packed.size(1) == cache.size(1) &&
                  packed.size(2) == n && packed.size(3) == cache.size(3) &&
                  packed.size(4) == cache.size(4) && packed.size(5) == cache.size(5),
              op, ": the packed buffer must be ", cache.size(0), " x ", cache.size(1), " x ", n,
              " blocks of kv_cache's block shape, got ", packed.sizes());
  const Side cache_side = side(cache, "kv_cache", op);
  const Side packed_side = side(packed, "the packed buffer", op);
  const int64_t num_blocks = cache.size(2);
  const int64_t* ids = block_ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(ids[i] >= 0 && ids[i] < num_blocks, op, ": block id ", ids[i],
                " out of range [0, ", num_blocks, ")");
  }
  const int64_t row_bytes =
      cache.size(3) * cache.size(4) * cache.size(5) * static_cast<int64_t>(cache.element_size());
  return {cache.size(0) * cache.size(1), n, row_bytes, cache_side, packed_side};
}

template <bool kGather>
inline void copy(char* cache, char* packed, int64_t bytes) {
  if (kGather) {
    std::memcpy(packed, cache, bytes);
  } else {
    std::memcpy(cache, packed, bytes);
  }
}

// Copies every (plane, i) row: packed row (plane, i) <-> cache row (plane, ids[i]).
template <bool kGather>
void copy_rows(const RowCopy& g, const int64_t* ids) {
  if (g.planes * g.n == 0 || g.row_bytes == 0) return;
  const Side& c = g.cache;
  const Side& p = g.packed;
  if (g.planes == 1 || (c.plane == g.row_bytes && p.plane == g.row_bytes)) {
    // Block-major on both sides: a block's rows of all planes are one run on each.
    const int64_t bytes = g.planes * g.row_bytes;
    for (int64_t i = 0; i < g.n; ++i)
      copy<kGather>(c.base + ids[i] * c.block, p.base + i * p.block, bytes);
    return;
  }
  // NOTE: a block-major cache is walked block by block (its rows of a block lie
  // together), a layer-major one plane by plane.
  const bool block_outer = c.plane < c.block;
  for (int64_t r = 0; r < g.planes * g.n; ++r) {
    const int64_t plane = block_outer ? r % g.planes : r / g.n;
    const int64_t i = block_outer ? r / g.planes : r % g.n;
    copy<kGather>(c.base + plane * c.plane + ids[i] * c.block,
                  p.base + plane * p.plane + i * p.block, g.row_bytes);
  }
}

// out[:, :, i] = kv_cache[:, :, block_ids[i]]
void gather_block_rows(at::Tensor out, const at::Tensor& kv_cache, const at::Tensor& block_ids) {
  const RowCopy g = check(kv_cache, out, block_ids, "gather_block_rows");
  copy_rows<true>(g, block_ids.data_ptr<int64_t>());
}

// kv_cache[:, :, block_ids[i]] = src[:, :, i]; ids must be distinct (else the last wins).
void scatter_block_rows(at::Tensor kv_cache, const at::Tensor& block_ids, const at::Tensor& src) {
  const RowCopy g = check(kv_cache, src, block_ids, "scatter_block_rows");
  copy_rows<false>(g, block_ids.data_ptr<int64_t>());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("gather_block_rows(Tensor(a!) out, Tensor kv_cache, Tensor block_ids) -> ()");
  m.impl("gather_block_rows", c10::DispatchKey::CPU, &gather_block_rows);
  m.def("scatter_block_rows(Tensor(a!) kv_cache, Tensor block_ids, Tensor src) -> ()");
  m.impl("scatter_block_rows", c10::DispatchKey::CPU, &scatter_block_rows);
}
