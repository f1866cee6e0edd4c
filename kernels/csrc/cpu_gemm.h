// pdserve's packed linear layers on the CPU: the AVX-512 path (cpu_gemm_avx512.cpp), which
// cpu_gemm.cpp's ops take on AVX-512 builds; AVX2 builds use cpu_gemm.cpp's own path.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

#include "cpu_common.h"

namespace pdserve::gemm_avx512 {

// Whether this build has the AVX-512 path (AVX512F, BW and VL).
bool available();

// Output features per packed panel (32).
int64_t panel_width();

// W [N, K] float32 or bfloat16 -> [ceil(N / 32), K, 32] panels in W's dtype.
at::Tensor pack(const at::Tensor& weight);

// y [M, N] = x [M, K] W^T + bias in fp32 arithmetic, in the weight's dtype (x's and the
// bias's too), W packed by pack(); N = out_features.
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed,
                  const std::optional<at::Tensor>& bias, int64_t out_features);

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// acc [m, 32] += a [m, kc] b [kc, 32], all fp32: a's rows lda floats apart, b one slice of
// a panel (32 features per k, contiguous; at most 16 KiB, so that it stays in L1), acc's
// rows 32 floats apart. linear()'s 12 x 32 register tiles over that slice: the quantized
// linear (cpu_gemm_quant.cpp) runs them on slices it dequantizes. AVX-512 builds only.
void accumulate_slice(const float* a, int64_t lda, int64_t m, const float* b, int64_t kc,
                      float* acc);
#endif

}  // namespace pdserve::gemm_avx512
