// Packed linear layers: the ops pack_linear_weight and linear_packed, built on first use
// by pdserve/kernels/cpu_ext.py. On AVX-512 CPUs they run cpu_gemm_avx512.cpp (fp32 and
// bf16, 32-feature panels); this file holds the fp32 path for AVX2 + FMA CPUs without
// AVX-512: y = x W^T (+ b) with W packed once, at load, into panels of 16 output features.
//
// The blocking is GotoBLAS's (Goto and van de Geijn, "Anatomy of High-Performance Matrix
// Multiplication", ACM TOMS 34(3), 2008), with the weight as the packed operand: a
// 6 x 16 register tile (12 ymm accumulators, two ymm of W and one broadcast of x per k)
// runs over KC = 384 of K at a time, so the panel's 24 KiB slice stays in L1 while the
// tiles of up to MC = 192 rows of x (288 KiB of them per slice, in L2) pass over it. Work items are (row block,
// panel) pairs handed out from one atomic counter on torch's intra-op threads: a thread
// that the kernel preempts holds up only the item it is in, where a static split (as
// oneDNN's) leaves its partner idle at the barrier for its whole share.
//
// Measured on a 2-core Zen 3 (benchmarks/cpu_linear.py), on the linears of one forward
// pass of a 125M Llama: 1.11-1.33x oneDNN's packed fp32 linear from 1 to 128 rows,
// 1.01-1.04x at 256 and 1024 (KC = 256 had given 0.90 at 1024).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include "cpu_gemm.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <optional>
#include <type_traits>

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>
#define PDSERVE_PACKED_LINEAR 1
#endif

namespace {

constexpr int64_t kPanel = 16;    // output features per packed panel (two ymm)
constexpr int64_t kBlockK = 384;  // K per pass over a panel: 24 KiB of it in L1
constexpr int64_t kBlockM = 192;  // rows of x per work item: 288 KiB per KC slice, in L2

// W [N, K] -> [ceil(N / 16), K, 16]: panel p, row k holds W[16p .. 16p + 16)[k], the
// features past N zero.
at::Tensor pack_linear_weight(const at::Tensor& weight) {
  if (pdserve::gemm_avx512::available()) return pdserve::gemm_avx512::pack(weight);
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
              "pack_linear_weight: weight must be a 2-D float32 CPU tensor [out_features, "
              "in_features], got ", weight.sizes(), " ", weight.scalar_type());
  const int64_t n = weight.size(0), k = weight.size(1), panels = (n + kPanel - 1) / kPanel;
  at::Tensor packed = at::zeros({panels, k, kPanel}, weight.options());
  const at::Tensor w = weight.contiguous();
  const float* src = w.const_data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t j = 0; j < kPanel && p * kPanel + j < n; ++j) {
        const float* row = src + (p * kPanel + j) * k;
        float* col = dst + p * k * kPanel + j;
        for (int64_t i = 0; i < k; ++i) col[i * kPanel] = row[i];
      }
    }
  });
  return packed;
}

#ifdef PDSERVE_PACKED_LINEAR

// c[kRows, 16] = (first ? bias : c) + a[kRows, kc] b[kc, 16]; a's rows lda apart, b a
// panel slice (rows 16 floats apart), c's rows ldc apart; bias null or 16 floats.
template <int kRows>
inline void tile(const float* __restrict a, int64_t lda, const float* __restrict b, int64_t kc,
                 float* __restrict c, int64_t ldc, bool first, const float* bias) {
  __m256 acc[kRows][2];
#pragma GCC unroll 6
  for (int r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 b0 = _mm256_loadu_ps(b + k * kPanel), b1 = _mm256_loadu_ps(b + k * kPanel + 8);
#pragma GCC unroll 6
    for (int r = 0; r < kRows; ++r) {
      const __m256 x = _mm256_broadcast_ss(a + r * lda + k);
      acc[r][0] = _mm256_fmadd_ps(x, b0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(x, b1, acc[r][1]);
    }
  }
  __m256 base0 = _mm256_setzero_ps(), base1 = base0;
  if (first && bias) base0 = _mm256_loadu_ps(bias), base1 = _mm256_loadu_ps(bias + 8);
#pragma GCC unroll 6
  for (int r = 0; r < kRows; ++r) {
    float* row = c + r * ldc;
    const __m256 c0 = first ? base0 : _mm256_loadu_ps(row);
    const __m256 c1 = first ? base1 : _mm256_loadu_ps(row + 8);
    _mm256_storeu_ps(row, _mm256_add_ps(c0, acc[r][0]));
    _mm256_storeu_ps(row + 8, _mm256_add_ps(c1, acc[r][1]));
  }
}

// One work item: rows [0, m) of x (row stride k) times one panel, into columns
// [n0, n0 + cols) of y (row stride n); cols < 16 only for the last panel, which goes
// through a 16-wide scratch tile.
void run_item(const float* x, int64_t m, int64_t k, const float* panel, const float* bias,
              float* y, int64_t n, int64_t n0, int64_t cols) {
  alignas(32) float scratch[6 * kPanel];
  alignas(32) float bias_tile[kPanel] = {};
  const float* tile_bias = nullptr;
  if (bias) {
    std::copy(bias + n0, bias + n0 + cols, bias_tile);
    tile_bias = bias_tile;
  }
  for (int64_t k0 = 0; k0 < k; k0 += kBlockK) {
    const int64_t kc = std::min(kBlockK, k - k0);
    const bool first = k0 == 0;
    auto rows = [&](auto count, int64_t r0) {
      constexpr int kRows = decltype(count)::value;
      const float* a = x + r0 * k + k0;
      const float* b = panel + k0 * kPanel;
      float* c = y + r0 * n + n0;
      if (cols == kPanel) return tile<kRows>(a, k, b, kc, c, n, first, tile_bias);
      if (!first)
        for (int r = 0; r < kRows; ++r) std::copy(c + r * n, c + r * n + cols, scratch + r * kPanel);
      tile<kRows>(a, k, b, kc, scratch, kPanel, first, tile_bias);
      for (int r = 0; r < kRows; ++r) std::copy(scratch + r * kPanel, scratch + r * kPanel + cols, c + r * n);
    };
    int64_t r0 = 0;
    for (; r0 + 6 <= m; r0 += 6) rows(std::integral_constant<int, 6>{}, r0);
    switch (m - r0) {
      case 5: rows(std::integral_constant<int, 5>{}, r0); break;
      case 4: rows(std::integral_constant<int, 4>{}, r0); break;
      case 3: rows(std::integral_constant<int, 3>{}, r0); break;
      case 2: rows(std::integral_constant<int, 2>{}, r0); break;
      case 1: rows(std::integral_constant<int, 1>{}, r0); break;
      default: break;
    }
  }
}

#endif

// y [M, N] = x [M, K] W^T + bias, W packed by pack_linear_weight; out_features = N.
at::Tensor linear_packed(const at::Tensor& x, const at::Tensor& packed,
                         const std::optional<at::Tensor>& bias, int64_t out_features) {
  if (pdserve::gemm_avx512::available())
    return pdserve::gemm_avx512::linear(x, packed, bias, out_features);
#ifdef PDSERVE_PACKED_LINEAR
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "linear_packed: x must be a 2-D float32 CPU tensor [tokens, in_features], got ",
              x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous() &&
                  packed.scalar_type() == at::kFloat,
              "linear_packed: packed must come from pack_linear_weight, got ", packed.sizes());
  const int64_t m = x.size(0), k = x.size(1), n = out_features, panels = packed.size(0);
  TORCH_CHECK(packed.size(1) == k, "linear_packed: x has ", k, " in_features, the weight ",
              packed.size(1));
  TORCH_CHECK(n > (panels - 1) * kPanel && n <= panels * kPanel, "linear_packed: out_features ",
              n, " does not fit ", panels, " panels of ", kPanel);
  const float* bias_ptr = nullptr;
  at::Tensor bias_c;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == at::kFloat,
                "linear_packed: bias must be float32 [", n, "], got ", bias->sizes());
    bias_c = bias->contiguous();
    bias_ptr = bias_c.const_data_ptr<float>();
  }
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const at::Tensor xc = x.contiguous();
  const float* a = xc.const_data_ptr<float>();
  const float* w = packed.const_data_ptr<float>();
  float* out = y.data_ptr<float>();
  const int64_t row_blocks = (m + kBlockM - 1) / kBlockM, items = row_blocks * panels;
  std::atomic<int64_t> next{0};
  // NOTE: one index per thread of the team (grain 1); each then takes items until none
  // are left. Nested in another parallel region this runs on the calling thread alone.
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), items), 1, [&](int64_t, int64_t) {
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < items;) {
      const int64_t block = i / panels, p = i % panels, r0 = block * kBlockM;
      run_item(a + r0 * k, std::min(kBlockM, m - r0), k, w + p * k * kPanel, bias_ptr,
               out + r0 * n, n, p * kPanel, std::min(kPanel, n - p * kPanel));
    }
  });
  return y;
#else
  TORCH_CHECK(false, "linear_packed: built without AVX2 + FMA or AVX-512 "
              "(has_linear_packed() is False here)");
#endif
}

// Whether linear_packed runs here (AVX2 + FMA, or AVX-512, built in).
bool has_linear_packed() {
#ifdef PDSERVE_PACKED_LINEAR
  return true;
#else
  return pdserve::gemm_avx512::available();
#endif
}

// Output features per packed panel: 32 on AVX-512 builds, 16 on AVX2 ones.
int64_t linear_panel_width() {
  return pdserve::gemm_avx512::available() ? pdserve::gemm_avx512::panel_width() : kPanel;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.impl("pack_linear_weight", c10::DispatchKey::CPU, &pack_linear_weight);
  m.def("linear_packed(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
  m.impl("linear_packed", c10::DispatchKey::CPU, &linear_packed);
  m.def("has_linear_packed() -> bool", &has_linear_packed);
  m.def("linear_panel_width() -> int", &linear_panel_width);
}
