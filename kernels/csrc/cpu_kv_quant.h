// Quantized KV cache elements (pdserve/kernels/kv_quant.py): int8, fp8 e4m3fn and fp8
// e5m2, each read back as scale * q in fp32. Conversions here give torch's values:
//   widen:  the stored element's exact fp32 value (fp8 decoded from its bits; NaN and inf
//           codes, which no store writes, decode to finite garbage);
//   narrow: x (fp32, already divided by the scale) to the nearest element, ties to even,
//           saturated to +-qmax (int8 by std::nearbyint in the default rounding mode;
//           fp8 by integer operations on x's bits, the values c10's conversion, which
//           torch's .to() uses, gives for every finite x: tested against torch).
// Both are branch-free, so their loops vectorize (no table lookups, no calls); AVX2 /
// AVX-512 versions widen 8 / 16 elements at once for the intrinsics paths.
#pragma once

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <type_traits>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace pdserve {

// fp8 bits -> fp32: normal codes rebias the exponent (kRebias = 127 - bias), subnormal
// ones are mantissa * 2^(1 - bias - kMant) (kStep).
template <int kMant, int kRebias>
inline float fp8_bits_to_float(uint8_t b, float step) {
  const uint32_t magnitude = b & 0x7Fu;
  const uint32_t exponent_bits = magnitude >> kMant;
  const float normal = std::bit_cast<float>((magnitude + (kRebias << kMant)) << (23 - kMant));
  const float subnormal = static_cast<float>(magnitude & ((1u << kMant) - 1)) * step;
  const float value = exponent_bits == 0 ? subnormal : normal;
  return (b & 0x80u) ? -value : value;
}

// fp32 -> fp8 bits, nearest, ties to even, saturated to +-qmax: a normal result rounds
// x's mantissa to kMant bits (a carry bumps the exponent) and rebiases the exponent; below
// the smallest normal, x counts whole subnormal steps (2^(1 - bias - kMant)).
template <int kMant, int kBias>
inline uint8_t float_to_fp8_bits(float x, float qmax, float min_normal, float steps_per_unit) {
  constexpr int kDrop = 23 - kMant;
  x = std::fmin(std::fmax(x, -qmax), qmax);
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  const uint32_t magnitude_bits = bits & 0x7FFFFFFFu;
  const float magnitude = std::bit_cast<float>(magnitude_bits);
  const uint32_t rounded =
      (magnitude_bits + ((1u << (kDrop - 1)) - 1) + ((magnitude_bits >> kDrop) & 1u)) >> kDrop;
  const uint32_t normal = rounded - ((127u - kBias) << kMant);
  const uint32_t steps =
      static_cast<uint32_t>(std::nearbyint(std::fmin(magnitude, min_normal) * steps_per_unit));
  const uint32_t code = magnitude >= min_normal ? normal : steps;
  return static_cast<uint8_t>(code | ((bits >> 31) << 7));
}

template <typename T>
struct Quant;

template <>
struct Quant<int8_t> {
  static constexpr float qmax = 127.0f;
  static float widen(int8_t q) { return static_cast<float>(q); }
  static int8_t narrow(float x) {
    return static_cast<int8_t>(std::fmin(std::fmax(std::nearbyint(x), -qmax), qmax));
  }
};

template <>
struct Quant<c10::Float8_e4m3fn> {
  static constexpr float qmax = 448.0f;
  static float widen(c10::Float8_e4m3fn q) { return fp8_bits_to_float<3, 120>(q.x, 0x1p-9f); }
  static c10::Float8_e4m3fn narrow(float x) {
    return c10::Float8_e4m3fn(float_to_fp8_bits<3, 7>(x, qmax, 0x1p-6f, 0x1p9f),
                              c10::Float8_e4m3fn::from_bits());
  }
};

template <>
struct Quant<c10::Float8_e5m2> {
  static constexpr float qmax = 57344.0f;
  static float widen(c10::Float8_e5m2 q) { return fp8_bits_to_float<2, 112>(q.x, 0x1p-16f); }
  static c10::Float8_e5m2 narrow(float x) {
    return c10::Float8_e5m2(float_to_fp8_bits<2, 15>(x, qmax, 0x1p-14f, 0x1p16f),
                            c10::Float8_e5m2::from_bits());
  }
};

// dst[0..n) = src[0..n) widened (unscaled).
template <typename T>
inline void widen_row(const T* __restrict__ src, float* __restrict__ dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = Quant<T>::widen(src[i]);
}

#if defined(__AVX2__)
template <int kMant, int kRebias>
inline __m256 fp8_to_ps(__m256i b, float step) {
  const __m256i magnitude = _mm256_and_si256(b, _mm256_set1_epi32(0x7F));
  const __m256 normal = _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_add_epi32(magnitude, _mm256_set1_epi32(kRebias << kMant)), 23 - kMant));
  const __m256 subnormal = _mm256_mul_ps(
      _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32((1 << kMant) - 1))),
      _mm256_set1_ps(step));
  const __m256i exponent = _mm256_srli_epi32(magnitude, kMant);
  const __m256 is_subnormal =
      _mm256_castsi256_ps(_mm256_cmpeq_epi32(exponent, _mm256_setzero_si256()));
  const __m256 value = _mm256_blendv_ps(normal, subnormal, is_subnormal);
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
  return _mm256_or_ps(value, _mm256_castsi256_ps(sign));
}

// Eight elements at p, widened.
template <typename T>
inline __m256 widen8(const T* p) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  if constexpr (std::is_same_v<T, int8_t>) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
  } else if constexpr (std::is_same_v<T, c10::Float8_e4m3fn>) {
    return fp8_to_ps<3, 120>(_mm256_cvtepu8_epi32(bytes), 0x1p-9f);
  } else {
    return fp8_to_ps<2, 112>(_mm256_cvtepu8_epi32(bytes), 0x1p-16f);
  }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
template <int kMant, int kRebias>
inline __m512 fp8_to_ps512(__m512i b, float step) {
  const __m512i magnitude = _mm512_and_si512(b, _mm512_set1_epi32(0x7F));
  const __m512 normal = _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_add_epi32(magnitude, _mm512_set1_epi32(kRebias << kMant)), 23 - kMant));
  const __m512 subnormal = _mm512_mul_ps(
      _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32((1 << kMant) - 1))),
      _mm512_set1_ps(step));
  const __mmask16 is_subnormal =
      _mm512_cmpeq_epi32_mask(_mm512_srli_epi32(magnitude, kMant), _mm512_setzero_si512());
  const __m512 value = _mm512_mask_blend_ps(is_subnormal, normal, subnormal);
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(value), sign));
}

// Sixteen elements at p, widened.
template <typename T>
inline __m512 widen16(const T* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (std::is_same_v<T, int8_t>) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
  } else if constexpr (std::is_same_v<T, c10::Float8_e4m3fn>) {
    return fp8_to_ps512<3, 120>(_mm512_cvtepu8_epi32(bytes), 0x1p-9f);
  } else {
    return fp8_to_ps512<2, 112>(_mm512_cvtepu8_epi32(bytes), 0x1p-16f);
  }
}
#endif

}  // namespace pdserve
