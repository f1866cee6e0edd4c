// Paged decode attention over a quantized KV cache (int8, fp8 e4m3fn / e5m2) for CPUs,
// built on first use by pdserve/kernels/cpu_ext.py; the reference is
// paged_decode_attention_ref with key_scales / value_scales (fp32 attention over
// scale * q), which this kernel equals within fp32 rounding.
//
// Tasks as cpu_attention.cpp's (one per sequence, or per (sequence, kv head) when
// sequences are few; a sliding window starts a task at the block of its first key), and
// the same two passes, on rows widened from their stored bytes as they are read:
//   scores[g][t] = scale * (q[g] . K_q[t]) * k_scale[block(t)]   (pass 1)
//   p[g][t]      = exp(scores - max) (soft-capped and masked first), 1 / sum kept
//   out[g]       = sum_t (p[g][t] * v_scale[block(t)]) * V_q[t] / sum   (pass 2)
// in fp32 throughout (the probabilities are not rounded). Three paths:
//   generic:       any query dtype and head dim, loops left to the vectorizer;
//   AVX2 fp32:     an fp32 query, head_dim % 8 == 0, eight elements widened at a time;
//   AVX512-BF16:   a bf16 query, head_dim 64/128/256: K rows widened to bf16 (exact for
//                  these elements) for vdpbf16ps dot products with the query, V in fp32
//                  FMAs on sixteen widened elements at a time.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "cpu_common.h"
#include "cpu_kv_quant.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using pdserve::Quant;

template <typename scalar_t, typename q_t, typename index_t>
struct QuantDecodeTask {
  const scalar_t* q;  // the sequence's [num_heads, head_dim] query (row stride q_h)
  scalar_t* out;      // its output (row stride o_h)
  const q_t* k;       // key cache [num_blocks, block_size, num_kv_heads, head_dim]
  const q_t* v;
  const float* k_scales;  // [num_blocks, num_kv_heads] (block stride ks_b)
  const float* v_scales;
  const index_t* table;
  int64_t q_h, o_h, k_b, k_t, k_h, v_b, v_t, v_h, ks_b, vs_b;
  int64_t block_size, seq_len, head_dim, group, kv_begin, kv_end;
  float scale, softcap;
  int64_t masked;  // leading tokens of [0, seq_len) outside the sliding window

  int64_t block(int64_t t) const { return static_cast<int64_t>(table[t / block_size]); }
  const q_t* k_row(int64_t t, int64_t kv) const {
    return k + block(t) * k_b + (t % block_size) * k_t + kv * k_h;
  }
  const q_t* v_row(int64_t t, int64_t kv) const {
    return v + block(t) * v_b + (t % block_size) * v_t + kv * v_h;
  }
  float k_scale(int64_t t, int64_t kv) const { return k_scales[block(t) * ks_b + kv]; }
  float v_scale(int64_t t, int64_t kv) const { return v_scales[block(t) * vs_b + kv]; }
  int64_t num_heads() const { return (kv_end - kv_begin) * group; }
  int64_t head(int64_t kv, int64_t g) const { return (kv - kv_begin) * group + g; }

  // Softmax of every head's scores in place (unnormalized exps); returns 1 / sums.
  std::vector<float> softmax(float* scores) const {
    std::vector<float> inv_sum(num_heads());
    for (int64_t h = 0; h < num_heads(); ++h) {
      pdserve::cap_and_mask_scores(scores + h * seq_len, seq_len, softcap, masked);
      inv_sum[h] = pdserve::softmax_inplace(scores + h * seq_len, seq_len);
    }
    return inv_sum;
  }

  // out[h] = acc[h] * inv_sum[h], in the output dtype.
  void store(const float* acc, const std::vector<float>& inv_sum) const {
    const int64_t h0 = kv_begin * group;
    for (int64_t h = 0; h < num_heads(); ++h) {
      scalar_t* o = out + (h0 + h) * o_h;
      for (int64_t d = 0; d < head_dim; ++d)
        o[d] = static_cast<scalar_t>(acc[h * head_dim + d] * inv_sum[h]);
    }
  }
};

// The query heads of the task, widened and times the softmax scale: q32[h][d].
template <typename scalar_t, typename q_t, typename index_t>
void load_query(const QuantDecodeTask<scalar_t, q_t, index_t>& task, float* q32) {
  const int64_t h0 = task.kv_begin * task.group, d_len = task.head_dim;
  for (int64_t h = 0; h < task.num_heads(); ++h) {
    pdserve::load_as_float(task.q + (h0 + h) * task.q_h, q32 + h * d_len, d_len);
    for (int64_t d = 0; d < d_len; ++d) q32[h * d_len + d] *= task.scale;
  }
}

// Portable path. `scores` holds num_heads * seq_len floats, `acc` num_heads * head_dim,
// `row` head_dim, `q32` num_heads * head_dim.
template <typename scalar_t, typename q_t, typename index_t>
void decode_quant_generic(const QuantDecodeTask<scalar_t, q_t, index_t>& task, float* scores,
                          float* acc, float* row, float* q32) {
  const int64_t d_len = task.head_dim, n = task.seq_len;
  load_query(task, q32);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t kv = task.kv_begin; kv < task.kv_end; ++kv) {
      pdserve::widen_row(task.k_row(t, kv), row, d_len);
      const float k_scale = task.k_scale(t, kv);
      for (int64_t g = 0; g < task.group; ++g) {
        const int64_t h = task.head(kv, g);
        const float* qh = q32 + h * d_len;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < d_len; ++d) dot += qh[d] * row[d];
        scores[h * n + t] = dot * k_scale;
      }
    }
  }
  const std::vector<float> inv_sum = task.softmax(scores);
  std::fill(acc, acc + task.num_heads() * d_len, 0.0f);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t kv = task.kv_begin; kv < task.kv_end; ++kv) {
      pdserve::widen_row(task.v_row(t, kv), row, d_len);
      const float v_scale = task.v_scale(t, kv);
      for (int64_t g = 0; g < task.group; ++g) {
        const int64_t h = task.head(kv, g);
        const float p = scores[h * n + t] * v_scale;
        float* a = acc + h * d_len;
#pragma omp simd
        for (int64_t d = 0; d < d_len; ++d) a[d] += p * row[d];
      }
    }
  }
  task.store(acc, inv_sum);
}

#if defined(__AVX2__) && defined(__FMA__)
#define PDSERVE_QUANT_AVX2 1

inline float sum_lanes(__m256 a) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// fp32 query, head_dim a multiple of 8: each K or V row is widened eight elements at a
// time straight into FMAs (no row buffer).
template <typename q_t, typename index_t>
void decode_quant_avx2(const QuantDecodeTask<float, q_t, index_t>& task, float* scores,
                       float* acc, float* q32) {
  const int64_t d_len = task.head_dim, n = task.seq_len;
  load_query(task, q32);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t kv = task.kv_begin; kv < task.kv_end; ++kv) {
      const q_t* k_row = task.k_row(t, kv);
      const float k_scale = task.k_scale(t, kv);
      for (int64_t g = 0; g < task.group; ++g) {
        const int64_t h = task.head(kv, g);
        __m256 a0 = _mm256_setzero_ps(), a1 = a0;
        int64_t d = 0;
        for (; d + 16 <= d_len; d += 16) {
          a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q32 + h * d_len + d), pdserve::widen8(k_row + d), a0);
          a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q32 + h * d_len + d + 8),
                               pdserve::widen8(k_row + d + 8), a1);
        }
        if (d < d_len)
          a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q32 + h * d_len + d), pdserve::widen8(k_row + d), a0);
        scores[h * n + t] = sum_lanes(_mm256_add_ps(a0, a1)) * k_scale;
      }
    }
  }
  const std::vector<float> inv_sum = task.softmax(scores);
  std::fill(acc, acc + task.num_heads() * d_len, 0.0f);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t kv = task.kv_begin; kv < task.kv_end; ++kv) {
      const q_t* v_row = task.v_row(t, kv);
      const float v_scale = task.v_scale(t, kv);
      for (int64_t g = 0; g < task.group; ++g) {
        const int64_t h = task.head(kv, g);
        const __m256 p = _mm256_set1_ps(scores[h * n + t] * v_scale);
        float* a = acc + h * d_len;
        for (int64_t d = 0; d < d_len; d += 8)
          _mm256_storeu_ps(a + d, _mm256_fmadd_ps(p, pdserve::widen8(v_row + d),
                                                  _mm256_loadu_ps(a + d)));
      }
    }
  }
  task.store(acc, inv_sum);
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define PDSERVE_QUANT_AVX512_BF16 1

// bf16 query, head_dim = 32 * kChunks: q . K by vdpbf16ps on K rows widened to bf16
// (exact: int8 and fp8 values have at most 8 significant bits), p V in fp32 FMAs.
template <int kChunks, typename q_t, typename index_t>
void decode_quant_avx512_bf16(const QuantDecodeTask<c10::BFloat16, q_t, index_t>& task,
                              float* scores, float* acc) {
  constexpr int kHeadDim = 32 * kChunks;
  const int64_t n = task.seq_len, h0 = task.kv_begin * task.group;
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t kv = task.kv_begin; kv < task.kv_end; ++kv) {
      const q_t* k_row = task.k_row(t, kv);
      __m512bh k[kChunks];
      for (int c = 0; c < kChunks; ++c)  // dims 32c .. 32c + 31 in order
        k[c] = _mm512_cvtne2ps_pbh(pdserve::widen16(k_row + 32 * c + 16),
                                   pdserve::widen16(k_row + 32 * c));
      const float k_scale = task.k_scale(t, kv) * task.scale;
      for (int64_t g = 0; g < task.group; ++g) {
        const int64_t h = task.head(kv, g);
        const c10::BFloat16* qh = task.q + (h0 + h) * task.q_h;
        __m512 dot = _mm512_setzero_ps();
        for (int c = 0; c < kChunks; ++c)
          dot = _mm512_dpbf16_ps(dot, (__m512bh)_mm512_loadu_si512(qh + 32 * c), k[c]);
        scores[h * n + t] = _mm512_reduce_add_ps(dot) * k_scale;
      }
    }
  }
  const std::vector<float> inv_sum = task.softmax(scores);
  std::fill(acc, acc + task.num_heads() * kHeadDim, 0.0f);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t kv = task.kv_begin; kv < task.kv_end; ++kv) {
      const q_t* v_row = task.v_row(t, kv);
      __m512 v[2 * kChunks];
      for (int c = 0; c < 2 * kChunks; ++c) v[c] = pdserve::widen16(v_row + 16 * c);
      const float v_scale = task.v_scale(t, kv);
      for (int64_t g = 0; g < task.group; ++g) {
        const int64_t h = task.head(kv, g);
        const __m512 p = _mm512_set1_ps(scores[h * n + t] * v_scale);
        float* a = acc + h * kHeadDim;
        for (int c = 0; c < 2 * kChunks; ++c)
          _mm512_storeu_ps(a + 16 * c, _mm512_fmadd_ps(p, v[c], _mm512_loadu_ps(a + 16 * c)));
      }
    }
  }
  task.store(acc, inv_sum);
}
#endif

template <typename scalar_t, typename q_t, typename index_t>
void run_quant_task(const QuantDecodeTask<scalar_t, q_t, index_t>& task,
                    std::vector<float>& scores, std::vector<float>& acc,
                    std::vector<float>& row, std::vector<float>& q32) {
  scores.resize(task.num_heads() * task.seq_len);
  acc.resize(task.num_heads() * task.head_dim);
#ifdef PDSERVE_QUANT_AVX512_BF16
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    switch (task.head_dim) {
      case 64: return decode_quant_avx512_bf16<2>(task, scores.data(), acc.data());
      case 128: return decode_quant_avx512_bf16<4>(task, scores.data(), acc.data());
      case 256: return decode_quant_avx512_bf16<8>(task, scores.data(), acc.data());
      default: break;
    }
  }
#endif
  q32.resize(task.num_heads() * task.head_dim);
#ifdef PDSERVE_QUANT_AVX2
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (task.head_dim % 8 == 0) return decode_quant_avx2(task, scores.data(), acc.data(), q32.data());
  }
#endif
  row.resize(task.head_dim);
  decode_quant_generic(task, scores.data(), acc.data(), row.data(), q32.data());
}

template <typename scalar_t, typename q_t, typename index_t>
void decode_quant_kernel(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                         const at::Tensor& value_cache, const at::Tensor& key_scales,
                         const at::Tensor& value_scales, const at::Tensor& block_tables,
                         const at::Tensor& seq_lens, double scale, int64_t window,
                         double softcap) {
  const int64_t num_seqs = query.size(0), num_heads = query.size(1);
  const int64_t num_blocks = key_cache.size(0), block_size = key_cache.size(1);
  const int64_t num_kv_heads = key_cache.size(2), max_blocks = block_tables.size(1);
  const int64_t heads_per_task = num_seqs >= 4 * at::get_num_threads() ? num_kv_heads : 1;
  const int64_t tasks_per_seq = num_kv_heads / heads_per_task;
  const int32_t* lens = seq_lens.const_data_ptr<int32_t>();
  QuantDecodeTask<scalar_t, q_t, index_t> base{
      query.const_data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
      static_cast<const q_t*>(key_cache.const_data_ptr()),
      static_cast<const q_t*>(value_cache.const_data_ptr()),
      key_scales.const_data_ptr<float>(), value_scales.const_data_ptr<float>(),
      block_tables.const_data_ptr<index_t>(), query.stride(1), out.stride(1),
      key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), value_cache.stride(0),
      value_cache.stride(1), value_cache.stride(2), key_scales.stride(0), value_scales.stride(0),
      block_size, 0, query.size(2), num_heads / num_kv_heads, 0, 0, static_cast<float>(scale),
      static_cast<float>(softcap), 0};
  at::parallel_for(0, num_seqs * tasks_per_seq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc, row, q32;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t seq = i / tasks_per_seq;
      auto task = base;
      task.q += seq * query.stride(0);
      task.out += seq * out.stride(0);
      task.table += seq * block_tables.stride(0);
      task.seq_len = lens[seq];
      task.kv_begin = (i % tasks_per_seq) * heads_per_task;
      task.kv_end = task.kv_begin + heads_per_task;
      TORCH_CHECK(task.seq_len >= 1 && task.seq_len <= max_blocks * block_size,
                  "paged_decode_attention_quant: seq_lens[", seq, "] = ", task.seq_len,
                  " is outside [1, max_blocks * block_size = ", max_blocks * block_size, "]");
      if (window > 0 && task.seq_len > window) {  // start at the window's first block
        const int64_t skip = (task.seq_len - window) / block_size;
        task.table += skip;
        task.seq_len -= skip * block_size;
        task.masked = task.seq_len - window;
      }
      for (int64_t b = 0; b < (task.seq_len + block_size - 1) / block_size; ++b) {
        TORCH_CHECK(task.table[b] >= 0 && task.table[b] < num_blocks,
                    "paged_decode_attention_quant: block_tables[", seq, ", ", b, "] = ",
                    task.table[b], " is outside [0, ", num_blocks, ")");
      }
      run_quant_task(task, scores, acc, row, q32);
    }
  });
}

template <typename scalar_t, typename q_t>
void dispatch_tables(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& key_scales,
                     const at::Tensor& value_scales, const at::Tensor& block_tables,
                     const at::Tensor& seq_lens, double scale, int64_t window, double softcap) {
  if (block_tables.scalar_type() == at::kInt) {
    decode_quant_kernel<scalar_t, q_t, int32_t>(out, query, key_cache, value_cache, key_scales,
                                                value_scales, block_tables, seq_lens, scale,
                                                window, softcap);
  } else {
    decode_quant_kernel<scalar_t, q_t, int64_t>(out, query, key_cache, value_cache, key_scales,
                                                value_scales, block_tables, seq_lens, scale,
                                                window, softcap);
  }
}

template <typename scalar_t>
void dispatch_cache(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                    const at::Tensor& value_cache, const at::Tensor& key_scales,
                    const at::Tensor& value_scales, const at::Tensor& block_tables,
                    const at::Tensor& seq_lens, double scale, int64_t window, double softcap) {
  switch (key_cache.scalar_type()) {
    case at::kChar:
      return dispatch_tables<scalar_t, int8_t>(out, query, key_cache, value_cache, key_scales,
                                               value_scales, block_tables, seq_lens, scale,
                                               window, softcap);
    case at::kFloat8_e4m3fn:
      return dispatch_tables<scalar_t, c10::Float8_e4m3fn>(
          out, query, key_cache, value_cache, key_scales, value_scales, block_tables, seq_lens,
          scale, window, softcap);
    case at::kFloat8_e5m2:
      return dispatch_tables<scalar_t, c10::Float8_e5m2>(
          out, query, key_cache, value_cache, key_scales, value_scales, block_tables, seq_lens,
          scale, window, softcap);
    default:
      TORCH_CHECK(false, "paged_decode_attention_quant: the caches must be int8, "
                         "float8_e4m3fn or float8_e5m2, got ", key_cache.scalar_type());
  }
}

void paged_decode_attention_quant(at::Tensor out, const at::Tensor& query,
                                  const at::Tensor& key_cache, const at::Tensor& value_cache,
                                  const at::Tensor& key_scales, const at::Tensor& value_scales,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                  double scale, int64_t window, double softcap) {
  TORCH_CHECK(window >= 0 && softcap >= 0.0,
              "paged_decode_attention_quant: sliding_window and softcap must be >= 0 (0: off)");
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes() &&
                  query.size(2) == key_cache.size(3) && query.size(2) <= 512 &&
                  query.size(1) % key_cache.size(2) == 0,
              "paged_decode_attention_quant: query [num_seqs, num_heads, head_dim <= 512] and "
              "caches [num_blocks, block_size, num_kv_heads, head_dim] disagree");
  TORCH_CHECK(value_cache.scalar_type() == key_cache.scalar_type(),
              "paged_decode_attention_quant: the caches must share a dtype");
  TORCH_CHECK(query.stride(2) == 1 && key_cache.stride(3) == 1 && value_cache.stride(3) == 1 &&
                  out.stride(2) == 1 && out.sizes() == query.sizes() &&
                  out.scalar_type() == query.scalar_type(),
              "paged_decode_attention_quant: out must match the query, and every last dim "
              "must be contiguous");
  for (const at::Tensor* s : {&key_scales, &value_scales}) {
    TORCH_CHECK(s->dim() == 2 && s->size(0) == key_cache.size(0) &&
                    s->size(1) == key_cache.size(2) && s->scalar_type() == at::kFloat &&
                    (s->size(1) == 1 || s->stride(1) == 1),
                "paged_decode_attention_quant: the scales must be fp32 [num_blocks, "
                "num_kv_heads] with packed heads, got ", s->sizes());
  }
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() &&
                  seq_lens.size(0) == query.size(0),
              "paged_decode_attention_quant: seq_lens must be contiguous int32 [num_seqs]");
  TORCH_CHECK((block_tables.scalar_type() == at::kInt ||
               block_tables.scalar_type() == at::kLong) &&
                  block_tables.dim() == 2 && block_tables.stride(1) == 1 &&
                  block_tables.size(0) == query.size(0),
              "paged_decode_attention_quant: block_tables must be int32/int64 [num_seqs, "
              "max_blocks] with a contiguous last dim");
  switch (query.scalar_type()) {
    case at::kFloat:
      return dispatch_cache<float>(out, query, key_cache, value_cache, key_scales, value_scales,
                                   block_tables, seq_lens, scale, window, softcap);
    case at::kBFloat16:
      return dispatch_cache<c10::BFloat16>(out, query, key_cache, value_cache, key_scales,
                                           value_scales, block_tables, seq_lens, scale, window,
                                           softcap);
    case at::kHalf:
      return dispatch_cache<c10::Half>(out, query, key_cache, value_cache, key_scales,
                                       value_scales, block_tables, seq_lens, scale, window,
                                       softcap);
    default:
      TORCH_CHECK(false, "paged_decode_attention_quant: unsupported query dtype ",
                  query.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def(
      "paged_decode_attention_quant(Tensor(a!) out, Tensor query, Tensor key_cache, "
      "Tensor value_cache, Tensor key_scales, Tensor value_scales, Tensor block_tables, "
      "Tensor seq_lens, float scale, int sliding_window, float softcap) -> ()");
  m.impl("paged_decode_attention_quant", c10::DispatchKey::CPU, &paged_decode_attention_quant);
}
