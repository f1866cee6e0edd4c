// The KV store for CPUs: each new token's key and value rows into their paged cache slots.
// Built on first use by pdserve/kernels/cpu_ext.py.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "cpu_common.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

using pdserve::packed_from;

// key/value [tokens, num_kv_heads, head_dim] (each token's row packed, any token stride)
// into the caches' slots (block_id * block_size + offset; -1 skips the token): slot s is
// row s % block_size of block s / block_size, each cache with its own block stride (each
// block's [block_size, num_kv_heads, head_dim] packed). Slots are checked against the
// cache size.
template <typename index_t>
void store_kv_rows(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                   at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  const int64_t tokens = key.size(0), block_size = key_cache.size(1);
  const int64_t num_slots = key_cache.size(0) * block_size;
  const int64_t row_bytes = key.size(1) * key.size(2) * key.element_size();
  const index_t* slots = slot_mapping.const_data_ptr<index_t>();
  const char* k_src = static_cast<const char*>(key.const_data_ptr());
  const char* v_src = static_cast<const char*>(value.const_data_ptr());
  char* k_dst = static_cast<char*>(key_cache.data_ptr());
  char* v_dst = static_cast<char*>(value_cache.data_ptr());
  const int64_t k_s = key.stride(0) * key.element_size(), v_s = value.stride(0) * value.element_size();
  const int64_t k_block = key_cache.stride(0) * key_cache.element_size();
  const int64_t v_block = value_cache.stride(0) * value_cache.element_size();
  at::parallel_for(0, tokens, std::max<int64_t>(1, (1 << 16) / row_bytes), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;
      TORCH_CHECK(slot < num_slots, "store_kv: slot_mapping[", t, "] = ", slot,
                  " is outside the cache's ", num_slots, " slots");
      const int64_t block = slot / block_size, in_block = (slot - block * block_size) * row_bytes;
      std::memcpy(k_dst + block * k_block + in_block, k_src + t * k_s, row_bytes);
      std::memcpy(v_dst + block * v_block + in_block, v_src + t * v_s, row_bytes);
    }
  });
}

void store_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor key_cache,
              at::Tensor value_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes() && key_cache.dim() == 4 &&
                  value_cache.sizes() == key_cache.sizes() &&
                  key.size(1) == key_cache.size(2) && key.size(2) == key_cache.size(3),
              "store_kv: key/value must be [tokens, num_kv_heads, head_dim] of the caches");
  TORCH_CHECK(packed_from(key_cache, 1) && packed_from(value_cache, 1),
              "store_kv: each cache block's [block_size, num_kv_heads, head_dim] must be "
              "packed (any block stride), got key_cache strides ", key_cache.strides(),
              ", value_cache strides ", value_cache.strides());
  TORCH_CHECK(key.stride(2) == 1 && key.stride(1) == key.size(2) && value.stride(2) == 1 &&
                  value.stride(1) == value.size(2),
              "store_kv: each token's [num_kv_heads, head_dim] row must be packed");
  TORCH_CHECK(key.scalar_type() == key_cache.scalar_type() &&
                  value.scalar_type() == key_cache.scalar_type() &&
                  value_cache.scalar_type() == key_cache.scalar_type(),
              "store_kv: key, value and the caches must share a dtype");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0) &&
                  slot_mapping.is_contiguous(),
              "store_kv: slot_mapping must be contiguous [tokens]");
  if (slot_mapping.scalar_type() == at::kInt) {
    store_kv_rows<int32_t>(key, value, key_cache, value_cache, slot_mapping);
  } else {
    TORCH_CHECK(slot_mapping.scalar_type() == at::kLong, "store_kv: slot_mapping must be int32/int64");
    store_kv_rows<int64_t>(key, value, key_cache, value_cache, slot_mapping);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def(
      "store_kv(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor slot_mapping) -> ()");
  m.impl("store_kv", c10::DispatchKey::CPU, &store_kv);
}
