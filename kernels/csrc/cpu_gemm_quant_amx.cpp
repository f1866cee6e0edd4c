// Weight-only quantized linear layers on AMX (Intel's tile matrix unit), for bf16 x of
// many rows: cpu_gemm_quant.cpp's weight, dequantized to bf16 tiles. Built on first use by
// pdserve/kernels/cpu_ext.py.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include "cpu_gemm_quant.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace pdserve::quant {

#ifdef PDSERVE_QUANT_AMX

namespace {


// bf16 x with many rows on AMX (Intel's tile matrix unit): each panel's weight is
// dequantized once per call into bf16 tiles (16 pairs of k x 16 features, VNNI order:
// row kp holds (W[n][2kp], W[n][2kp + 1]) for n in 0..15), then every 16 rows of x take
// one tile multiply (tdpbf16ps, fp32 sums) per 32 of K. The weights are rounded to bf16
// on the way (as a bf16 checkpoint's are); products and sums stay fp32.
constexpr int64_t kAmxRows = 16;
constexpr int64_t kAmxK = 32;
constexpr int64_t kAmxMinRows = 16;  // fewer rows take the FMA tiles

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Linux hands a process AMX's tile state only once it asks (ARCH_REQ_XCOMP_PERM).
bool amx_usable() {
  static const bool usable = [] {
    constexpr long kReqPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqPerm, kXtileData) == 0;
  }();
  return usable;
}

// Panel p's K values dequantized to bf16 tiles: buf [K / 32][2 halves][16 pairs][32 bf16].
void dequant_panel_bf16(const QuantPanels& w, int64_t p, uint16_t* buf) {
  const uint8_t* panel = w.q + p * w.panel_bytes();
  for (int64_t k0 = 0; k0 < w.k; k0 += std::min(w.group, w.k)) {
    const int64_t g = k0 / w.group;
    __m512 s0, s1, m0 = _mm512_setzero_ps(), m1 = _mm512_setzero_ps();
    load_scales(w, p, g, s0, s1);
    if (w.has_min()) load_mins(w, p, g, m0, m1);
    for (int64_t k = k0; k < k0 + std::min(w.group, w.k); k += 2) {
      __m512 e0, e1, o0, o1;  // k (even) and k + 1 (odd), features 0-15 and 16-31
      if (w.bits == 8) {
        dequant8(panel + k * kPanel, s0, s1, e0, e1);
        dequant8(panel + (k + 1) * kPanel, s0, s1, o0, o1);
      } else {
        dequant4(panel + k / 2 * kPanel, s0, s1, e0, e1, o0, o1);
      }
      e0 = _mm512_add_ps(e0, m0), e1 = _mm512_add_ps(e1, m1);
      o0 = _mm512_add_ps(o0, m0), o1 = _mm512_add_ps(o1, m1);
      // one 64-byte tile row per half: the features' (even, odd) bf16 pairs in order
      const int64_t chunk = k / kAmxK, pair = (k % kAmxK) / 2;
      const __m512 evens[2] = {e0, e1}, odds[2] = {o0, o1};
      for (int h = 0; h < 2; ++h) {
        const __m256i e = (__m256i)_mm512_cvtneps_pbh(evens[h]);
        const __m256i o = (__m256i)_mm512_cvtneps_pbh(odds[h]);
        const __m256i lo = _mm256_unpacklo_epi16(e, o), hi = _mm256_unpackhi_epi16(e, o);
        uint16_t* row = buf + ((chunk * 2 + h) * 16 + pair) * 32;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(row),
                            _mm256_permute2x128_si256(lo, hi, 0x20));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + 16),
                            _mm256_permute2x128_si256(lo, hi, 0x31));
      }
    }
  }
}

// 16 rows (rows <= 16 used) of x's bf16 chunk at `a` (lda bytes apart) into tile t,
// through `pad` when fewer than 16 rows are there.
inline void load_x_tile(int t, const uint16_t* a, int64_t lda, int64_t rows, uint16_t* pad) {
  if (rows == kAmxRows) {
    if (t == 4) _tile_loadd(4, a, lda); else _tile_loadd(5, a, lda);
    return;
  }
  std::memset(pad, 0, kAmxRows * kAmxK * 2);
  for (int64_t r = 0; r < rows; ++r) std::memcpy(pad + r * kAmxK, a + r * lda / 2, kAmxK * 2);
  if (t == 4) _tile_loadd(4, pad, kAmxK * 2); else _tile_loadd(5, pad, kAmxK * 2);
}

// One C tile (16 rows x 16 fp32, the first `rows` used) plus `bias` (its 16 values, or
// null) into `dst` (rows ldy apart, its first `cols` columns), in y's dtype.
template <typename Out>
inline void store_c(const float* c, int64_t rows, const float* bias, int64_t cols, Out* dst,
                    int64_t ldy) {
  const __mmask16 mask = cols >= 16 ? 0xFFFF : __mmask16((1u << cols) - 1);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 v = _mm512_add_ps(_mm512_loadu_ps(c + r * 16), b);
    if constexpr (std::is_same_v<Out, c10::BFloat16>) {
      _mm256_mask_storeu_epi16(dst + r * ldy, mask, (__m256i)_mm512_cvtneps_pbh(v));
    } else {
      alignas(64) float tmp[16];
      _mm512_store_ps(tmp, v);
      for (int64_t j = 0; j < cols; ++j) dst[r * ldy + j] = static_cast<Out>(tmp[j]);
    }
  }
}

// y rows [0, m) of panel p from bf16 x rows (ldx apart) and the panel's tiles: 32 rows at
// a time, tiles C 0-3 = (rows 0-15, 16-31) x (features 0-15, 16-31), x in tiles 4 and 5,
// the weight in 6 and 7, so each tile load serves two multiplies.
template <typename Out>
void amx_panel(const QuantPanels& w, const uint16_t* tiles, const uint16_t* x, int64_t ldx,
               int64_t m, int64_t p, const float* bias, Out* y, int64_t n) {
  alignas(64) uint16_t pad[kAmxRows * kAmxK];
  alignas(64) float c[4][kAmxRows * 16];
  const int64_t n0 = p * kPanel, cols = std::min(kPanel, n - n0), lda = ldx * 2;
  for (int64_t r0 = 0; r0 < m; r0 += 2 * kAmxRows) {
    const int64_t rows0 = std::min(kAmxRows, m - r0);
    const int64_t rows1 = std::max<int64_t>(0, std::min(kAmxRows, m - r0 - kAmxRows));
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t chunk = 0; chunk < w.k / kAmxK; ++chunk) {
      const uint16_t* a = x + r0 * ldx + chunk * kAmxK;
      _tile_loadd(6, tiles + (chunk * 2) * 16 * 32, 64);
      _tile_loadd(7, tiles + (chunk * 2 + 1) * 16 * 32, 64);
      load_x_tile(4, a, lda, rows0, pad);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      if (rows1 > 0) {
        load_x_tile(5, a + kAmxRows * ldx, lda, rows1, pad);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
    Out* dst = y + r0 * n + n0;
    const float* b0 = bias ? bias + n0 : nullptr;
    const float* b1 = bias ? bias + n0 + 16 : nullptr;
    const int64_t cols0 = std::min<int64_t>(16, cols), cols1 = cols - cols0;
    store_c(c[0], rows0, b0, cols0, dst, n);
    if (cols1 > 0) store_c(c[1], rows0, b1, cols1, dst + 16, n);
    if (rows1 > 0) {
      _tile_stored(2, c[2], 64);
      _tile_stored(3, c[3], 64);
      store_c(c[2], rows1, b0, cols0, dst + kAmxRows * n, n);
      if (cols1 > 0) store_c(c[3], rows1, b1, cols1, dst + kAmxRows * n + 16, n);
    }
  }
}

// Panels over torch's intra-op threads, each dequantized once and run over all rows.
template <typename Out>
void run_amx(const QuantPanels& w, const uint16_t* x, int64_t ldx, int64_t m, const float* bias,
             Out* y, int64_t n) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), w.panels), 1,
                   [&](int64_t, int64_t) {
    TileConfig cfg;  // C tiles 0-3 and x tiles 4-5: 16 rows; weight tiles 6-7: 16 k pairs
    for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
    std::vector<uint16_t> tiles(w.k * kPanel);
    for (int64_t p; (p = next.fetch_add(1, std::memory_order_relaxed)) < w.panels;) {
      dequant_panel_bf16(w, p, tiles.data());
      amx_panel(w, tiles.data(), x, ldx, m, p, bias, y, n);
    }
    _tile_release();
  });
}


}  // namespace

bool linear_quant_amx(const QuantPanels& w, const at::Tensor& x,
                      const std::optional<at::Tensor>& bias, at::Tensor& y) {
  const int64_t m = x.size(0), n = y.size(1);
  if (x.scalar_type() != at::kBFloat16 || m < kAmxMinRows || w.k % kAmxK != 0 ||
      !amx_usable())
    return false;
  at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) bias_f = bias->to(at::kFloat).contiguous();
  run_amx(w, reinterpret_cast<const uint16_t*>(xc.const_data_ptr()), xc.stride(0), m,
          bias_f.defined() ? bias_f.const_data_ptr<float>() : nullptr,
          y.data_ptr<c10::BFloat16>(), n);
  return true;
}

#else

bool linear_quant_amx(const QuantPanels&, const at::Tensor&, const std::optional<at::Tensor>&,
                      at::Tensor&) {
  return false;
}

#endif

}  // namespace pdserve::quant
