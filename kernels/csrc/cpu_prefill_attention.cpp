// Paged prefill attention for CPUs with AVX512-BF16 (bf16; head_dim 64, 128 or 256),
// built on first use by pdserve/kernels/cpu_ext.py; other CPUs and dtypes use the
// PyTorch reference (paged_prefill_attention_ref).
//
// One task per (sequence, kv head): its context's K and V rows are read once through
// the block table and packed for `vdpbf16ps` (K as 16-key tiles of (d, d+1) pairs, V as
// (t, t+1) pairs), then every query of the chunk, for the group's query heads, takes
//   scores = scale * q . K[0..pos]    (causal: keys up to the query's position; with a
//                                      sliding window, its last `window` keys; then
//                                      soft-capped where asked, Gemma 2)
//   p      = softmax(scores), rounded to bf16 as the reference's probabilities
//   out    = p V
// with fp32 sums, four (query, head) rows at a time so that each K and V load serves
// four rows (register blocking, as a GEMM micro-kernel). Scores are kept whole per row
// (two-pass softmax), which bounds a row by the context length: 4 bytes per key.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu_common.h"

namespace {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
constexpr bool kHasKernel = true;

struct PrefillArgs {
  const uint16_t* q;  // [tokens, num_heads, head_dim] bf16 bits
  uint16_t* out;
  const uint16_t* k;  // [num_blocks, block_size, num_kv_heads, head_dim]
  const uint16_t* v;
  int64_t q_t, q_h, o_t, o_h, k_b, k_t, k_h, v_b, v_t, v_h, block_size, group;
  float scale;
  int64_t window;  // > 0: a query sees its last `window` keys (itself included)
  float softcap;   // > 0: scores soft-capped (Gemma 2)
};

// Blocks of sequence s's table no query of its chunk sees (all before the first query's
// window): its task starts past them.
inline int64_t blocks_before_window(int64_t ctx, int64_t q_len, int64_t window,
                                    int64_t block_size) {
  return window > 0 ? std::max<int64_t>(0, ctx - q_len - window + 1) / block_size : 0;
}

// Rows of a task: (query i, query head g) pairs in the order r = i * group + g. The
// q . K loop takes kRows rows at a time against four 16-key tiles (16 accumulators: each
// K load serves kRows rows, each q broadcast four tiles); p V takes kPvRows rows at a
// time (their 2 * kChunks accumulators each fill 16 registers), each V load serving
// every row.
constexpr int kRows = 4;

// p V for rows [j0, j0 + kPvRows) of a row block over key pairs [0, pairs): adds
// p[row][k] * (V[2k], V[2k+1]) into registers, then rounds the rows to bf16 into out.
template <int kChunks, int kPvRows>
void pv_rows(const uint32_t* v_packed, const uint32_t* p_pairs, int64_t pair_stride,
             int64_t pairs, uint16_t* const* out_rows) {
  __m512 acc[kPvRows][2 * kChunks];
  for (int j = 0; j < kPvRows; ++j)
    for (int c = 0; c < 2 * kChunks; ++c) acc[j][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < pairs; ++k) {
    __m512bh p[kPvRows];
    for (int j = 0; j < kPvRows; ++j)
      p[j] = (__m512bh)_mm512_set1_epi32(static_cast<int>(p_pairs[j * pair_stride + k]));
    const uint32_t* vk = v_packed + k * 2 * kChunks * 16;
    for (int c = 0; c < 2 * kChunks; ++c) {
      const __m512bh v = (__m512bh)_mm512_loadu_si512(vk + 16 * c);
      for (int j = 0; j < kPvRows; ++j) acc[j][c] = _mm512_dpbf16_ps(acc[j][c], v, p[j]);
    }
  }
  // Lane order of the accumulators -> dims (see the V packing): vector 2c holds dims
  // 32c + 8L + 0..3 of 128-bit lane L, vector 2c + 1 dims 32c + 8L + 4..7.
  const __m512i dims_0_15 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i dims_16_31 =
      _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int j = 0; j < kPvRows; ++j) {
    uint16_t* o = out_rows[j];
    if (o == nullptr) continue;  // a padding row
    for (int c = 0; c < kChunks; ++c) {
      const __m512 d0 = _mm512_permutex2var_ps(acc[j][2 * c], dims_0_15, acc[j][2 * c + 1]);
      const __m512 d1 = _mm512_permutex2var_ps(acc[j][2 * c], dims_16_31, acc[j][2 * c + 1]);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 32 * c), (__m256i)_mm512_cvtneps_pbh(d0));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 32 * c + 16),
                          (__m256i)_mm512_cvtneps_pbh(d1));
    }
  }
}

// One (sequence, kv head): queries [q_begin, q_begin + q_len) of the flat batch sit at
// positions ctx - q_len ... ctx - 1 of a context of ctx tokens.
template <int kChunks, typename index_t>
void prefill_task(const PrefillArgs& a, const index_t* table, int64_t q_begin, int64_t q_len,
                  int64_t ctx, int64_t kv, std::vector<uint32_t>& k_packed,
                  std::vector<uint32_t>& v_packed, std::vector<float>& scores,
                  std::vector<uint32_t>& p_pairs) {
  constexpr int kPairs = 16 * kChunks;  // (d, d+1) pairs per row
  constexpr int kPvRows = 16 / (2 * kChunks) < kRows ? 16 / (2 * kChunks) : kRows;
  const int64_t num_tiles = (ctx + 15) / 16, num_key_pairs = (ctx + 1) / 2;
  // K: tile j holds keys 16j..16j+15 as [kPairs][16 keys] 32-bit (d, d+1) pairs.
  k_packed.assign(num_tiles * kPairs * 16, 0u);
  // V: key pair i holds rows 2i and 2i+1 interleaved, [2 * kChunks][16] 32-bit lanes.
  v_packed.assign(num_key_pairs * 2 * kChunks * 16, 0u);
  for (int64_t t = 0; t < ctx; ++t) {
    const int64_t block = table[t / a.block_size], slot = t % a.block_size;
    const uint32_t* k_row =
        reinterpret_cast<const uint32_t*>(a.k + block * a.k_b + slot * a.k_t + kv * a.k_h);
    uint32_t* k_tile = k_packed.data() + (t / 16) * kPairs * 16 + (t % 16);
    for (int dp = 0; dp < kPairs; ++dp) k_tile[dp * 16] = k_row[dp];
  }
  for (int64_t i = 0; i < num_key_pairs; ++i) {
    const int64_t t0 = 2 * i, t1 = std::min(2 * i + 1, ctx - 1);  // t1 == t0: its p is 0
    const uint16_t* r0 = a.v + table[t0 / a.block_size] * a.v_b + (t0 % a.block_size) * a.v_t +
                         kv * a.v_h;
    const uint16_t* r1 = a.v + table[t1 / a.block_size] * a.v_b + (t1 % a.block_size) * a.v_t +
                         kv * a.v_h;
    uint32_t* dst = v_packed.data() + i * 2 * kChunks * 16;
    for (int c = 0; c < kChunks; ++c) {
      const __m512i x = _mm512_loadu_si512(r0 + 32 * c), y = _mm512_loadu_si512(r1 + 32 * c);
      _mm512_storeu_si512(dst + 32 * c, _mm512_unpacklo_epi16(x, y));
      _mm512_storeu_si512(dst + 32 * c + 16, _mm512_unpackhi_epi16(x, y));
    }
  }
  const int64_t row_stride = num_tiles * 16, pair_stride = row_stride / 2;
  scores.resize(kRows * row_stride);
  p_pairs.resize(kRows * pair_stride);
  const __m512 scale = _mm512_set1_ps(a.scale);
  const int64_t num_rows = q_len * a.group;
  for (int64_t r0 = 0; r0 < num_rows; r0 += kRows) {
    // The block's rows; past the last row, padding rows repeat it (computed, not stored).
    const uint32_t* q_rows[kRows];
    uint16_t* out_rows[kRows];
    int64_t n_row[kRows];  // keys 0 .. pos of the row's query
    for (int j = 0; j < kRows; ++j) {
      const int64_t r = std::min(r0 + j, num_rows - 1), i = r / a.group, g = r % a.group;
      q_rows[j] = reinterpret_cast<const uint32_t*>(a.q + (q_begin + i) * a.q_t +
                                                    (kv * a.group + g) * a.q_h);
      out_rows[j] = r0 + j < num_rows ? a.out + (q_begin + i) * a.o_t + (kv * a.group + g) * a.o_h
                                      : nullptr;
      n_row[j] = ctx - q_len + i + 1;
    }
    const int64_t n_max = n_row[kRows - 1];  // rows go in query order
    const int64_t tiles = (n_max + 15) / 16, pairs = (n_max + 1) / 2;
    // q . K, four 16-key tiles at a time for all kRows rows; a row's keys past its own
    // query are computed here and never read.
    for (int64_t tile = 0; tile < tiles; tile += 4) {
      const uint32_t* kt[4];
      for (int u = 0; u < 4; ++u)  // past the last tile the loads repeat `tile` (in bounds)
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
                           _mm512_mul_ps(acc[j][u], scale));
    }
    for (int j = 0; j < kRows; ++j) {
      uint16_t* p = reinterpret_cast<uint16_t*>(p_pairs.data() + j * pair_stride);
      float* row_scores = scores.data() + j * row_stride;
      pdserve::cap_and_mask_scores(row_scores, n_row[j], a.softcap,
                                   a.window > 0 ? std::max<int64_t>(0, n_row[j] - a.window) : 0);
      pdserve::softmax_to_bf16_pairs(row_scores, n_row[j], p);
      std::fill(p + n_row[j], p + 2 * pairs, uint16_t{0});  // keys past the row's query
    }
    for (int j0 = 0; j0 < kRows; j0 += kPvRows)
      pv_rows<kChunks, kPvRows>(v_packed.data(), p_pairs.data() + j0 * pair_stride, pair_stride,
                                pairs, out_rows + j0);
  }
}

template <int kChunks, typename index_t>
void prefill_kernel(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                    const at::Tensor& value_cache, const at::Tensor& block_tables,
                    const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens, double scale,
                    int64_t window, double softcap) {
  const int64_t num_seqs = seq_lens.size(0), num_kv_heads = key_cache.size(2);
  const int64_t block_size = key_cache.size(1), num_blocks = key_cache.size(0);
  const int64_t max_blocks = block_tables.size(1);
  const int32_t* cu = cu_seqlens_q.const_data_ptr<int32_t>();
  const int32_t* lens = seq_lens.const_data_ptr<int32_t>();
  const index_t* tables = block_tables.const_data_ptr<index_t>();
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = cu[s + 1] - cu[s], ctx = lens[s];
    TORCH_CHECK(q_len >= 0 && q_len <= ctx && ctx <= max_blocks * block_size,
                "paged_prefill_attention: sequence ", s, " has a chunk of ", q_len,
                " tokens in a context of ", ctx, " (its table holds ", max_blocks * block_size,
                ")");
    const int64_t skip = blocks_before_window(ctx, q_len, window, block_size);
    for (int64_t b = skip; b < (ctx + block_size - 1) / block_size; ++b) {
      const int64_t block = tables[s * block_tables.stride(0) + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "paged_prefill_attention: block_tables[",
                  s, ", ", b, "] = ", block, " is outside [0, ", num_blocks, ")");
    }
  }
  TORCH_CHECK(cu[0] == 0 && cu[num_seqs] == query.size(0),
              "paged_prefill_attention: cu_seqlens_q must run from 0 to the token count");
  const PrefillArgs args{
      reinterpret_cast<const uint16_t*>(query.const_data_ptr()),
      reinterpret_cast<uint16_t*>(out.data_ptr()),
      reinterpret_cast<const uint16_t*>(key_cache.const_data_ptr()),
      reinterpret_cast<const uint16_t*>(value_cache.const_data_ptr()),
      query.stride(0), query.stride(1), out.stride(0), out.stride(1),
      key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
      value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
      block_size, query.size(1) / num_kv_heads, static_cast<float>(scale), window,
      static_cast<float>(softcap)};
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> k_packed, v_packed, p_pairs;
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / num_kv_heads, kv = task % num_kv_heads;
      const int64_t q_len = cu[s + 1] - cu[s];
      if (q_len == 0) continue;
      // NOTE: past the blocks no query sees, positions shift by whole blocks: the
      // window's bounds (counted back from each query) are the same
      const int64_t skip = blocks_before_window(lens[s], q_len, window, block_size);
      prefill_task<kChunks, index_t>(args, tables + s * block_tables.stride(0) + skip, cu[s],
                                     q_len, lens[s] - skip * block_size, kv, k_packed,
                                     v_packed, scores, p_pairs);
    }
  });
}

void paged_prefill_attention(at::Tensor out, const at::Tensor& query,
                             const at::Tensor& key_cache, const at::Tensor& value_cache,
                             const at::Tensor& block_tables, const at::Tensor& cu_seqlens_q,
                             const at::Tensor& seq_lens, double scale, int64_t window,
                             double softcap) {
  TORCH_CHECK(window >= 0 && softcap >= 0.0,
              "paged_prefill_attention: sliding_window and softcap must be >= 0 (0: off)");
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes(),
              "paged_prefill_attention: query must be 3-D and the caches 4-D of one shape");
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && key_cache.scalar_type() == at::kBFloat16 &&
                  value_cache.scalar_type() == at::kBFloat16 &&
                  out.scalar_type() == at::kBFloat16,
              "paged_prefill_attention: the CPU kernel takes bf16 only");
  TORCH_CHECK(query.size(2) == key_cache.size(3) && query.size(1) % key_cache.size(2) == 0,
              "paged_prefill_attention: head_dim or head counts disagree with the caches");
  TORCH_CHECK(out.sizes() == query.sizes(), "paged_prefill_attention: out must match query");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && key_cache.stride(3) == 1 &&
                  value_cache.stride(3) == 1,
              "paged_prefill_attention: the last dim of every tensor must be contiguous");
  TORCH_CHECK(cu_seqlens_q.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  cu_seqlens_q.is_contiguous() && seq_lens.is_contiguous() &&
                  cu_seqlens_q.size(0) == seq_lens.size(0) + 1,
              "paged_prefill_attention: cu_seqlens_q [num_seqs + 1] and seq_lens [num_seqs] "
              "must be contiguous int32");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.stride(1) == 1 &&
                  block_tables.size(0) == seq_lens.size(0) &&
                  (block_tables.scalar_type() == at::kInt ||
                   block_tables.scalar_type() == at::kLong),
              "paged_prefill_attention: block_tables must be int32/int64 [num_seqs, max_blocks]");
  const bool int32_tables = block_tables.scalar_type() == at::kInt;
#define PDSERVE_PREFILL(CHUNKS)                                                              \
  return int32_tables ? prefill_kernel<CHUNKS, int32_t>(out, query, key_cache, value_cache,   \
                                                        block_tables, cu_seqlens_q, seq_lens, \
                                                        scale, window, softcap)              \
                      : prefill_kernel<CHUNKS, int64_t>(out, query, key_cache, value_cache,   \
                                                        block_tables, cu_seqlens_q, seq_lens, \
                                                        scale, window, softcap)
  switch (query.size(2)) {
    case 64: PDSERVE_PREFILL(2);
    case 128: PDSERVE_PREFILL(4);
    case 256: PDSERVE_PREFILL(8);
    default: TORCH_CHECK(false, "paged_prefill_attention: head_dim must be 64, 128 or 256");
  }
#undef PDSERVE_PREFILL
}
#else
constexpr bool kHasKernel = false;

void paged_prefill_attention(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                             const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                             int64_t, double) {
  TORCH_CHECK(false, "paged_prefill_attention: this CPU has no AVX512-BF16");
}
#endif

// Whether paged_prefill_attention runs here (AVX512-BF16 built in).
bool has_paged_prefill_attention() { return kHasKernel; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def(
      "paged_prefill_attention(Tensor(a!) out, Tensor query, Tensor key_cache, "
      "Tensor value_cache, Tensor block_tables, Tensor cu_seqlens_q, Tensor seq_lens, "
      "float scale, int sliding_window, float softcap) -> ()");
  m.impl("paged_prefill_attention", c10::DispatchKey::CPU, &paged_prefill_attention);
  m.def("has_paged_prefill_attention() -> bool", &has_paged_prefill_attention);
}
