// Paged prefill attention over a quantized KV cache (int8, fp8 e4m3fn / e5m2) for CPUs
// with AVX512-BF16 (a bf16 query; head_dim 64, 128 or 256), built on first use by
// pdserve/kernels/cpu_ext.py; the reference is paged_prefill_attention_ref with
// key_scales / value_scales (fp32 attention over scale * q), which this kernel equals
// within fp32 rounding.
//
// cpu_prefill_attention.cpp's tasks (one per (sequence, kv head); a sliding window starts
// a task at the block of its first query's first key) and its q . K micro-kernel, on
// K rows widened to bf16 as they are packed (exact for int8 and fp8 values):
//   scores = (q . K_q[0..pos]) * (scale * k_scale[block(t)])   (then capped, masked)
//   p      = exp(scores - max), in fp32 (not rounded), 1 / sum kept per row
//   out    = sum_t p[t] * V[t] / sum, V packed dequantized to fp32 (v_scale * V_q, the
//            reference's values), by fp32 FMAs
// Memory per task: the context's K (bf16) and V (fp32) packed, one score row per query
// head of four rows, and one K scale per key.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu_common.h"
#include "cpu_kv_quant.h"

namespace {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
constexpr bool kHasKernel = true;

template <typename q_t>
struct QuantPrefillArgs {
  const uint16_t* q;  // [tokens, num_heads, head_dim] bf16 bits
  uint16_t* out;
  const q_t* k;  // [num_blocks, block_size, num_kv_heads, head_dim]
  const q_t* v;
  const float* k_scales;  // [num_blocks, num_kv_heads]
  const float* v_scales;
  int64_t q_t_, q_h, o_t, o_h, k_b, k_t, k_h, v_b, v_t, v_h, ks_b, vs_b, block_size, group;
  float scale;
  int64_t window;
  float softcap;
};

constexpr int kRows = 4;  // (query, head) rows per q . K pass, as cpu_prefill_attention.cpp

// The task's context packed: K as 16-key tiles of bf16 (d, d+1) pairs, each key's score
// multiplier scale * k_scale, V dequantized to fp32 rows.
template <int kChunks, typename q_t, typename index_t>
void pack_context(const QuantPrefillArgs<q_t>& a, const index_t* table, int64_t ctx, int64_t kv,
                  std::vector<uint32_t>& k_packed, std::vector<float>& k_mult,
                  std::vector<float>& v_packed) {
  constexpr int kHeadDim = 32 * kChunks, kPairs = 16 * kChunks;
  const int64_t num_tiles = (ctx + 15) / 16;
  k_packed.assign(num_tiles * kPairs * 16, 0u);
  k_mult.assign(num_tiles * 16, 0.0f);
  v_packed.resize(ctx * kHeadDim);
  float widened[kHeadDim];
  for (int64_t t = 0; t < ctx; ++t) {
    const int64_t block = table[t / a.block_size], slot = t % a.block_size;
    pdserve::widen_row(a.k + block * a.k_b + slot * a.k_t + kv * a.k_h, widened, kHeadDim);
    uint32_t* k_tile = k_packed.data() + (t / 16) * kPairs * 16 + (t % 16);
    for (int dp = 0; dp < kPairs; ++dp)  // exact: the low 16 bits of these floats are 0
      k_tile[dp * 16] = (std::bit_cast<uint32_t>(widened[2 * dp]) >> 16) |
                        (std::bit_cast<uint32_t>(widened[2 * dp + 1]) & 0xFFFF0000u);
    k_mult[t] = a.scale * a.k_scales[block * a.ks_b + kv];
    const float v_scale = a.v_scales[block * a.vs_b + kv];
    pdserve::widen_row(a.v + block * a.v_b + slot * a.v_t + kv * a.v_h, widened, kHeadDim);
    for (int d = 0; d < kHeadDim; ++d) v_packed[t * kHeadDim + d] = widened[d] * v_scale;
  }
}

// out rows += p V over keys [0, n) for kPvRows rows, fp32, then times inv_sum, to bf16.
template <int kChunks, int kPvRows>
void pv_rows_f32(const float* v_packed, const float* p, int64_t p_stride, int64_t n,
                 const float* inv_sum, uint16_t* const* out_rows) {
  constexpr int kVecs = 2 * kChunks;  // 16-float vectors per row
  __m512 acc[kPvRows][kVecs];
  for (int j = 0; j < kPvRows; ++j)
    for (int c = 0; c < kVecs; ++c) acc[j][c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; ++t) {
    const float* vt = v_packed + t * kVecs * 16;
    for (int c = 0; c < kVecs; ++c) {
      const __m512 v = _mm512_loadu_ps(vt + 16 * c);
      for (int j = 0; j < kPvRows; ++j)
        acc[j][c] = _mm512_fmadd_ps(_mm512_set1_ps(p[j * p_stride + t]), v, acc[j][c]);
    }
  }
  for (int j = 0; j < kPvRows; ++j) {
    if (out_rows[j] == nullptr) continue;  // a padding row
    const __m512 inv = _mm512_set1_ps(inv_sum[j]);
    for (int c = 0; c < kVecs; ++c)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out_rows[j] + 16 * c),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[j][c], inv)));
  }
}

// One (sequence, kv head): queries [q_begin, q_begin + q_len) at positions ctx - q_len ..
// ctx - 1 of a context of ctx tokens.
template <int kChunks, typename q_t, typename index_t>
void prefill_quant_task(const QuantPrefillArgs<q_t>& a, const index_t* table, int64_t q_begin,
                        int64_t q_len, int64_t ctx, int64_t kv, std::vector<uint32_t>& k_packed,
                        std::vector<float>& k_mult, std::vector<float>& v_packed,
                        std::vector<float>& scores) {
  constexpr int kPairs = 16 * kChunks;
  constexpr int kPvRows = 16 / (2 * kChunks) < kRows ? 16 / (2 * kChunks) : kRows;
  pack_context<kChunks>(a, table, ctx, kv, k_packed, k_mult, v_packed);
  const int64_t row_stride = (ctx + 15) / 16 * 16, num_rows = q_len * a.group;
  scores.resize(kRows * row_stride);
  for (int64_t r0 = 0; r0 < num_rows; r0 += kRows) {
    const uint32_t* q_rows[kRows];
    uint16_t* out_rows[kRows];
    int64_t n_row[kRows];  // keys 0 .. pos of the row's query
    float inv_sum[kRows];
    for (int j = 0; j < kRows; ++j) {  // past the last row, padding rows repeat it
      const int64_t r = std::min(r0 + j, num_rows - 1), i = r / a.group, g = r % a.group;
      q_rows[j] = reinterpret_cast<const uint32_t*>(a.q + (q_begin + i) * a.q_t_ +
                                                    (kv * a.group + g) * a.q_h);
      out_rows[j] = r0 + j < num_rows ? a.out + (q_begin + i) * a.o_t + (kv * a.group + g) * a.o_h
                                      : nullptr;
      n_row[j] = ctx - q_len + i + 1;
    }
    const int64_t n_max = n_row[kRows - 1], tiles = (n_max + 15) / 16;
    for (int64_t tile = 0; tile < tiles; tile += 4) {  // q . K, four 16-key tiles at a time
      const uint32_t* kt[4];
      for (int u = 0; u < 4; ++u)
        kt[u] = k_packed.data() + (tile + u < tiles ? tile + u : tile) * kPairs * 16;
      __m512 acc[kRows][4];
      for (int j = 0; j < kRows; ++j)
        for (int u = 0; u < 4; ++u) acc[j][u] = _mm512_setzero_ps();
      for (int dp = 0; dp < kPairs; ++dp) {
        __m512bh k[4];
        for (int u = 0; u < 4; ++u) k[u] = (__m512bh)_mm512_loadu_si512(kt[u] + dp * 16);
        for (int j = 0; j < kRows; ++j) {
          const __m512bh qp = (__m512bh)_mm512_set1_epi32(static_cast<int>(q_rows[j][dp]));
          for (int u = 0; u < 4; ++u) acc[j][u] = _mm512_dpbf16_ps(acc[j][u], qp, k[u]);
        }
      }
      for (int j = 0; j < kRows; ++j)
        for (int u = 0; u < 4 && tile + u < tiles; ++u)
          _mm512_storeu_ps(scores.data() + j * row_stride + (tile + u) * 16,
                           _mm512_mul_ps(acc[j][u], _mm512_loadu_ps(k_mult.data() + (tile + u) * 16)));
    }
    for (int j = 0; j < kRows; ++j) {
      float* row = scores.data() + j * row_stride;
      pdserve::cap_and_mask_scores(row, n_row[j], a.softcap,
                                   a.window > 0 ? std::max<int64_t>(0, n_row[j] - a.window) : 0);
      inv_sum[j] = pdserve::softmax_inplace(row, n_row[j]);
      std::fill(row + n_row[j], row + n_max, 0.0f);  // keys past the row's query
    }
    for (int j0 = 0; j0 < kRows; j0 += kPvRows)
      pv_rows_f32<kChunks, kPvRows>(v_packed.data(), scores.data() + j0 * row_stride, row_stride,
                                    n_max, inv_sum + j0, out_rows + j0);
  }
}

template <int kChunks, typename q_t, typename index_t>
void prefill_quant_kernel(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                          const at::Tensor& value_cache, const at::Tensor& key_scales,
                          const at::Tensor& value_scales, const at::Tensor& block_tables,
                          const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens,
                          double scale, int64_t window, double softcap) {
  const int64_t num_seqs = seq_lens.size(0), num_kv_heads = key_cache.size(2);
  const int64_t block_size = key_cache.size(1), num_blocks = key_cache.size(0);
  const int64_t max_blocks = block_tables.size(1);
  const int32_t* cu = cu_seqlens_q.const_data_ptr<int32_t>();
  const int32_t* lens = seq_lens.const_data_ptr<int32_t>();
  const index_t* tables = block_tables.const_data_ptr<index_t>();
  auto skipped = [&](int64_t s) {  // blocks before the chunk's first window
    const int64_t q_len = cu[s + 1] - cu[s];
    return window > 0 ? std::max<int64_t>(0, lens[s] - q_len - window + 1) / block_size : 0;
  };
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = cu[s + 1] - cu[s], ctx = lens[s];
    TORCH_CHECK(q_len >= 0 && q_len <= ctx && ctx <= max_blocks * block_size,
                "paged_prefill_attention_quant: sequence ", s, " has a chunk of ", q_len,
                " tokens in a context of ", ctx, " (its table holds ", max_blocks * block_size,
                ")");
    for (int64_t b = skipped(s); b < (ctx + block_size - 1) / block_size; ++b) {
      const int64_t block = tables[s * block_tables.stride(0) + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "paged_prefill_attention_quant: "
                  "block_tables[", s, ", ", b, "] = ", block, " is outside [0, ", num_blocks, ")");
    }
  }
  TORCH_CHECK(cu[0] == 0 && cu[num_seqs] == query.size(0),
              "paged_prefill_attention_quant: cu_seqlens_q must run from 0 to the token count");
  const QuantPrefillArgs<q_t> args{
      reinterpret_cast<const uint16_t*>(query.const_data_ptr()),
      reinterpret_cast<uint16_t*>(out.data_ptr()),
      static_cast<const q_t*>(key_cache.const_data_ptr()),
      static_cast<const q_t*>(value_cache.const_data_ptr()),
      key_scales.const_data_ptr<float>(), value_scales.const_data_ptr<float>(),
      query.stride(0), query.stride(1), out.stride(0), out.stride(1),
      key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
      value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
      key_scales.stride(0), value_scales.stride(0), block_size, query.size(1) / num_kv_heads,
      static_cast<float>(scale), window, static_cast<float>(softcap)};
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> k_packed;
    std::vector<float> k_mult, v_packed, scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / num_kv_heads, kv = task % num_kv_heads;
      const int64_t q_len = cu[s + 1] - cu[s], skip = skipped(s);
      if (q_len == 0) continue;
      prefill_quant_task<kChunks, q_t, index_t>(args, tables + s * block_tables.stride(0) + skip,
                                                cu[s], q_len, lens[s] - skip * block_size, kv,
                                                k_packed, k_mult, v_packed, scores);
    }
  });
}

template <int kChunks, typename q_t>
void dispatch_tables(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& key_scales,
                     const at::Tensor& value_scales, const at::Tensor& block_tables,
                     const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens, double scale,
                     int64_t window, double softcap) {
  if (block_tables.scalar_type() == at::kInt)
    return prefill_quant_kernel<kChunks, q_t, int32_t>(out, query, key_cache, value_cache,
                                                       key_scales, value_scales, block_tables,
                                                       cu_seqlens_q, seq_lens, scale, window,
                                                       softcap);
  prefill_quant_kernel<kChunks, q_t, int64_t>(out, query, key_cache, value_cache, key_scales,
                                              value_scales, block_tables, cu_seqlens_q,
                                              seq_lens, scale, window, softcap);
}

template <int kChunks>
void dispatch_cache(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                    const at::Tensor& value_cache, const at::Tensor& key_scales,
                    const at::Tensor& value_scales, const at::Tensor& block_tables,
                    const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens, double scale,
                    int64_t window, double softcap) {
  switch (key_cache.scalar_type()) {
    case at::kChar:
      return dispatch_tables<kChunks, int8_t>(out, query, key_cache, value_cache, key_scales,
                                              value_scales, block_tables, cu_seqlens_q, seq_lens,
                                              scale, window, softcap);
    case at::kFloat8_e4m3fn:
      return dispatch_tables<kChunks, c10::Float8_e4m3fn>(
          out, query, key_cache, value_cache, key_scales, value_scales, block_tables,
          cu_seqlens_q, seq_lens, scale, window, softcap);
    case at::kFloat8_e5m2:
      return dispatch_tables<kChunks, c10::Float8_e5m2>(
          out, query, key_cache, value_cache, key_scales, value_scales, block_tables,
          cu_seqlens_q, seq_lens, scale, window, softcap);
    default:
      TORCH_CHECK(false, "paged_prefill_attention_quant: the caches must be int8, "
                         "float8_e4m3fn or float8_e5m2, got ", key_cache.scalar_type());
  }
}

void paged_prefill_attention_quant(at::Tensor out, const at::Tensor& query,
                                   const at::Tensor& key_cache, const at::Tensor& value_cache,
                                   const at::Tensor& key_scales, const at::Tensor& value_scales,
                                   const at::Tensor& block_tables, const at::Tensor& cu_seqlens_q,
                                   const at::Tensor& seq_lens, double scale, int64_t window,
                                   double softcap) {
  TORCH_CHECK(window >= 0 && softcap >= 0.0,
              "paged_prefill_attention_quant: sliding_window and softcap must be >= 0 (0: off)");
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes() &&
                  value_cache.scalar_type() == key_cache.scalar_type(),
              "paged_prefill_attention_quant: query must be 3-D and the caches 4-D of one "
              "shape and dtype");
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16 &&
                  out.sizes() == query.sizes(),
              "paged_prefill_attention_quant: the CPU kernel takes a bf16 query (and out)");
  TORCH_CHECK(query.size(2) == key_cache.size(3) && query.size(1) % key_cache.size(2) == 0,
              "paged_prefill_attention_quant: head_dim or head counts disagree with the caches");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && key_cache.stride(3) == 1 &&
                  value_cache.stride(3) == 1,
              "paged_prefill_attention_quant: the last dim of every tensor must be contiguous");
  for (const at::Tensor* s : {&key_scales, &value_scales}) {
    TORCH_CHECK(s->dim() == 2 && s->size(0) == key_cache.size(0) &&
                    s->size(1) == key_cache.size(2) && s->scalar_type() == at::kFloat &&
                    (s->size(1) == 1 || s->stride(1) == 1),
                "paged_prefill_attention_quant: the scales must be fp32 [num_blocks, "
                "num_kv_heads] with packed heads, got ", s->sizes());
  }
  TORCH_CHECK(cu_seqlens_q.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  cu_seqlens_q.is_contiguous() && seq_lens.is_contiguous() &&
                  cu_seqlens_q.size(0) == seq_lens.size(0) + 1,
              "paged_prefill_attention_quant: cu_seqlens_q [num_seqs + 1] and seq_lens "
              "[num_seqs] must be contiguous int32");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.stride(1) == 1 &&
                  block_tables.size(0) == seq_lens.size(0) &&
                  (block_tables.scalar_type() == at::kInt ||
                   block_tables.scalar_type() == at::kLong),
              "paged_prefill_attention_quant: block_tables must be int32/int64 [num_seqs, "
              "max_blocks]");
  switch (query.size(2)) {
    case 64:
      return dispatch_cache<2>(out, query, key_cache, value_cache, key_scales, value_scales,
                               block_tables, cu_seqlens_q, seq_lens, scale, window, softcap);
    case 128:
      return dispatch_cache<4>(out, query, key_cache, value_cache, key_scales, value_scales,
                               block_tables, cu_seqlens_q, seq_lens, scale, window, softcap);
    case 256:
      return dispatch_cache<8>(out, query, key_cache, value_cache, key_scales, value_scales,
                               block_tables, cu_seqlens_q, seq_lens, scale, window, softcap);
    default:
      TORCH_CHECK(false, "paged_prefill_attention_quant: head_dim must be 64, 128 or 256");
  }
}
#else
constexpr bool kHasKernel = false;

void paged_prefill_attention_quant(at::Tensor, const at::Tensor&, const at::Tensor&,
                                   const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                                   int64_t, double) {
  TORCH_CHECK(false, "paged_prefill_attention_quant: this CPU has no AVX512-BF16");
}
#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def(
      "paged_prefill_attention_quant(Tensor(a!) out, Tensor query, Tensor key_cache, "
      "Tensor value_cache, Tensor key_scales, Tensor value_scales, Tensor block_tables, "
      "Tensor cu_seqlens_q, Tensor seq_lens, float scale, int sliding_window, "
      "float softcap) -> ()");
  m.impl("paged_prefill_attention_quant", c10::DispatchKey::CPU, &paged_prefill_attention_quant);
}
