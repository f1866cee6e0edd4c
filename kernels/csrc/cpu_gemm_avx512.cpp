// Linear layers on AVX-512 CPUs: y = x W^T (+ b) in fp32 arithmetic, for fp32 and bf16
// models, with W packed once, at load, into panels of 32 output features. Declared in
// cpu_gemm.h; cpu_gemm.cpp registers the ops and picks this path on AVX-512 builds.
//
// Why a bf16 model computes its linears with fp32 FMAs here: on Intel cores without AMX,
// oneDNN's bf16 GEMM (vdpbf16ps) ran at 140-167 GFLOP/s on a 2-core Xeon where MKL's
// fp32 GEMM ran at 150-300 (benchmarks/cpu_linear.py). So x and W stay bf16 in memory,
// are widened to fp32 on the way in (exact), summed in fp32 and rounded to bf16 once at
// the end, as oneDNN's bf16 linear does, at the fp32 FMA rate.
//
// The blocking is GotoBLAS's (Goto and van de Geijn, "Anatomy of High-Performance Matrix
// Multiplication", ACM TOMS 34(3), 2008) with the weight as the packed operand: a 12 x 32
// register tile (24 zmm accumulators, two zmm of W and one broadcast of x per k) runs over
// a 16 KiB slice of a panel (256 of K in bf16, 128 in fp32), which stays in L1 while the
// tiles of a 96-row block of x (in L2) pass over it; the first tile prefetches the next
// slice. A bf16 panel holds each k's 32 features as 16 32-bit words, feature i in the low
// half and feature 16 + i in the high half, so one load and two bit operations (shift
// left, mask) widen them into the two fp32 vectors. Work items are (row block, panel)
// pairs handed out from one atomic counter on torch's intra-op threads, block-major, so a
// thread walks the panels of one block of x and a preempted thread holds up one item, not
// half the matrix. Measured on a 2-core Xeon without AMX over one forward pass's linears
// of a 125M Llama (benchmarks/cpu_linear.py, bf16): 220-266 GFLOP/s from 32 to 1024 rows,
// 1.56-1.60x oneDNN's bf16 linear, 1.26x at 1 row.

#include "cpu_gemm.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define PDSERVE_GEMM_AVX512 1
#endif

namespace pdserve::gemm_avx512 {

namespace {

constexpr int64_t kPanel = 32;   // output features per packed panel (two zmm)
constexpr int kTileRows = 12;    // rows of x per register tile
constexpr int64_t kBlockM = 96;  // rows of x per work item: 8 tiles over one panel
// K per pass over a panel: its slice, 16 KiB in bf16 or fp32, stays in L1 beside 12 rows of x.
template <typename W>
constexpr int64_t kBlockK = 16384 / (kPanel * int64_t(sizeof(W)));

bool is_supported(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16; }

const char* dtype_name(at::ScalarType t) { return t == at::kFloat ? "float32" : "bfloat16"; }

}  // namespace

bool available() {
#ifdef PDSERVE_GEMM_AVX512
  return true;
#else
  return false;
#endif
}

int64_t panel_width() { return kPanel; }

// W [N, K] -> [ceil(N / 32), K, 32] in W's dtype, the features past N zero; a bf16 row k
// of panel p holds, at 2i and 2i + 1, W[32p + i][k] and W[32p + 16 + i][k].
at::Tensor pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && is_supported(weight.scalar_type()) && weight.device().is_cpu(),
              "pack_linear_weight: weight must be a 2-D float32 or bfloat16 CPU tensor "
              "[out_features, in_features], got ", weight.sizes(), " ", weight.scalar_type());
  const int64_t n = weight.size(0), k = weight.size(1), panels = (n + kPanel - 1) / kPanel;
  const bool bf16 = weight.scalar_type() == at::kBFloat16;
  at::Tensor packed = at::zeros({panels, k, kPanel}, weight.options());
  const at::Tensor w = weight.contiguous();
  const int64_t item = bf16 ? 2 : 4;  // bytes per element
  const auto* src = static_cast<const char*>(w.const_data_ptr());
  auto* dst = static_cast<char*>(packed.data_ptr());
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t j = 0; j < kPanel && p * kPanel + j < n; ++j) {
        const int64_t lane = bf16 ? (j < 16 ? 2 * j : 2 * (j - 16) + 1) : j;
        const char* row = src + (p * kPanel + j) * k * item;
        char* col = dst + (p * k * kPanel + lane) * item;
        for (int64_t i = 0; i < k; ++i) std::memcpy(col + i * kPanel * item, row + i * item, item);
      }
    }
  });
  return packed;
}

#ifdef PDSERVE_GEMM_AVX512

namespace {

// The 32 weights of one k of a panel as fp32 features [0, 16) and [16, 32).
inline void load_weights(const float* b, __m512& w0, __m512& w1) {
  w0 = _mm512_loadu_ps(b);
  w1 = _mm512_loadu_ps(b + 16);
}
inline void load_weights(const uint16_t* b, __m512& w0, __m512& w1) {
  const __m512i words = _mm512_loadu_si512(b);
  w0 = _mm512_castsi512_ps(_mm512_slli_epi32(words, 16));
  w1 = _mm512_castsi512_ps(_mm512_and_si512(words, _mm512_set1_epi32(int32_t(0xFFFF0000u))));
}

// fp32 -> bf16, round to nearest even, NaN kept quiet (as c10::BFloat16).
inline __m256i to_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(rounded);
}

inline void store(float* c, __mmask16 mask, __m512 v) { _mm512_mask_storeu_ps(c, mask, v); }
inline void store(uint16_t* c, __mmask16 mask, __m512 v) {
  _mm256_mask_storeu_epi16(c, mask, to_bf16(v));
}

// One register tile over one K slice: acc = (first ? 0 : partial) + a[kRows, kc] b[kc, 32],
// a's rows lda floats apart, b the panel's slice (prefetch: also bring the next slice, kc
// further, into L1), partial the item's fp32 buffer (rows 32 floats apart). The last slice writes
// acc + bias to c (rows ldc apart, columns [0, cols)) in c's dtype, the others to partial;
// bias is 32 fp32 values (zero past the layer's features) or null.
template <int kRows, typename W, typename Out>
inline void tile(const float* __restrict a, int64_t lda, const W* __restrict b, int64_t kc,
                 bool prefetch, bool first, bool last, float* __restrict partial,
                 Out* __restrict c, int64_t ldc, const float* bias, int64_t cols) {
  __m512 acc[kRows][2];
#pragma GCC unroll 12
  for (int r = 0; r < kRows; ++r) {
    acc[r][0] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(partial + r * kPanel);
    acc[r][1] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(partial + r * kPanel + 16);
  }
  for (int64_t i = 0; i < kc; ++i) {
    __m512 w0, w1;
    if (prefetch) {  // NOTE: row i of the next slice, while row i of this one is used
      _mm_prefetch(reinterpret_cast<const char*>(b + (i + kc) * kPanel), _MM_HINT_T0);
      if constexpr (sizeof(W) == 4)
        _mm_prefetch(reinterpret_cast<const char*>(b + (i + kc) * kPanel + 16), _MM_HINT_T0);
    }
    load_weights(b + i * kPanel, w0, w1);
#pragma GCC unroll 12
    for (int r = 0; r < kRows; ++r) {
      const __m512 x = _mm512_set1_ps(a[r * lda + i]);
      acc[r][0] = _mm512_fmadd_ps(x, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(x, w1, acc[r][1]);
    }
  }
  if (!last) {
#pragma GCC unroll 12
    for (int r = 0; r < kRows; ++r) {
      _mm512_storeu_ps(partial + r * kPanel, acc[r][0]);
      _mm512_storeu_ps(partial + r * kPanel + 16, acc[r][1]);
    }
    return;
  }
  const __m512 bias0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  const __m512 bias1 = bias ? _mm512_loadu_ps(bias + 16) : _mm512_setzero_ps();
  const __mmask16 mask0 = cols >= 16 ? 0xFFFF : __mmask16((1u << cols) - 1);
  const __mmask16 mask1 =
      cols >= 32 ? 0xFFFF : (cols <= 16 ? 0 : __mmask16((1u << (cols - 16)) - 1));
#pragma GCC unroll 12
  for (int r = 0; r < kRows; ++r) {
    store(c + r * ldc, mask0, _mm512_add_ps(acc[r][0], bias0));
    store(c + r * ldc + 16, mask1, _mm512_add_ps(acc[r][1], bias1));
  }
}

template <typename W, typename Out, int kRows = kTileRows>
inline void tail(int rows, const float* a, int64_t lda, const W* b, int64_t kc, bool prefetch,
                 bool first, bool last, float* partial, Out* c, int64_t ldc, const float* bias,
                 int64_t cols) {
  if constexpr (kRows > 0) {
    if (rows == kRows)
      return tile<kRows>(a, lda, b, kc, prefetch, first, last, partial, c, ldc, bias, cols);
    tail<W, Out, kRows - 1>(rows, a, lda, b, kc, prefetch, first, last, partial, c, ldc, bias,
                            cols);
  }
}

// Rows [0, m) of x (fp32, lda apart) times one panel into columns [n0, n0 + cols) of y,
// K in slices of kBlockK so the panel's slice stays in L1 while the row tiles pass over it.
template <typename W, typename Out>
void run_item(const float* a, int64_t lda, int64_t m, int64_t k, const W* panel,
              const float* bias, Out* y, int64_t n, int64_t n0, int64_t cols) {
  alignas(64) float partial[kBlockM * kPanel];
  for (int64_t k0 = 0; k0 < k; k0 += kBlockK<W>) {
    const int64_t kc = std::min(kBlockK<W>, k - k0);
    const bool first = k0 == 0, last = k0 + kc == k;
    const W* b = panel + k0 * kPanel;
    const int64_t next_kc = std::min(kBlockK<W>, k - k0 - kc);  // 0 on the last slice
    for (int64_t r0 = 0; r0 < m; r0 += kTileRows) {
      const bool prefetch = r0 == 0 && next_kc == kBlockK<W>;
      const float* tile_a = a + r0 * lda + k0;
      float* tile_partial = partial + r0 * kPanel;
      Out* c = y + r0 * n + n0;
      if (r0 + kTileRows <= m)
        tile<kTileRows>(tile_a, lda, b, kc, prefetch, first, last, tile_partial, c, n, bias, cols);
      else
        tail<W, Out>(int(m - r0), tile_a, lda, b, kc, prefetch, first, last, tile_partial, c, n,
                     bias, cols);
    }
  }
}

template <typename W, typename Out>
void run(const float* a, int64_t lda, int64_t m, int64_t k, const W* w, int64_t panels,
         const float* bias, Out* y, int64_t n) {
  const int64_t row_blocks = (m + kBlockM - 1) / kBlockM, items = row_blocks * panels;
  std::atomic<int64_t> next{0};
  // NOTE: one index per thread of the team (grain 1); each then takes items until none
  // are left. Nested in another parallel region this runs on the calling thread alone.
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), items), 1, [&](int64_t, int64_t) {
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < items;) {
      const int64_t block = i / panels, p = i % panels, r0 = block * kBlockM;
      run_item(a + r0 * lda, lda, std::min(kBlockM, m - r0), k, w + p * k * kPanel,
               bias ? bias + p * kPanel : nullptr, y + r0 * n, n, p * kPanel,
               std::min(kPanel, n - p * kPanel));
    }
  });
}

// Rows of x whose stride is a multiple of 1 KiB alias in L1 (12 rows 4 KiB apart map to
// one set, beside the panel's lines), so x's rows are copied, bf16 widened, into fp32
// rows kRowPad floats longer than K where that, or the conversion, is needed.
constexpr int64_t kRowPad = 16;

bool rows_alias(int64_t stride_floats) { return stride_floats % 256 == 0; }

// x [m, k] (fp32 or bf16, rows x.stride(0) apart) -> fp32 [m, k + kRowPad] (first k used).
template <typename T>
at::Tensor widen_rows(const at::Tensor& x) {
  const int64_t m = x.size(0), k = x.size(1), lds = x.stride(0), ld = k + kRowPad;
  at::Tensor out = at::empty({m, ld}, x.options().dtype(at::kFloat));
  const auto* src = reinterpret_cast<const typename Elem<T>::raw*>(x.const_data_ptr());
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, m, m * k >= (1 << 16) ? 16 : m, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      load_as_float<T>(reinterpret_cast<const T*>(src + r * lds), dst + r * ld, k);
  });
  return out;
}

}  // namespace

void accumulate_slice(const float* a, int64_t lda, int64_t m, const float* b, int64_t kc,
                      float* acc) {
  for (int64_t r0 = 0; r0 < m; r0 += kTileRows) {
    const float* tile_a = a + r0 * lda;
    float* tile_acc = acc + r0 * kPanel;
    if (r0 + kTileRows <= m)
      tile<kTileRows, float, float>(tile_a, lda, b, kc, false, false, false, tile_acc, nullptr,
                                    0, nullptr, 0);
    else
      tail<float, float>(int(m - r0), tile_a, lda, b, kc, false, false, false, tile_acc,
                         nullptr, 0, nullptr, 0);
  }
}

#endif

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed,
                  const std::optional<at::Tensor>& bias, int64_t out_features) {
#ifdef PDSERVE_GEMM_AVX512
  const auto dtype = packed.scalar_type();
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous() &&
                  is_supported(dtype),
              "linear_packed: packed must come from pack_linear_weight, got ", packed.sizes());
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == dtype && x.device().is_cpu(),
              "linear_packed: x must be a 2-D ", dtype_name(dtype), " CPU tensor [tokens, "
              "in_features] (the weight's dtype), got ", x.sizes(), " ", x.scalar_type());
  const int64_t m = x.size(0), k = x.size(1), n = out_features, panels = packed.size(0);
  TORCH_CHECK(packed.size(1) == k, "linear_packed: x has ", k, " in_features, the weight ",
              packed.size(1));
  TORCH_CHECK(n > (panels - 1) * kPanel && n <= panels * kPanel, "linear_packed: out_features ",
              n, " does not fit ", panels, " panels of ", kPanel);
  at::Tensor bias_f;  // fp32, zero past n; undefined without a bias
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == dtype,
                "linear_packed: bias must be ", dtype_name(dtype), " [", n, "], got ",
                bias->sizes(), " ", bias->scalar_type());
    bias_f = at::zeros({panels * kPanel}, x.options().dtype(at::kFloat));
    bias_f.narrow(0, 0, n).copy_(*bias);
  }
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  const float* b = bias_f.defined() ? bias_f.const_data_ptr<float>() : nullptr;
  if (dtype == at::kFloat) {
    const at::Tensor a = rows_alias(xc.stride(0)) ? widen_rows<float>(xc) : xc;
    run(a.const_data_ptr<float>(), a.stride(0), m, k, packed.const_data_ptr<float>(), panels, b,
        y.data_ptr<float>(), n);
  } else {
    const at::Tensor a = widen_rows<c10::BFloat16>(xc);
    run(a.const_data_ptr<float>(), a.stride(0), m, k,
        reinterpret_cast<const uint16_t*>(packed.const_data_ptr()), panels, b,
        reinterpret_cast<uint16_t*>(y.data_ptr()), n);
  }
  return y;
#else
  TORCH_CHECK(false, "linear_packed: built without AVX-512");
#endif
}

}  // namespace pdserve::gemm_avx512
