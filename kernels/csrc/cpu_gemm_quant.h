// The packed quantized weight of cpu_gemm_quant.cpp (its layout is described there) and
// what its paths need to read it: the FMA tiles (cpu_gemm_quant.cpp), AMX's tile multiplies
// (cpu_gemm_quant_amx.cpp) and vdpbf16ps (cpu_gemm_quant_bf16.cpp). Built on first use by
// pdserve/kernels/cpu_ext.py.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <optional>


#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define PDSERVE_QUANT_AVX512 1
#endif
#if defined(PDSERVE_QUANT_AVX512) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && \
    defined(__AVX512BF16__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define PDSERVE_QUANT_AMX 1
#endif

namespace pdserve::quant {

constexpr int64_t kPanel = 32;       // output features per panel
constexpr int64_t kSliceBytes = 16384;  // a slice of a panel's values, in L1

// What one call needs to know of the packed weight.
struct QuantPanels {
  const uint8_t* q;        // [panels, K * bits / 8, 32]
  const void* scale;       // [panels, groups, 32]: fp32, fp16, or int8 codes (scale_super)
  const void* min;         // same, or null
  bool half_scales;
  int64_t bits, k, group, groups, panels;
  // Two-level scales (GGUF's K-quants): the scale of group g is its int8 code times
  // scale_super [panels, groups / super_ratio, 32] fp32 of its super-block, and the same
  // for mins with min_super; null where scale (min) holds the scales themselves.
  const float* scale_super = nullptr;
  const float* min_super = nullptr;
  int64_t super_ratio = 1;  // groups per super-block
  // A symmetric int4 weight stored as q + 8 (GGUF Q4_0) keeps no mins: min = -8 * scale.
  bool sym4 = false;

  bool has_min() const { return min != nullptr || sym4; }
  int64_t panel_bytes() const { return k * bits / 8 * kPanel; }
  // K per slice: whole groups within kSliceBytes, or one part of a group larger than that.
  int64_t slice_k() const {
    const int64_t fit = kSliceBytes * 8 / (bits * kPanel);
    return group >= fit ? fit - fit % 2 : fit / group * group;
  }
};

// fn(i) for every work item i in [0, items) on torch's intra-op threads, which take runs of
// run_len consecutive items from one atomic counter (a preempted thread's share is still
// taken by the others). Items are (row block, panel) in that order, so a run is neighbouring
// panels in memory. run_len 1 balances best; memory-bound calls want longer runs
// (stream_run_len).
template <typename Fn>
void for_each_item(int64_t items, int64_t run_len, const Fn& fn) {
  if (items <= 0) return;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), items), 1, [&](int64_t, int64_t) {
    for (int64_t i0; (i0 = next.fetch_add(run_len, std::memory_order_relaxed)) < items;)
      for (int64_t i = i0, end = std::min(items, i0 + run_len); i < end; ++i) fn(i);
  });
}

// Runs for a call that streams its weight from memory (x of 1-4 rows): one a thread, so
// that the prefetch running past one panel's end reads the next panel this thread takes,
// not one another thread has (kPrefetch, below), and each thread starts
// streaming cold once a call. Four runs a thread (dynamic balance) cost that start four
// times: on a 2-core Zen 5, W1's linears (768 and 2048 wide, 0.3-1.6 MB each in int4) read
// 34-38 GB/s of int4 and 35-45 of int8 that way, 38-46 and 42-54 with one run a thread
// (in turns, 3 each); served batch-1 TPOT of W1's Q4_0 file 3.43-3.57 -> 3.33 ms.
inline int64_t stream_run_len(int64_t items) {
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
  return (items + threads - 1) / threads;
}

// How far ahead (bytes) a call that streams its weight (x of 1-4 rows) prefetches the panel
// into L2: its rows leave the loop little time between loads for the hardware prefetcher to
// keep up, and at one row that distance is what bounds the loop. On a 2-core AMD Zen 5,
// 1 KiB ahead into L1 read ~30 GB/s of int8 weights (Llama-3.2-1B's linears, 2 threads),
// 16 KiB ahead into L2 with each thread on runs of consecutive panels (stream_run_len)
// ~41-47 GB/s, and int4 ~25 -> ~31-35 GB/s (benchmarks/README.md, "Decode at batch 1 on
// Llama-3.2-1B's shape").
constexpr int64_t kPrefetch = 16384;

// 32 scales (or mins: base, super) of group g of panel p, as fp32, into out.
inline void load_group(const QuantPanels& w, const void* base, const float* super, int64_t p,
                       int64_t g, float* out) {
  const int64_t at = (p * w.groups + g) * kPanel;
  if (super != nullptr) {
    const auto* codes = static_cast<const int8_t*>(base) + at;
    const float* s = super + (p * (w.groups / w.super_ratio) + g / w.super_ratio) * kPanel;
    for (int j = 0; j < kPanel; ++j) out[j] = static_cast<float>(codes[j]) * s[j];
  } else if (w.half_scales) {
    const auto* h = static_cast<const c10::Half*>(base) + at;
    for (int j = 0; j < kPanel; ++j) out[j] = static_cast<float>(h[j]);
  } else {
    std::memcpy(out, static_cast<const float*>(base) + at, kPanel * sizeof(float));
  }
}

inline void load_scales(const QuantPanels& w, int64_t p, int64_t g, float* out) {
  load_group(w, w.scale, w.scale_super, p, g, out);
}

// The mins of a weight that has them (has_min), sym4's -8 * scale exactly.
inline void load_mins(const QuantPanels& w, int64_t p, int64_t g, float* out) {
  if (!w.sym4) return load_group(w, w.min, w.min_super, p, g, out);
  load_scales(w, p, g, out);
  for (int j = 0; j < kPanel; ++j) out[j] *= -8.0f;
}

#ifdef PDSERVE_QUANT_AVX512

// k's 32 values (int8) as two fp32 vectors times the group's scales.
inline void dequant8(const uint8_t* row, __m512 s0, __m512 s1, __m512& w0, __m512& w1) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
  w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v))), s0);
  w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1))),
                     s1);
}

// The 32 bytes of a pair of k's (int4): the even k's values (low nibbles) and the odd's.
inline void dequant4(const uint8_t* row, __m512 s0, __m512 s1, __m512& e0, __m512& e1,
                     __m512& o0, __m512& o1) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
  const __m256i nib = _mm256_set1_epi8(0x0F);
  const __m256i lo = _mm256_and_si256(v, nib);
  const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
  auto widen = [](__m128i x) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(x)); };
  e0 = _mm512_mul_ps(widen(_mm256_castsi256_si128(lo)), s0);
  e1 = _mm512_mul_ps(widen(_mm256_extracti128_si256(lo, 1)), s1);
  o0 = _mm512_mul_ps(widen(_mm256_castsi256_si128(hi)), s0);
  o1 = _mm512_mul_ps(widen(_mm256_extracti128_si256(hi, 1)), s1);
}

// The same values as fp32, not scaled: int8's 32 of one k, int4's of a pair of k's.
inline void raw8(const uint8_t* row, __m512& w0, __m512& w1) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
  w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v)));
  w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1)));
}

inline void raw4(const uint8_t* row, __m512& e0, __m512& e1, __m512& o0, __m512& o1) {
  // NOTE: each 16 bytes widened to 32-bit lanes straight from memory, then the nibbles
  // split there: two shuffles for the 64 values, not six (the tile's bound at one row)
  const __m512i nib = _mm512_set1_epi32(0x0F);
  const __m512i v0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row)));
  const __m512i v1 =
      _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16)));
  e0 = _mm512_cvtepi32_ps(_mm512_and_si512(v0, nib));
  e1 = _mm512_cvtepi32_ps(_mm512_and_si512(v1, nib));
  o0 = _mm512_cvtepi32_ps(_mm512_srli_epi32(v0, 4));
  o1 = _mm512_cvtepi32_ps(_mm512_srli_epi32(v1, 4));
}

// Group g's 32 scales (or mins: base, super) of panel p as two fp32 vectors.
inline void load_group(const QuantPanels& w, const void* base, const float* super, int64_t p,
                       int64_t g, __m512& v0, __m512& v1) {
  const int64_t at = (p * w.groups + g) * kPanel;
  if (super != nullptr) {  // int8 codes times their super-block's fp32 scales: exact
    const __m256i c = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(static_cast<const int8_t*>(base) + at));
    const float* s = super + (p * (w.groups / w.super_ratio) + g / w.super_ratio) * kPanel;
    v0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(c))),
                       _mm512_loadu_ps(s));
    v1 = _mm512_mul_ps(
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(c, 1))),
        _mm512_loadu_ps(s + 16));
  } else if (w.half_scales) {
    const auto* h = static_cast<const uint16_t*>(base) + at;
    v0 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
    v1 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + 16)));
  } else {
    v0 = _mm512_loadu_ps(static_cast<const float*>(base) + at);
    v1 = _mm512_loadu_ps(static_cast<const float*>(base) + at + 16);
  }
}

inline void load_scales(const QuantPanels& w, int64_t p, int64_t g, __m512& v0, __m512& v1) {
  load_group(w, w.scale, w.scale_super, p, g, v0, v1);
}

// The mins of a weight that has them (has_min), sym4's -8 * scale exactly.
inline void load_mins(const QuantPanels& w, int64_t p, int64_t g, __m512& v0, __m512& v1) {
  if (!w.sym4) return load_group(w, w.min, w.min_super, p, g, v0, v1);
  load_scales(w, p, g, v0, v1);
  const __m512 minus8 = _mm512_set1_ps(-8.0f);
  v0 = _mm512_mul_ps(v0, minus8);
  v1 = _mm512_mul_ps(v1, minus8);
}

#endif

// y [M, N] = x [M, K] W^T + bias on AMX when it serves this call (bf16 x of at least 16
// rows, K a multiple of 32, a CPU and kernel that grant AMX): true once y is written;
// false, y untouched, otherwise (the caller takes the FMA tiles).
bool linear_quant_amx(const QuantPanels& w, const at::Tensor& x,
                      const std::optional<at::Tensor>& bias, at::Tensor& y);

// y [M, N] = x [M, K] W^T + bias by vdpbf16ps on the raw integers (cpu_gemm_quant_bf16.cpp)
// when it serves this call (bf16 x of at least 5 rows, or of 1-4 times an int4 weight, a
// build with AVX512-BF16, and the mode: an AMD CPU by default): true once y is written;
// false, y untouched, otherwise.
bool linear_quant_bf16(const QuantPanels& w, const at::Tensor& x,
                       const std::optional<at::Tensor>& bias, at::Tensor& y);

// Whether linear_quant_bf16 serves the calls it can: -1 where the CPU is AMD's (the
// default), 0 never, 1 always (tests and benchmarks compare both paths on one CPU).
// Returns whether this build has the path at all (AVX512-BF16).
bool set_linear_quant_bf16_mode(int64_t mode);

}  // namespace pdserve::quant
