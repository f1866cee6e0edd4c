// Paged decode attention for CPUs, built on first use by pdserve/kernels/cpu_ext.py (the
// KV store that fills the cache: cpu_store_kv.cpp).
//
// A task (one sequence, or one (sequence, kv head) when sequences are few) reads K and
// V rows straight from the paged cache through the block table (no gather, no copy),
// for the query heads that share each kv head (grouped-query attention):
//   scores[g][t] = scale * q[g] . K[t]        (pass 1, over the context's blocks)
//   p[g][t]      = softmax_t(scores[g][t])     (max-subtracted, exp and sums in fp32)
// over the keys of the sliding window if there is one (Mistral's, Gemma's local layers),
// the scores soft-capped first where asked (Gemma 2: softcap * tanh(score / softcap)).
//   out[g]       = sum_t p[g][t] * V[t]        (pass 2)
// Tasks run on torch's intra-op thread pool (at::parallel_for). fp32 on AVX2 + FMA CPUs
// takes an intrinsics path (decode_task_avx2_f32). The portable path is
// written for the compiler's vectorizer (`omp simd`), so one source serves AVX2, AVX-512
// and Arm builds (compiled with -march=native on the machine that runs it); bf16 with
// head dim 64/128/256 on AVX512-BF16 CPUs takes an intrinsics path (vdpbf16ps, the
// probabilities rounded to bf16 before p V as the reference does).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "cpu_common.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kMaxHeadDim = 512;

using pdserve::load_as_float;
using pdserve::softmax_inplace;

// What one task needs: the sequence's query, output, block table and length, the layer's
// caches and their strides (in elements), and the kv heads [kv_begin, kv_end) it does.
template <typename scalar_t, typename index_t>
struct DecodeTask {
  const scalar_t* q;  // the sequence's [num_heads, head_dim] query (row stride q_h)
  scalar_t* out;      // its [num_heads, head_dim] output (row stride o_h)
  const scalar_t* k;  // key cache [num_blocks, block_size, num_kv_heads, head_dim]
  const scalar_t* v;  // value cache, same shape
  const index_t* table;
  int64_t q_h, o_h, k_b, k_t, k_h, v_b, v_t, v_h;
  int64_t block_size, seq_len, head_dim, group, kv_begin, kv_end;
  float scale;
  float softcap;   // > 0: Gemma 2's soft-capping of the scores
  int64_t masked;  // leading tokens of [0, seq_len) outside the sliding window

  // Before the softmax over head h's scores.
  void cap_and_mask(float* scores_h) const {
    pdserve::cap_and_mask_scores(scores_h, seq_len, softcap, masked);
  }

  const scalar_t* k_row(int64_t t) const {
    return k + static_cast<int64_t>(table[t / block_size]) * k_b + (t % block_size) * k_t;
  }
  const scalar_t* v_row(int64_t t) const {
    return v + static_cast<int64_t>(table[t / block_size]) * v_b + (t % block_size) * v_t;
  }
  int64_t num_heads() const { return (kv_end - kv_begin) * group; }

  // Asks for token t's rows of this task's kv heads (`row`: its K or V row of kv head
  // kv_begin) ahead of use: the blocks of a sequence are scattered, so the hardware
  // prefetcher restarts at every block. kLocality is __builtin_prefetch's: 3 into L1,
  // 2 into L2.
  template <int kLocality = 3>
  void prefetch(const scalar_t* row, int64_t row_stride) const {
    const char* first = reinterpret_cast<const char*>(row);
    const char* last = reinterpret_cast<const char*>(row + (kv_end - kv_begin - 1) * row_stride +
                                                      head_dim) - 1;
    for (const char* line = first; line <= last; line += 64) __builtin_prefetch(line, 0, kLocality);
  }
};

// Tokens ahead whose rows a task prefetches (a block of 16 is ~16 * 512 B of K or V).
constexpr int64_t kPrefetchTokens = 8;

// Portable path: every dtype and head dim; loops left to the compiler's vectorizer.
// `scores` holds num_heads * seq_len floats, `acc` num_heads * head_dim, `row` head_dim.
template <typename scalar_t, typename index_t>
void decode_task_generic(const DecodeTask<scalar_t, index_t>& task, float* scores, float* acc,
                         float* row, float* q) {
  const int64_t d_len = task.head_dim, n = task.seq_len, h0 = task.kv_begin * task.group;
  for (int64_t h = 0; h < task.num_heads(); ++h) {
    load_as_float(task.q + (h0 + h) * task.q_h, q + h * d_len, d_len);
    for (int64_t d = 0; d < d_len; ++d) q[h * d_len + d] *= task.scale;
  }
  for (int64_t t = 0; t < n; ++t) {
    const scalar_t* k_row = task.k_row(t);
    for (int64_t kv = task.kv_begin; kv < task.kv_end; ++kv) {
      load_as_float(k_row + kv * task.k_h, row, d_len);
      for (int64_t g = 0; g < task.group; ++g) {
        const int64_t h = (kv - task.kv_begin) * task.group + g;
        const float* qh = q + h * d_len;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < d_len; ++d) dot += qh[d] * row[d];
        scores[h * n + t] = dot;
      }
    }
  }
  std::vector<float> inv_sum(task.num_heads());
  for (int64_t h = 0; h < task.num_heads(); ++h) {
    task.cap_and_mask(scores + h * n);
    inv_sum[h] = softmax_inplace(scores + h * n, n);
  }
  std::fill(acc, acc + task.num_heads() * d_len, 0.0f);
  for (int64_t t = 0; t < n; ++t) {
    const scalar_t* v_row = task.v_row(t);
    for (int64_t kv = task.kv_begin; kv < task.kv_end; ++kv) {
      load_as_float(v_row + kv * task.v_h, row, d_len);
      for (int64_t g = 0; g < task.group; ++g) {
        const int64_t h = (kv - task.kv_begin) * task.group + g;
        const float p = scores[h * n + t];
        float* a = acc + h * d_len;
#pragma omp simd
        for (int64_t d = 0; d < d_len; ++d) a[d] += p * row[d];
      }
    }
  }
  for (int64_t h = 0; h < task.num_heads(); ++h) {
    scalar_t* o = task.out + (h0 + h) * task.o_h;
    for (int64_t d = 0; d < d_len; ++d) o[d] = static_cast<scalar_t>(acc[h * d_len + d] * inv_sum[h]);
  }
}

#if defined(__AVX2__) && defined(__FMA__)
#define PDSERVE_AVX2_F32 1

// The four sums of a0..a3's lanes, in order.
inline __m128 sum_lanes4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// fp32 on AVX2 + FMA, head_dim a multiple of 8. Each pass walks the context block by
// block and reads every row of the task's kv heads front to back (a block's rows are
// contiguous, so the hardware prefetcher streams them; the next block's rows are
// prefetched in step with the current ones, since the blocks are scattered):
//   pass 1: q . K four tokens at a time (four independent FMA chains per query head, the
//           four sums reduced together);
//   pass 2: acc[h] += p[h][t] V[t] four tokens at a time, in token order (the fp32 sum
//           order of the generic path), the accumulators in L1.
// Same two-pass math as the generic path. That path spent its time in per-token row
// copies, one-chain dot products and a division per token: at the served W1 shape
// (32 sequences of 320 tokens, 12 heads over 4 kv heads, fp32, blocks scattered over a
// 256 MiB cache) it read the cache at 6.6 GB/s on a 2-core Zen 3; this path at
// 10-11 GB/s, and W1 offline went from 187 to 216 output tok/s.
// Walks tokens [0, n) of one cache (K or V) block by block: `four(row, t)` for each run
// of four tokens t..t+3 inside a block, `one(row, t)` for the others, `row` being token
// t's row of kv head `first_head` (the next token's is `row_stride` floats on). The next
// block's rows (`row_floats` each) are prefetched into L1 in step with the current ones:
// the blocks are scattered, while within one the rows are contiguous and the hardware
// prefetcher streams them.
template <typename index_t, typename Four, typename One>
void walk_rows(const float* cache, const index_t* table, int64_t block_stride, int64_t row_stride,
               int64_t first_head, int64_t row_floats, int64_t n, int64_t bs, Four four, One one) {
  const int64_t num_blocks = (n + bs - 1) / bs, row_lines = (row_floats * 4 + 63) / 64;
  auto block = [&](int64_t b) { return cache + table[b] * block_stride + first_head; };
  auto prefetch = [&](const float* base, int64_t r, int64_t count) {
    const char* first = reinterpret_cast<const char*>(base + r * row_stride);
    for (int64_t i = 0; i < count; ++i)
      for (int64_t line = 0; line < row_lines; ++line)
        __builtin_prefetch(first + i * row_stride * 4 + 64 * line, 0, 3);
  };
  for (int64_t b = 0; b < num_blocks; ++b) {
    const float* rows_of_b = block(b);
    const int64_t t0 = b * bs, rows = std::min(bs, n - t0);
    const float* next = b + 1 < num_blocks ? block(b + 1) : nullptr;
    const int64_t next_rows = next ? std::min(bs, n - t0 - bs) : 0;
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4) {
      if (r < next_rows) prefetch(next, r, std::min<int64_t>(4, next_rows - r));
      four(rows_of_b + r * row_stride, t0 + r);
    }
    if (r < next_rows) prefetch(next, r, next_rows - r);
    for (; r < rows; ++r) one(rows_of_b + r * row_stride, t0 + r);
  }
}

template <typename index_t>
void decode_task_avx2_f32(const DecodeTask<float, index_t>& task, float* scores, float* acc,
                          float* q) {
  const int64_t d_len = task.head_dim, n = task.seq_len, h0 = task.kv_begin * task.group;
  const int64_t group = task.group, kv_heads = task.kv_end - task.kv_begin;
  for (int64_t h = 0; h < task.num_heads(); ++h) {
    const float* src = task.q + (h0 + h) * task.q_h;
    for (int64_t d = 0; d < d_len; ++d) q[h * d_len + d] = src[d] * task.scale;
  }

  // Pass 1: scores, four tokens at a time, every kv head of each row.
  walk_rows(
      task.k, task.table, task.k_b, task.k_t, task.kv_begin * task.k_h, kv_heads * task.k_h, n,
      task.block_size,
      [&](const float* row, int64_t t) {
        for (int64_t kv = 0; kv < kv_heads; ++kv) {
          const float* k0 = row + kv * task.k_h;
          const float* k1 = k0 + task.k_t;
          const float* k2 = k1 + task.k_t;
          const float* k3 = k2 + task.k_t;
          for (int64_t g = 0; g < group; ++g) {
            const int64_t h = kv * group + g;
            const float* qh = q + h * d_len;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t d = 0; d < d_len; d += 8) {
              const __m256 qv = _mm256_loadu_ps(qh + d);
              a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + d), a0);
              a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + d), a1);
              a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + d), a2);
              a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + d), a3);
            }
            _mm_storeu_ps(scores + h * n + t, sum_lanes4(a0, a1, a2, a3));
          }
        }
      },
      [&](const float* row, int64_t t) {
        const __m256 z = _mm256_setzero_ps();
        for (int64_t kv = 0; kv < kv_heads; ++kv) {
          for (int64_t g = 0; g < group; ++g) {
            const int64_t h = kv * group + g;
            __m256 a = z;
            for (int64_t d = 0; d < d_len; d += 8)
              a = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * d_len + d),
                                  _mm256_loadu_ps(row + kv * task.k_h + d), a);
            scores[h * n + t] = _mm_cvtss_f32(sum_lanes4(a, z, z, z));
          }
        }
      });
  std::vector<float> inv_sum(task.num_heads());
  for (int64_t h = 0; h < task.num_heads(); ++h) {
    task.cap_and_mask(scores + h * n);
    inv_sum[h] = softmax_inplace(scores + h * n, n);
  }

  // Pass 2: acc[h] += p[h][t] V[t], in token order, four rows at a time (the
  // accumulators in L1).
  std::fill(acc, acc + task.num_heads() * d_len, 0.0f);
  walk_rows(
      task.v, task.table, task.v_b, task.v_t, task.kv_begin * task.v_h, kv_heads * task.v_h, n,
      task.block_size,
      [&](const float* row, int64_t t) {
        for (int64_t kv = 0; kv < kv_heads; ++kv) {
          const float* v0 = row + kv * task.v_h;
          const float* v1 = v0 + task.v_t;
          const float* v2 = v1 + task.v_t;
          const float* v3 = v2 + task.v_t;
          for (int64_t g = 0; g < group; ++g) {
            const int64_t h = kv * group + g;
            const float* p = scores + h * n + t;
            const __m256 p0 = _mm256_broadcast_ss(p), p1 = _mm256_broadcast_ss(p + 1);
            const __m256 p2 = _mm256_broadcast_ss(p + 2), p3 = _mm256_broadcast_ss(p + 3);
            float* a = acc + h * d_len;
            for (int64_t d = 0; d < d_len; d += 8) {
              __m256 x = _mm256_loadu_ps(a + d);
              x = _mm256_fmadd_ps(p0, _mm256_loadu_ps(v0 + d), x);
              x = _mm256_fmadd_ps(p1, _mm256_loadu_ps(v1 + d), x);
              x = _mm256_fmadd_ps(p2, _mm256_loadu_ps(v2 + d), x);
              x = _mm256_fmadd_ps(p3, _mm256_loadu_ps(v3 + d), x);
              _mm256_storeu_ps(a + d, x);
            }
          }
        }
      },
      [&](const float* row, int64_t t) {
        for (int64_t kv = 0; kv < kv_heads; ++kv) {
          for (int64_t g = 0; g < group; ++g) {
            const int64_t h = kv * group + g;
            const __m256 p = _mm256_broadcast_ss(scores + h * n + t);
            float* a = acc + h * d_len;
            for (int64_t d = 0; d < d_len; d += 8)
              _mm256_storeu_ps(a + d, _mm256_fmadd_ps(p, _mm256_loadu_ps(row + kv * task.v_h + d),
                                                      _mm256_loadu_ps(a + d)));
          }
        }
      });
  for (int64_t h = 0; h < task.num_heads(); ++h) {
    float* o = task.out + (h0 + h) * task.o_h;
    const __m256 inv = _mm256_set1_ps(inv_sum[h]);
    for (int64_t d = 0; d < d_len; d += 8)
      _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(acc + h * d_len + d), inv));
  }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define PDSERVE_AVX512_BF16 1

// bf16 with head_dim = 32 * kChunks on AVX512-BF16: q . K by `vdpbf16ps` (bf16 products
// summed in fp32, as the reference's bf16 matmul), the probabilities rounded to bf16 and
// p V by `vdpbf16ps` on pairs of tokens. Same buffers as the generic path.
template <int kChunks, typename index_t>
void decode_task_avx512_bf16(const DecodeTask<c10::BFloat16, index_t>& task, float* scores,
                             float* acc) {
  constexpr int kHeadDim = 32 * kChunks;
  const int64_t n = task.seq_len, h0 = task.kv_begin * task.group;
  for (int64_t t = 0; t < n; ++t) {
    const c10::BFloat16* k_row = task.k_row(t);
    // NOTE: V's rows too, into L2, for pass 2: a sequence's V (~160 KiB per layer at
    // 320 tokens) stays in L2, and pass 1's loads overlap its DRAM reads with compute,
    // which pass 2's tight loop cannot (~15% faster on a DRAM-resident cache).
    if (t + kPrefetchTokens < n) {
      task.prefetch(task.k_row(t + kPrefetchTokens) + task.kv_begin * task.k_h, task.k_h);
      task.template prefetch<2>(task.v_row(t + kPrefetchTokens) + task.kv_begin * task.v_h,
                                task.v_h);
    }
    for (int64_t kv = task.kv_begin; kv < task.kv_end; ++kv) {
      __m512bh k[kChunks];
      for (int c = 0; c < kChunks; ++c)
        k[c] = (__m512bh)_mm512_loadu_si512(k_row + kv * task.k_h + 32 * c);
      for (int64_t g = 0; g < task.group; ++g) {
        const int64_t h = (kv - task.kv_begin) * task.group + g;
        const c10::BFloat16* qh = task.q + (h0 + h) * task.q_h;
        __m512 dot = _mm512_setzero_ps();
        for (int c = 0; c < kChunks; ++c)
          dot = _mm512_dpbf16_ps(dot, (__m512bh)_mm512_loadu_si512(qh + 32 * c), k[c]);
        scores[h * n + t] = _mm512_reduce_add_ps(dot) * task.scale;
      }
    }
  }
  // Softmax per head, the probabilities rounded to bf16 (as the reference's
  // probs.to(bf16)) over the head's own scores: read as 32-bit words, (p[2i], p[2i+1]).
  for (int64_t h = 0; h < task.num_heads(); ++h) {
    float* s = scores + h * n;
    task.cap_and_mask(s);
    pdserve::softmax_to_bf16_pairs(s, n, reinterpret_cast<uint16_t*>(s));
  }
  // p V, two tokens at a time: rows t and t + 1 of V are interleaved (unpack lo/hi: each
  // 32-bit lane a (v[t][d], v[t+1][d]) pair) and multiplied with the broadcast
  // (p[t], p[t+1]) pair by vdpbf16ps, in token order over the blocks.
  std::fill(acc, acc + task.num_heads() * kHeadDim, 0.0f);
  for (int64_t t = 0; t < n; t += 2) {
    const c10::BFloat16* r0 = task.v_row(t);
    const c10::BFloat16* r1 = t + 1 < n ? task.v_row(t + 1) : r0;  // its p is 0
    for (int64_t ahead = t + kPrefetchTokens; ahead < std::min(n, t + kPrefetchTokens + 2); ++ahead)
      task.prefetch(task.v_row(ahead) + task.kv_begin * task.v_h, task.v_h);
    for (int64_t kv = task.kv_begin; kv < task.kv_end; ++kv) {
      __m512bh lo[kChunks], hi[kChunks];
      for (int c = 0; c < kChunks; ++c) {
        const __m512i x = _mm512_loadu_si512(r0 + kv * task.v_h + 32 * c);
        const __m512i y = _mm512_loadu_si512(r1 + kv * task.v_h + 32 * c);
        lo[c] = (__m512bh)_mm512_unpacklo_epi16(x, y);
        hi[c] = (__m512bh)_mm512_unpackhi_epi16(x, y);
      }
      for (int64_t g = 0; g < task.group; ++g) {
        const int64_t h = (kv - task.kv_begin) * task.group + g;
        const uint32_t pair = reinterpret_cast<const uint32_t*>(scores + h * n)[t / 2];
        const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
        float* a = acc + h * kHeadDim;
        for (int c = 0; c < kChunks; ++c) {
          _mm512_storeu_ps(a + 32 * c, _mm512_dpbf16_ps(_mm512_loadu_ps(a + 32 * c), lo[c], p));
          _mm512_storeu_ps(a + 32 * c + 16,
                           _mm512_dpbf16_ps(_mm512_loadu_ps(a + 32 * c + 16), hi[c], p));
        }
      }
    }
  }
  // Lane order -> dims: acc[32c .. 32c + 16) holds dims 32c + 8L + 0..3 of 128-bit lane L,
  // acc[32c + 16 .. 32c + 32) dims 32c + 8L + 4..7; un-interleave, round to bf16, store.
  const __m512i dims_0_15 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i dims_16_31 =
      _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t h = 0; h < task.num_heads(); ++h) {
    c10::BFloat16* o = task.out + (h0 + h) * task.o_h;
    for (int c = 0; c < kChunks; ++c) {
      const __m512 lo = _mm512_loadu_ps(acc + h * kHeadDim + 32 * c);
      const __m512 hi = _mm512_loadu_ps(acc + h * kHeadDim + 32 * c + 16);
      // fp32 -> bf16 rounding to nearest even, as torch's cast.
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 32 * c),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_permutex2var_ps(lo, dims_0_15, hi)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 32 * c + 16),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_permutex2var_ps(lo, dims_16_31, hi)));
    }
  }
}
#endif

// Runs one task on the fastest path for its dtype and head dim.
template <typename scalar_t, typename index_t>
void run_decode_task(const DecodeTask<scalar_t, index_t>& task, std::vector<float>& scores,
                     std::vector<float>& acc, std::vector<float>& row, std::vector<float>& q) {
  scores.resize(task.num_heads() * task.seq_len);
  acc.resize(task.num_heads() * task.head_dim);
#ifdef PDSERVE_AVX512_BF16
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    switch (task.head_dim) {
      case 64: return decode_task_avx512_bf16<2>(task, scores.data(), acc.data());
      case 128: return decode_task_avx512_bf16<4>(task, scores.data(), acc.data());
      case 256: return decode_task_avx512_bf16<8>(task, scores.data(), acc.data());
      default: break;
    }
  }
#endif
  row.resize(task.head_dim);
  q.resize(task.num_heads() * task.head_dim);
#ifdef PDSERVE_AVX2_F32
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (task.head_dim % 8 == 0)
      return decode_task_avx2_f32(task, scores.data(), acc.data(), q.data());
  }
#endif
  decode_task_generic(task, scores.data(), acc.data(), row.data(), q.data());
}

// Splits the batch into tasks: one per sequence (all its kv heads: each block is then
// read front to back) when there are enough sequences to keep the threads busy, else one
// per (sequence, kv head).
template <typename scalar_t, typename index_t>
void decode_attention_kernel(at::Tensor& out, const at::Tensor& query,
                             const at::Tensor& key_cache, const at::Tensor& value_cache,
                             const at::Tensor& block_tables, const at::Tensor& seq_lens,
                             double scale, int64_t window, double softcap) {
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_blocks = key_cache.size(0), block_size = key_cache.size(1);
  const int64_t num_kv_heads = key_cache.size(2), max_blocks = block_tables.size(1);
  const int64_t heads_per_task =
      num_seqs >= 4 * at::get_num_threads() ? num_kv_heads : 1;
  const int64_t tasks_per_seq = num_kv_heads / heads_per_task;
  const int32_t* lens = seq_lens.const_data_ptr<int32_t>();
  DecodeTask<scalar_t, index_t> base{
      query.const_data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
      key_cache.const_data_ptr<scalar_t>(), value_cache.const_data_ptr<scalar_t>(),
      block_tables.const_data_ptr<index_t>(),
      query.stride(1), out.stride(1), key_cache.stride(0), key_cache.stride(1),
      key_cache.stride(2), value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
      block_size, 0, head_dim, num_heads / num_kv_heads, 0, 0, static_cast<float>(scale),
      static_cast<float>(softcap), 0};

  at::parallel_for(0, num_seqs * tasks_per_seq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc, row, q;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t seq = i / tasks_per_seq;
      DecodeTask<scalar_t, index_t> task = base;
      task.q += seq * query.stride(0);
      task.out += seq * out.stride(0);
      task.table += seq * block_tables.stride(0);
      task.seq_len = lens[seq];
      task.kv_begin = (i % tasks_per_seq) * heads_per_task;
      task.kv_end = task.kv_begin + heads_per_task;
      TORCH_CHECK(task.seq_len >= 1 && task.seq_len <= max_blocks * block_size,
                  "paged_decode_attention: seq_lens[", seq, "] = ", task.seq_len,
                  " is outside [1, max_blocks * block_size = ", max_blocks * block_size, "]");
      if (window > 0 && task.seq_len > window) {
        // The window's keys [seq_len - window, seq_len): the task starts at their first
        // block (earlier entries are never read) and masks the keys before it there.
        const int64_t skip = (task.seq_len - window) / block_size;
        task.table += skip;
        task.seq_len -= skip * block_size;
        task.masked = task.seq_len - window;
      }
      for (int64_t b = 0; b < (task.seq_len + block_size - 1) / block_size; ++b) {
        TORCH_CHECK(task.table[b] >= 0 && task.table[b] < num_blocks,
                    "paged_decode_attention: block_tables[", seq, ", ", b, "] = ",
                    task.table[b], " is outside [0, ", num_blocks, ")");
      }
      run_decode_task(task, scores, acc, row, q);
    }
  });
}

template <typename scalar_t>
void dispatch_index(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                    const at::Tensor& value_cache, const at::Tensor& block_tables,
                    const at::Tensor& seq_lens, double scale, int64_t window, double softcap) {
  if (block_tables.scalar_type() == at::kInt) {
    decode_attention_kernel<scalar_t, int32_t>(out, query, key_cache, value_cache,
                                               block_tables, seq_lens, scale, window, softcap);
  } else {
    decode_attention_kernel<scalar_t, int64_t>(out, query, key_cache, value_cache,
                                               block_tables, seq_lens, scale, window, softcap);
  }
}

// The Python wrapper (paged_decode_attention_cpu) checks shapes, dtypes and strides
// and the block tables' range; these checks guard the raw-pointer loops against a caller
// that skips it.
void paged_decode_attention(at::Tensor out, const at::Tensor& query,
                            const at::Tensor& key_cache, const at::Tensor& value_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens,
                            double scale, int64_t window, double softcap) {
  TORCH_CHECK(window >= 0 && softcap >= 0.0,
              "paged_decode_attention: sliding_window and softcap must be >= 0 (0: off)");
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4 && value_cache.dim() == 4,
              "paged_decode_attention: query must be 3-D and the caches 4-D");
  TORCH_CHECK(query.size(2) <= kMaxHeadDim, "paged_decode_attention: head_dim must be <= ",
              kMaxHeadDim);
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes() && query.size(2) == key_cache.size(3),
              "paged_decode_attention: cache shapes disagree with the query");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0,
              "paged_decode_attention: num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(query.stride(2) == 1 && key_cache.stride(3) == 1 && value_cache.stride(3) == 1 &&
                  out.stride(2) == 1,
              "paged_decode_attention: the last dim of every tensor must be contiguous");
  TORCH_CHECK(out.sizes() == query.sizes() && out.scalar_type() == query.scalar_type(),
              "paged_decode_attention: out must match the query");
  TORCH_CHECK(key_cache.scalar_type() == query.scalar_type() &&
                  value_cache.scalar_type() == query.scalar_type(),
              "paged_decode_attention: the caches must have the query's dtype");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() &&
                  seq_lens.size(0) == query.size(0),
              "paged_decode_attention: seq_lens must be contiguous int32 [num_seqs]");
  TORCH_CHECK((block_tables.scalar_type() == at::kInt ||
               block_tables.scalar_type() == at::kLong) &&
                  block_tables.dim() == 2 && block_tables.stride(1) == 1 &&
                  block_tables.size(0) == query.size(0),
              "paged_decode_attention: block_tables must be int32/int64 [num_seqs, max_blocks]"
              " with a contiguous last dim");
  switch (query.scalar_type()) {
    case at::kFloat:
      dispatch_index<float>(out, query, key_cache, value_cache, block_tables, seq_lens, scale,
                            window, softcap);
      break;
    case at::kBFloat16:
      dispatch_index<c10::BFloat16>(out, query, key_cache, value_cache, block_tables,
                                    seq_lens, scale, window, softcap);
      break;
    case at::kHalf:
      dispatch_index<c10::Half>(out, query, key_cache, value_cache, block_tables, seq_lens,
                                scale, window, softcap);
      break;
    default:
      TORCH_CHECK(false, "paged_decode_attention: unsupported dtype ", query.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY(pdserve_cpu, m) {
  m.def(
      "paged_decode_attention(Tensor(a!) out, Tensor query, Tensor key_cache, "
      "Tensor value_cache, Tensor block_tables, Tensor seq_lens, float scale, "
      "int sliding_window, float softcap) -> ()");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, &paged_decode_attention);
}
