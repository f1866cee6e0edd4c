// Helpers shared by pdserve's CPU kernels: dtype conversions that vectorize and a
// vectorizable fp32 exp. Compiled with -fno-trapping-math (see cpu_ext.py), which lets
// the compiler vectorize the clamps and conversions below; results are unchanged.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <bit>
#include <cstdint>

namespace pdserve {

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

}  // namespace pdserve
