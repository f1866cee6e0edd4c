// Helpers shared by pdserve's CPU kernels: dtype conversions that vectorize and a
// vectorizable fp32 exp. Compiled with -fno-trapping-math (see cpu_ext.py), which lets
// the compiler vectorize the clamps and conversions below; results are unchanged.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace pdserve {

// Whether dims [first, dim) of t are packed row-major (size-1 dims may have any stride).
inline bool packed_from(const at::Tensor& t, int64_t first) {
  int64_t expected = 1;
  for (int64_t d = t.dim() - 1; d >= first; --d) {
    if (t.size(d) > 1 && t.stride(d) != expected) return false;
    expected *= t.size(d);
  }
  return true;
}

// How each dtype sits in memory, and its conversions to and from fp32. bf16 is handled
// as raw uint16 with bit operations (round to nearest even, NaN kept quiet, as torch's
// conversion) so the loops vectorize.
template <typename T>
struct Elem {
  using raw = T;
  static float widen(raw x) { return static_cast<float>(x); }
  static raw narrow(float f) { return static_cast<raw>(f); }
};
template <>
struct Elem<c10::BFloat16> {
  using raw = uint16_t;
  static float widen(raw x) { return std::bit_cast<float>(static_cast<uint32_t>(x) << 16); }
  static raw narrow(float f) {
    const uint32_t bits = std::bit_cast<uint32_t>(f);
    const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    return static_cast<raw>((bits & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : rounded);
  }
};

// The value of `f` after a round trip through T (the references' intermediate casts).
template <typename T>
inline float round_to(float f) {
  return Elem<T>::widen(Elem<T>::narrow(f));
}

template <typename T>
inline auto* raw_ptr(const at::Tensor& t) {
  return reinterpret_cast<typename Elem<T>::raw*>(t.data_ptr());
}

// exp in fp32, about 1 ulp, for x clamped to [-87, 88]: x = n ln2 + r with |r| <= ln2/2
// (Cody-Waite split of ln2), exp(r) by its degree-7 Taylor polynomial (error below
// 6e-9 relative), 2^n built in the exponent bits.
inline float exp_f32(float x) {
  x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
  const int32_t k = static_cast<int32_t>(x * 1.44269504088896341f + 128.5f) - 128;  // round
  const float n = static_cast<float>(k);
  const float r = (x - n * 0.693145751953125f) - n * 1.42860682030941723212e-6f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  return p * std::bit_cast<float>(static_cast<uint32_t>(k + 127) << 23);
}

// dst[0..n) = src[0..n) widened to fp32.
template <typename T>
inline void load_as_float(const T* __restrict__ src, float* __restrict__ dst, int64_t n) {
  const auto* raw = reinterpret_cast<const typename Elem<T>::raw*>(src);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = Elem<T>::widen(raw[i]);
}

// A row's largest value, and whether it holds a NaN: row[0..n), n >= 1, one vectorized pass.
struct RowMax {
  float max;
  bool nan;
};
inline RowMax row_max(const float* __restrict__ row, int64_t n) {
  float best = row[0];
  int nan = 0;
#pragma omp simd reduction(max : best) reduction(| : nan)
  for (int64_t i = 0; i < n; ++i) {
    best = std::max(best, row[i]);
    nan |= row[i] != row[i];
  }
  return {best, nan != 0};
}

// torch.argmax of row[0..n) given its row_max: the first index of the largest value, a
// NaN counting as the largest.
inline int64_t argmax_of(const float* row, RowMax m) {
  int64_t index = 0;
  if (m.nan) {
    while (row[index] == row[index]) ++index;
  } else {
    while (row[index] != m.max) ++index;
  }
  return index;
}

// In place: s[t] <- exp(s[t] - max(s)); returns 1 / sum_t of the new s[t].
// Before a softmax over n scores: Gemma 2's soft-capping (softcap > 0: s = softcap *
// tanh(s / softcap)), then the first `masked` scores (keys before a sliding window) set
// to -inf.
inline void cap_and_mask_scores(float* s, int64_t n, float softcap, int64_t masked) {
  if (softcap > 0.0f) {
    const float inv = 1.0f / softcap;
    for (int64_t t = masked; t < n; ++t) s[t] = softcap * std::tanh(s[t] * inv);
  }
  for (int64_t t = 0; t < std::min(masked, n); ++t) s[t] = -INFINITY;
}

inline float softmax_inplace(float* __restrict__ s, int64_t n) {
  float max_score = -INFINITY;
#pragma omp simd reduction(max : max_score)
  for (int64_t t = 0; t < n; ++t) max_score = std::max(max_score, s[t]);
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < n; ++t) {
    s[t] = exp_f32(s[t] - max_score);
    sum += s[t];
  }
  return 1.0f / sum;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
// exp on 16 lanes: the scalar exp_f32's argument split and polynomial, with 2^n applied
// by vscalefps, which overflows to inf and underflows through the denormals to 0 as expf
// (the clamp to [-104, 89] only keeps +-inf inputs out of the argument split).
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(89.0f)), _mm512_set1_ps(-104.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723212e-6f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// Softmax of s[0..n) (n >= 1), rounded to bf16 into p[0..n) and p[n] = 0 for odd n, as
// the references round their probabilities; s[0..n) is left holding exp(s - max). Read
// as 32-bit words, p then holds the (p[2i], p[2i+1]) pairs vdpbf16ps takes. p may be s
// itself: each 16-float load comes before the 16 bf16 it becomes are stored, at no
// higher address. Written with intrinsics: the vectorizer's version of this loop ran
// at about 6 cycles per score.
inline void softmax_to_bf16_pairs(float* s, int64_t n, uint16_t* p) {
  auto tail = [n](int64_t t) {
    return static_cast<__mmask16>((1u << std::min<int64_t>(16, n - t)) - 1);
  };
  __m512 max16 = _mm512_set1_ps(-INFINITY);
  for (int64_t t = 0; t < n; t += 16)
    max16 = _mm512_max_ps(max16, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail(t), s + t));
  const __m512 max_score = _mm512_set1_ps(_mm512_reduce_max_ps(max16));
  __m512 sum16 = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; t += 16) {
    const __mmask16 m = tail(t);
    const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + t), max_score));
    _mm512_mask_storeu_ps(s + t, m, e);
    sum16 = _mm512_mask_add_ps(sum16, m, sum16, e);
  }
  const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum16));
  for (int64_t t = 0; t < n; t += 16) {
    const __mmask16 m = tail(t);
    const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, s + t), inv);
    _mm256_mask_storeu_epi16(p + t, m, (__m256i)_mm512_cvtneps_pbh(x));
  }
  if (n % 2) p[n] = 0;
}
#endif

}  // namespace pdserve
