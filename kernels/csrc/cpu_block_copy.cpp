// Block gather / scatter for KV transfer on CPUs (pdserve/kernels/block_copy.py): one
// memcpy per block row, no per-element work; built on first use by
// pdserve/kernels/cpu_ext.py.
//
// A contiguous cache [num_layers, 2, num_blocks, block...] is num_layers * 2 planes of
// num_blocks rows of row_bytes each (a row: one block of one layer's K or V, e.g.
// 16 * 4 * 64 bf16 = 8 KiB). The packed buffer [num_layers, 2, n, block...] has the same
// planes with n rows. The first two dims may be any sizes (one plane: [1, 1, ...]). Gather copies cache row block_ids[i] of each plane to packed row i;
// scatter the reverse. Bytes are copied as they are, so any dtype works (the caller
// casts). Rows are split over torch's intra-op threads; small copies stay on one thread.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kGrainBytes = 1 << 20;  // below this many bytes per task: one thread

struct RowCopy {
  int64_t planes;      // num_layers * 2
  int64_t num_blocks;  // rows per plane in the cache
  int64_t n;           // rows per plane in the packed buffer (block_ids.size(0))
  int64_t row_bytes;
};

// Checks shapes, dtypes and ids; returns the geometry. `packed` is [L, 2, n, block...].
RowCopy check(const at::Tensor& cache, const at::Tensor& packed, const at::Tensor& block_ids,
              const char* op) {
  TORCH_CHECK(cache.device().is_cpu() && packed.device().is_cpu() && block_ids.device().is_cpu(),
              op, ": all tensors must be on the CPU");
  TORCH_CHECK(cache.dim() == 6, op,
              ": kv_cache must be [num_layers, 2, num_blocks, block_size, num_kv_heads, "
              "head_dim], got ", cache.sizes());
  TORCH_CHECK(cache.is_contiguous() && packed.is_contiguous(), op,
              ": kv_cache and the packed buffer must be contiguous");
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
  const int64_t num_blocks = cache.size(2);
  const int64_t* ids = block_ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(ids[i] >= 0 && ids[i] < num_blocks, op, ": block id ", ids[i],
                " out of range [0, ", num_blocks, ")");
  }
  const int64_t row_bytes =
      cache.size(3) * cache.size(4) * cache.size(5) * static_cast<int64_t>(cache.element_size());
  return {cache.size(0) * cache.size(1), num_blocks, n, row_bytes};
}

// Copies every (plane, i) row: packed row (plane, i) <-> cache row (plane, ids[i]).
template <bool kGather>
void copy_rows(char* cache, char* packed, const int64_t* ids, const RowCopy& g) {
  const int64_t total_rows = g.planes * g.n;
  if (total_rows == 0 || g.row_bytes == 0) return;
  const int64_t grain = std::max<int64_t>(1, kGrainBytes / g.row_bytes);
  at::parallel_for(0, total_rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t plane = r / g.n;
      const int64_t i = r - plane * g.n;
      char* cache_row = cache + (plane * g.num_blocks + ids[i]) * g.row_bytes;
      char* packed_row = packed + r * g.row_bytes;
      if (kGather) {
        std::memcpy(packed_row, cache_row, g.row_bytes);
      } else {
        std::memcpy(cache_row, packed_row, g.row_bytes);
      }
    }
  });
}

// out[:, :, i] = kv_cache[:, :, block_ids[i]]
void gather_block_rows(at::Tensor out, const at::Tensor& kv_cache, const at::Tensor& block_ids) {
  const RowCopy g = check(kv_cache, out, block_ids, "gather_block_rows");
  copy_rows<true>(static_cast<char*>(kv_cache.data_ptr()), static_cast<char*>(out.data_ptr()),
                  block_ids.data_ptr<int64_t>(), g);
}

// kv_cache[:, :, block_ids[i]] = src[:, :, i]; ids must be distinct (else the last wins,
// or any, across threads).
void scatter_block_rows(at::Tensor kv_cache, const at::Tensor& block_ids, const at::Tensor& src) {
  const RowCopy g = check(kv_cache, src, block_ids, "scatter_block_rows");
  copy_rows<false>(static_cast<char*>(kv_cache.data_ptr()), static_cast<char*>(src.data_ptr()),
                   block_ids.data_ptr<int64_t>(), g);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("gather_block_rows(Tensor(a!) out, Tensor kv_cache, Tensor block_ids) -> ()");
  m.impl("gather_block_rows", c10::DispatchKey::CPU, &gather_block_rows);
  m.def("scatter_block_rows(Tensor(a!) kv_cache, Tensor block_ids, Tensor src) -> ()");
  m.impl("scatter_block_rows", c10::DispatchKey::CPU, &scatter_block_rows);
}
