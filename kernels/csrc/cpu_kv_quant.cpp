// The KV store into a quantized cache (int8, fp8 e4m3fn / e5m2) for CPUs, built on first
// use by pdserve/kernels/cpu_ext.py; the reference is store_kv_quant_ref
// (pdserve/kernels/kv_quant.py), whose bytes this kernel writes exactly.
//
// A step's tokens are grouped by block (sorted by slot), then one task per (block, kv
// head, K or V) on torch's intra-op threads:
//   old   = the block's scale, or 0 when the write starts at slot 0 (its first write)
//   new   = max(old, absmax(new rows) / qmax)
//   rows [0, start) requantized, round(q * old / new), where new > old
//   new rows stored as round(x / new)   (x / 1 where new is 0: a block of zeros)
// No two tasks write the same bytes, so there is no race however many of a step's
// tokens share a block.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "cpu_common.h"
#include "cpu_kv_quant.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using pdserve::Quant;
using pdserve::packed_from;

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PDSERVE_STORE_AVX512 1

// Sixteen floats (x / divisor, already divided) to their elements, as Quant<q_t>::narrow.
template <typename q_t>
inline __m128i encode16(__m512 x) {
  if constexpr (std::is_same_v<q_t, int8_t>) {
    __m512 r = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    r = _mm512_min_ps(_mm512_max_ps(r, _mm512_set1_ps(-127.0f)), _mm512_set1_ps(127.0f));
    return _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(r));
  } else {
    constexpr bool kE4M3 = std::is_same_v<q_t, c10::Float8_e4m3fn>;
    constexpr int kMant = kE4M3 ? 3 : 2, kBias = kE4M3 ? 7 : 15, kDrop = 23 - kMant;
    const float min_normal = kE4M3 ? 0x1p-6f : 0x1p-14f, steps = kE4M3 ? 0x1p9f : 0x1p16f;
    const __m512 qmax = _mm512_set1_ps(Quant<q_t>::qmax);
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_sub_ps(_mm512_setzero_ps(), qmax)), qmax);
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i magnitude_bits = _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF));
    const __m512 magnitude = _mm512_castsi512_ps(magnitude_bits);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(magnitude_bits, kDrop),
                                         _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(magnitude_bits, _mm512_set1_epi32((1 << (kDrop - 1)) - 1)),
                         odd),
        kDrop);
    const __m512i normal = _mm512_sub_epi32(rounded, _mm512_set1_epi32((127 - kBias) << kMant));
    const __m512i subnormal = _mm512_cvtps_epi32(_mm512_roundscale_ps(
        _mm512_mul_ps(_mm512_min_ps(magnitude, _mm512_set1_ps(min_normal)), _mm512_set1_ps(steps)),
        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const __mmask16 is_normal = _mm512_cmp_ps_mask(magnitude, _mm512_set1_ps(min_normal), _CMP_GE_OQ);
    const __m512i code = _mm512_or_si512(_mm512_mask_blend_epi32(is_normal, subnormal, normal),
                                         _mm512_slli_epi32(_mm512_srli_epi32(bits, 31), 7));
    return _mm512_cvtepi32_epi8(code);
  }
}

// dst[0..n) = narrow(src[0..n) * multiplier / divisor) (multiplier 1: no product).
template <typename q_t>
inline void encode_row(const float* src, float multiplier, float divisor, q_t* dst, int64_t n) {
  const __m512 m = _mm512_set1_ps(multiplier), d = _mm512_set1_ps(divisor);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mask = static_cast<__mmask16>((1u << std::min<int64_t>(16, n - i)) - 1);
    __m512 x = _mm512_maskz_loadu_ps(mask, src + i);
    if (multiplier != 1.0f) x = _mm512_mul_ps(x, m);
    _mm_mask_storeu_epi8(reinterpret_cast<char*>(dst + i), mask, encode16<q_t>(_mm512_div_ps(x, d)));
  }
}
#endif

// One cache (K or V) of one layer and its new rows.
template <typename in_t, typename q_t>
struct QuantStore {
  const in_t* rows;  // [tokens, num_kv_heads, head_dim], token stride row_stride
  int64_t row_stride;
  q_t* cache;  // [num_blocks, block_size, num_kv_heads, head_dim], block stride block_stride
  int64_t block_stride;
  float* scales;  // [num_blocks, num_kv_heads], block stride scale_stride
  int64_t scale_stride;
  int64_t block_size, num_kv_heads, head_dim;

  // Tokens tokens[0..n) of the step write rows offsets[0..n) (ascending) of `block`.
  void store_block(int64_t block, int64_t head, const int64_t* tokens, const int64_t* offsets,
                   int64_t n, std::vector<float>& x) const {
    const int64_t d_len = head_dim, row = num_kv_heads * head_dim;
    x.resize(n * d_len);
    float absmax = 0.0f;
    for (int64_t i = 0; i < n; ++i) {
      pdserve::load_as_float(rows + tokens[i] * row_stride + head * d_len, x.data() + i * d_len,
                             d_len);
    }
#pragma omp simd reduction(max : absmax)
    for (int64_t j = 0; j < n * d_len; ++j) absmax = std::max(absmax, std::fabs(x[j]));
    float* scale = scales + block * scale_stride + head;
    const int64_t start = offsets[0];
    const float old = start > 0 ? *scale : 0.0f;
    const float fresh = absmax / Quant<q_t>::qmax;
    const float next = std::max(old, fresh);
    q_t* base = cache + block * block_stride + head * d_len;
    if (start > 0 && next > old) {  // requantize the rows before the write
      x.resize((n + 1) * d_len);
      float* widened = x.data() + n * d_len;  // NOTE: past the new rows, still in use
      for (int64_t r = 0; r < start; ++r) {
        q_t* q = base + r * row;
        pdserve::widen_row(q, widened, d_len);
        encode(widened, old, next, q, d_len);
      }
    }
    const float divisor = next > 0.0f ? next : 1.0f;
    for (int64_t i = 0; i < n; ++i)
      encode(x.data() + i * d_len, 1.0f, divisor, base + offsets[i] * row, d_len);
    *scale = next;
  }

  // q[0..n) = narrow(src[0..n) * multiplier / divisor), the product skipped for 1.
  static void encode(const float* src, float multiplier, float divisor, q_t* q, int64_t n) {
#ifdef PDSERVE_STORE_AVX512
    return encode_row(src, multiplier, divisor, q, n);
#endif
    for (int64_t d = 0; d < n; ++d)
      q[d] = Quant<q_t>::narrow((multiplier != 1.0f ? src[d] * multiplier : src[d]) / divisor);
  }
};

template <typename in_t, typename q_t, typename index_t>
void store_quant(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                 at::Tensor& value_cache, at::Tensor& key_scales, at::Tensor& value_scales,
                 const at::Tensor& slot_mapping) {
  const int64_t block_size = key_cache.size(1), num_slots = key_cache.size(0) * block_size;
  const index_t* slots = slot_mapping.const_data_ptr<index_t>();
  std::vector<int64_t> order;  // the written tokens, by slot
  order.reserve(slot_mapping.size(0));
  for (int64_t t = 0; t < slot_mapping.size(0); ++t) {
    if (slots[t] < 0) continue;
    TORCH_CHECK(slots[t] < num_slots, "store_kv_quant: slot_mapping[", t, "] = ", slots[t],
                " is outside the cache's ", num_slots, " slots");
    order.push_back(t);
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return slots[a] < slots[b]; });
  std::vector<int64_t> offsets(order.size()), group_starts;
  for (size_t i = 0; i < order.size(); ++i) {
    offsets[i] = slots[order[i]] % block_size;
    if (i == 0 || slots[order[i]] / block_size != slots[order[i - 1]] / block_size)
      group_starts.push_back(static_cast<int64_t>(i));
  }
  const int64_t num_groups = static_cast<int64_t>(group_starts.size());
  group_starts.push_back(static_cast<int64_t>(order.size()));
  const int64_t heads = key_cache.size(2);
  const QuantStore<in_t, q_t> stores[2] = {
      {key.const_data_ptr<in_t>(), key.stride(0), static_cast<q_t*>(key_cache.data_ptr()), key_cache.stride(0),
       key_scales.data_ptr<float>(), key_scales.stride(0), block_size, heads, key_cache.size(3)},
      {value.const_data_ptr<in_t>(), value.stride(0), static_cast<q_t*>(value_cache.data_ptr()),
       value_cache.stride(0), value_scales.data_ptr<float>(), value_scales.stride(0), block_size,
       heads, value_cache.size(3)}};
  at::parallel_for(0, num_groups * heads * 2, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> x;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t g = task / (heads * 2), head = (task / 2) % heads;
      const int64_t first = group_starts[g], n = group_starts[g + 1] - first;
      stores[task % 2].store_block(slots[order[first]] / block_size, head, order.data() + first,
                                   offsets.data() + first, n, x);
    }
  });
}

template <typename in_t, typename q_t>
void dispatch_slots(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                    at::Tensor& value_cache, at::Tensor& key_scales, at::Tensor& value_scales,
                    const at::Tensor& slot_mapping) {
  if (slot_mapping.scalar_type() == at::kInt) {
    store_quant<in_t, q_t, int32_t>(key, value, key_cache, value_cache, key_scales,
                                    value_scales, slot_mapping);
  } else {
    TORCH_CHECK(slot_mapping.scalar_type() == at::kLong,
                "store_kv_quant: slot_mapping must be int32/int64");
    store_quant<in_t, q_t, int64_t>(key, value, key_cache, value_cache, key_scales,
                                    value_scales, slot_mapping);
  }
}

template <typename in_t>
void dispatch_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                    at::Tensor& value_cache, at::Tensor& key_scales, at::Tensor& value_scales,
                    const at::Tensor& slot_mapping) {
  switch (key_cache.scalar_type()) {
    case at::kChar:
      return dispatch_slots<in_t, int8_t>(key, value, key_cache, value_cache, key_scales,
                                          value_scales, slot_mapping);
    case at::kFloat8_e4m3fn:
      return dispatch_slots<in_t, c10::Float8_e4m3fn>(key, value, key_cache, value_cache,
                                                      key_scales, value_scales, slot_mapping);
    case at::kFloat8_e5m2:
      return dispatch_slots<in_t, c10::Float8_e5m2>(key, value, key_cache, value_cache,
                                                    key_scales, value_scales, slot_mapping);
    default:
      TORCH_CHECK(false, "store_kv_quant: the caches must be int8, float8_e4m3fn or "
                         "float8_e5m2, got ", key_cache.scalar_type());
  }
}

void store_kv_quant(const at::Tensor& key, const at::Tensor& value, at::Tensor key_cache,
                    at::Tensor value_cache, at::Tensor key_scales, at::Tensor value_scales,
                    const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes() && key_cache.dim() == 4 &&
                  value_cache.sizes() == key_cache.sizes() &&
                  key.size(1) == key_cache.size(2) && key.size(2) == key_cache.size(3),
              "store_kv_quant: key/value must be [tokens, num_kv_heads, head_dim] of the caches");
  TORCH_CHECK(packed_from(key_cache, 1) && packed_from(value_cache, 1),
              "store_kv_quant: each cache block's [block_size, num_kv_heads, head_dim] must "
              "be packed (any block stride), got key_cache strides ", key_cache.strides());
  TORCH_CHECK(packed_from(key, 1) && packed_from(value, 1),
              "store_kv_quant: each token's [num_kv_heads, head_dim] row must be packed");
  TORCH_CHECK(key.scalar_type() == value.scalar_type() &&
                  value_cache.scalar_type() == key_cache.scalar_type(),
              "store_kv_quant: key and value share a dtype, and so do the caches");
  for (const at::Tensor* s : {&key_scales, &value_scales}) {
    TORCH_CHECK(s->dim() == 2 && s->size(0) == key_cache.size(0) &&
                    s->size(1) == key_cache.size(2) && s->scalar_type() == at::kFloat &&
                    packed_from(*s, 1),
                "store_kv_quant: the scales must be fp32 [num_blocks, num_kv_heads] with "
                "packed heads, got ", s->sizes(), " ", s->scalar_type());
  }
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0) &&
                  slot_mapping.is_contiguous(),
              "store_kv_quant: slot_mapping must be contiguous [tokens]");
  switch (key.scalar_type()) {
    case at::kFloat:
      return dispatch_cache<float>(key, value, key_cache, value_cache, key_scales, value_scales,
                                   slot_mapping);
    case at::kBFloat16:
      return dispatch_cache<c10::BFloat16>(key, value, key_cache, value_cache, key_scales,
                                           value_scales, slot_mapping);
    case at::kHalf:
      return dispatch_cache<c10::Half>(key, value, key_cache, value_cache, key_scales,
                                       value_scales, slot_mapping);
    default:
      TORCH_CHECK(false, "store_kv_quant: key/value must be fp32, bf16 or fp16");
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def(
      "store_kv_quant(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor(c!) key_scales, Tensor(d!) value_scales, Tensor slot_mapping) -> ()");
  m.impl("store_kv_quant", c10::DispatchKey::CPU, &store_kv_quant);
}
