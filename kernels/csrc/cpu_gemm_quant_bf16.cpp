// Weight-only quantized linear layers for bf16 x of several rows (int4: of any) on
// AVX512-BF16 (AMD Zen 4 and later, Intel Cooper Lake and later): cpu_gemm_quant.cpp's
// weight, its raw integers widened to bf16 pairs once per slice of K (int4 at 1-4 rows: as
// they stream in) and multiplied by vdpbf16ps. Built on first use
// by pdserve/kernels/cpu_ext.py.
//
// Exact up to fp32 rounding, as the FMA tiles: an int8 or int4 value has at most 8
// significant bits, so it is a bf16 without rounding (the top half of its fp32), and the
// product of two bf16 is exact in fp32. Per group, each row's dot product with the raw
// values is summed in fp32 (vdpbf16ps: two products per lane and step), then multiplied by
// the group's scale once, and the min enters as min * sum(x over the group), as in the FMA
// tiles. vdpbf16ps takes inputs that are denormal as zero; activations are not that small.
//
// Why: from 5 rows on, the FMA tiles are bound by their fp32 multiply-adds, and vdpbf16ps
// does twice the multiply-adds per instruction. Where that also means twice per cycle (AMD:
// Zen 4 and Zen 5 run it at their fp32 FMA's rate), W1's step of 32 rows ran its quantized
// linears at 0.55-0.6x the speed of oneDNN's bf16 linear on the FMA tiles. On a 2-core Zen 5,
// W1's and Llama-3.2-1B's linears: 1.14-1.44x the FMA tiles at 5-7 rows, 1.4-2.5x at 8 to
// 1024 rows (1.0-2.3x oneDNN's bf16 linear at 8-64 rows, 0.72-0.96x at 256-1024). At 1-4
// rows the FMA tiles (tile_small) are as fast or faster for int8, and are kept; int4 there
// takes tile4_stream (below): one row of [1024, 1024] in L2 read 28.5-28.8 GB/s of int4 on
// one thread of a Zen 5 against the FMA tile's 21.5-21.7, 41.9-42.1 on two against 32.4-32.7.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include "cpu_common.h"
#include "cpu_gemm_quant.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

namespace pdserve::quant {

namespace {
std::atomic<int> g_mode{-1};  // -1: where the CPU is AMD's; 0: never; 1: always (tests)
}  // namespace

bool set_linear_quant_bf16_mode(int64_t mode) {
  TORCH_CHECK(mode >= -1 && mode <= 1, "set_linear_quant_bf16: mode must be -1, 0 or 1, got ",
              mode);
  g_mode.store(static_cast<int>(mode));
#if defined(PDSERVE_QUANT_AVX512) && defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

#if defined(PDSERVE_QUANT_AVX512) && defined(__AVX512BF16__)

namespace {

constexpr int64_t kMinRows = 5;     // fewer rows: int8 takes tile_small (cpu_gemm_quant.cpp)
constexpr int kTileRows = 8;        // rows per register tile: 16 zmm of sums
constexpr int64_t kBlockRows = 64;  // rows per work item
constexpr int64_t kSliceK = 256;    // K per widened slice: 256 x 32 bf16 = 16 KiB, in L1

bool enabled() {
  const int mode = g_mode.load(std::memory_order_relaxed);
  if (mode >= 0) return mode == 1;
  static const bool amd = __builtin_cpu_is("amd");
  return amd;
}

// Two fp32 vectors of integers (k even, k + 1) as one vector of bf16 pairs, k in the low half.
inline __m512i pair_bf16(__m512 even, __m512 odd) {
  const __m512i hi = _mm512_and_si512(_mm512_castps_si512(odd), _mm512_set1_epi32(0xFFFF0000));
  return _mm512_or_si512(hi, _mm512_srli_epi32(_mm512_castps_si512(even), 16));
}

// K [k0, k0 + kc) of panel p as bf16 pairs: out [kc / 2][32] uint32, pair kp of feature j
// = (q[k0 + 2kp][j], q[k0 + 2kp + 1][j]) unscaled. k0 and kc are even.
void widen_slice(const QuantPanels& w, int64_t p, int64_t k0, int64_t kc, uint32_t* out) {
  const uint8_t* panel = w.q + p * w.panel_bytes();
  for (int64_t kp = 0; kp < kc / 2; ++kp) {
    const int64_t k = k0 + 2 * kp;
    __m512 e0, e1, o0, o1;  // k and k + 1, features 0-15 and 16-31
    if (w.bits == 8) {
      raw8(panel + k * kPanel, e0, e1);
      raw8(panel + (k + 1) * kPanel, o0, o1);
    } else {  // a byte holds k (low nibble) and k + 1 (high) of one feature
      raw4(panel + k / 2 * kPanel, e0, e1, o0, o1);
    }
    _mm512_store_si512(out + kp * kPanel, pair_bf16(e0, o0));
    _mm512_store_si512(out + kp * kPanel + 16, pair_bf16(e1, o1));
  }
}

// Rows [0, kRows) of x (bf16, ldx apart) over the widened slice K [k0, k0 + kc): per
// segment of a group, the raw dot products are summed, then scaled into acc (rows x 32).
template <int kRows>
void tile(const QuantPanels& w, int64_t p, const uint16_t* x, int64_t ldx, const float* xsum,
          int64_t k0, int64_t kc, const uint32_t* slice, float* acc) {
  for (int64_t ks = k0; ks < k0 + kc;) {
    const int64_t g = ks / w.group, ke = std::min(k0 + kc, (g + 1) * w.group);
    __m512 part[kRows][2];
    for (int r = 0; r < kRows; ++r) part[r][0] = part[r][1] = _mm512_setzero_ps();
    for (int64_t k = ks; k < ke; k += 2) {
      const uint32_t* pair = slice + (k - k0) / 2 * kPanel;
      const __m512bh w0 = (__m512bh)_mm512_load_si512(pair);
      const __m512bh w1 = (__m512bh)_mm512_load_si512(pair + 16);
      for (int r = 0; r < kRows; ++r) {
        uint32_t xp;
        std::memcpy(&xp, x + r * ldx + k, sizeof(xp));
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(xp));
        part[r][0] = _mm512_dpbf16_ps(part[r][0], xb, w0);
        part[r][1] = _mm512_dpbf16_ps(part[r][1], xb, w1);
      }
    }
    __m512 s0, s1;
    load_scales(w, p, g, s0, s1);
    for (int r = 0; r < kRows; ++r) {
      float* a = acc + r * kPanel;
      _mm512_storeu_ps(a, _mm512_fmadd_ps(part[r][0], s0, _mm512_loadu_ps(a)));
      _mm512_storeu_ps(a + 16, _mm512_fmadd_ps(part[r][1], s1, _mm512_loadu_ps(a + 16)));
    }
    if (w.has_min() && ke == (g + 1) * w.group) {  // NOTE: once, where the group ends
      __m512 m0, m1;
      load_mins(w, p, g, m0, m1);
      for (int r = 0; r < kRows; ++r) {
        const __m512 xs = _mm512_set1_ps(xsum[r * w.groups + g]);
        float* a = acc + r * kPanel;
        _mm512_storeu_ps(a, _mm512_fmadd_ps(xs, m0, _mm512_loadu_ps(a)));
        _mm512_storeu_ps(a + 16, _mm512_fmadd_ps(xs, m1, _mm512_loadu_ps(a + 16)));
      }
    }
    ks = ke;
  }
}

template <int kRows = kTileRows>
void tile_rows(int64_t rows, const QuantPanels& w, int64_t p, const uint16_t* x, int64_t ldx,
               const float* xsum, int64_t k0, int64_t kc, const uint32_t* slice, float* acc) {
  if constexpr (kRows > 0) {
    if (rows == kRows) return tile<kRows>(w, p, x, ldx, xsum, k0, kc, slice, acc);
    tile_rows<kRows - 1>(rows, w, p, x, ldx, xsum, k0, kc, slice, acc);
  }
}

// The sum of n bf16 values, in fp32.
float group_sum(const uint16_t* x, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i));
    acc = _mm512_add_ps(acc, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16)));
  }
  float s = _mm512_reduce_add_ps(acc);
  for (; i < n; ++i) s += pdserve::Elem<c10::BFloat16>::widen(x[i]);
  return s;
}

// int4 at 1-4 rows, where the call streams its weight and the FMA tiles are bound by their
// instruction count (tile_small: ~16 per 64 values): a byte holds one feature's k (low
// nibble) and k + 1 (high), so 16 bytes widened to 32-bit lanes, the high nibble shifted
// into the upper half, give 16 features' pairs of indices, and one vpermw on a table of
// the 16 values as bf16 turns them into vdpbf16ps's pairs: 4 instructions per 32 values
// (5 without VBMI), the multiply-add included.
inline __m512i nibble_table() {
  alignas(64) uint16_t t[32];
  for (int i = 0; i < 32; ++i) {
    const float v = static_cast<float>(i & 15);  // NOTE: vpermw reads 5 bits; bit 4 is noise
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof(bits));
    t[i] = static_cast<uint16_t>(bits >> 16);  // exact: at most 4 significant bits
  }
  return _mm512_load_si512(t);
}

// 16 features' (k, k + 1) values of one row of a panel's pairs (16 bytes) as bf16 pairs.
inline __m512bh nibble_pairs(const uint8_t* bytes, __m512i table) {
  const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
#ifdef __AVX512VBMI__
  // each lane's byte 0 from bit 0 of the byte (the low nibble), byte 2 from bit 4 (the high)
  const __m512i at = _mm512_set1_epi64(0x2424202004040000);
  return (__m512bh)_mm512_permutexvar_epi16(_mm512_multishift_epi64_epi8(at, d), table);
#else
  return (__m512bh)_mm512_permutexvar_epi16(_mm512_or_si512(d, _mm512_slli_epi32(d, 12)), table);
#endif
}

// Rows [0, kRows) of x (bf16, ldx apart) times int4 panel p, all of K, into acc (rows x
// 32): per group, the raw products summed in two sets of sums (alternate pairs of k, two
// dependency chains per feature vector), then scaled; the min as in tile.
template <int kRows>
void tile4_stream(const QuantPanels& w, int64_t p, const uint16_t* x, int64_t ldx,
                  const float* xsum, float* acc) {
  const __m512i table = nibble_table();
  const uint8_t* panel = w.q + p * w.panel_bytes();
  __m512 sum[kRows][2];
  for (int r = 0; r < kRows; ++r) sum[r][0] = sum[r][1] = _mm512_setzero_ps();
  // one pair of k's: its 32 bytes (16 features each half), x's pair at k of each row
  auto pair = [&](const uint8_t* row, const uint16_t* xk, __m512 (&part)[kRows][2]) {
    const __m512bh w0 = nibble_pairs(row, table), w1 = nibble_pairs(row + 16, table);
    for (int r = 0; r < kRows; ++r) {
      uint32_t xp;
      std::memcpy(&xp, xk + r * ldx, sizeof(xp));
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(xp));
      part[r][0] = _mm512_dpbf16_ps(part[r][0], xb, w0);
      part[r][1] = _mm512_dpbf16_ps(part[r][1], xb, w1);
    }
  };
  const uint8_t* row = panel;  // the pair of k's at k, 32 bytes a pair
  const uint16_t* xk = x;
  for (int64_t g = 0; g < w.groups; ++g) {
    __m512 ev[kRows][2], od[kRows][2];
    for (int r = 0; r < kRows; ++r) ev[r][0] = ev[r][1] = od[r][0] = od[r][1] = _mm512_setzero_ps();
    int64_t pairs = w.group / 2;
    for (; pairs >= 2; pairs -= 2, row += 2 * kPanel, xk += 4) {  // a cache line
      _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetch), _MM_HINT_T1);
      pair(row, xk, ev);
      pair(row + kPanel, xk + 2, od);
    }
    if (pairs) {  // a group of an odd number of pairs
      pair(row, xk, ev);
      row += kPanel;
      xk += 2;
    }
    __m512 s0, s1;
    load_scales(w, p, g, s0, s1);
    for (int r = 0; r < kRows; ++r) {
      sum[r][0] = _mm512_fmadd_ps(_mm512_add_ps(ev[r][0], od[r][0]), s0, sum[r][0]);
      sum[r][1] = _mm512_fmadd_ps(_mm512_add_ps(ev[r][1], od[r][1]), s1, sum[r][1]);
    }
    if (w.has_min()) {
      __m512 m0, m1;
      load_mins(w, p, g, m0, m1);
      for (int r = 0; r < kRows; ++r) {
        const __m512 xs = _mm512_set1_ps(xsum[r * w.groups + g]);
        sum[r][0] = _mm512_fmadd_ps(xs, m0, sum[r][0]);
        sum[r][1] = _mm512_fmadd_ps(xs, m1, sum[r][1]);
      }
    }
  }
  for (int r = 0; r < kRows; ++r) {
    _mm512_storeu_ps(acc + r * kPanel, sum[r][0]);
    _mm512_storeu_ps(acc + r * kPanel + 16, sum[r][1]);
  }
}

// acc (m x 32 fp32, this panel's) plus the bias into y's columns [32p, 32p + cols), as bf16.
void store_panel(const float* acc, int64_t m, int64_t p, const float* bias, uint16_t* y,
                 int64_t n) {
  const int64_t n0 = p * kPanel, cols = std::min(kPanel, n - n0);
  using E = pdserve::Elem<c10::BFloat16>;
  for (int64_t r = 0; r < m; ++r)
    for (int64_t j = 0; j < cols; ++j)
      y[r * n + n0 + j] = E::narrow(acc[r * kPanel + j] + (bias ? bias[n0 + j] : 0.0f));
}

// Rows [0, m < kMinRows) of x times int4 panel p into y's columns [32p, 32p + cols).
void run_item4_stream(const QuantPanels& w, const uint16_t* x, int64_t ldx, const float* xsum,
                      int64_t m, int64_t p, const float* bias, uint16_t* y, int64_t n) {
  alignas(64) float acc[(kMinRows - 1) * kPanel];
  switch (m) {
    case 1: tile4_stream<1>(w, p, x, ldx, xsum, acc); break;
    case 2: tile4_stream<2>(w, p, x, ldx, xsum, acc); break;
    case 3: tile4_stream<3>(w, p, x, ldx, xsum, acc); break;
    default: tile4_stream<4>(w, p, x, ldx, xsum, acc); break;
  }
  store_panel(acc, m, p, bias, y, n);
}

// Rows [0, m) of x times panel p into y's columns [32p, 32p + cols).
void run_item(const QuantPanels& w, const uint16_t* x, int64_t ldx, const float* xsum,
              int64_t m, int64_t p, const float* bias, uint16_t* y, int64_t n) {
  alignas(64) float acc[kBlockRows * kPanel];
  alignas(64) uint32_t slice[kSliceK / 2 * kPanel];
  std::fill(acc, acc + m * kPanel, 0.0f);
  for (int64_t k0 = 0; k0 < w.k; k0 += kSliceK) {
    const int64_t kc = std::min(kSliceK, w.k - k0);
    widen_slice(w, p, k0, kc, slice);
    for (int64_t r0 = 0; r0 < m; r0 += kTileRows)
      tile_rows(std::min<int64_t>(kTileRows, m - r0), w, p, x + r0 * ldx, ldx,
                xsum ? xsum + r0 * w.groups : nullptr, k0, kc, slice, acc + r0 * kPanel);
  }
  store_panel(acc, m, p, bias, y, n);
}

}  // namespace

bool linear_quant_bf16(const QuantPanels& w, const at::Tensor& x,
                       const std::optional<at::Tensor>& bias, at::Tensor& y) {
  const int64_t m = x.size(0), n = y.size(1);
  const bool stream4 = m < kMinRows && w.bits == 4;  // int4 at 1-4 rows: tile4_stream
  if (x.scalar_type() != at::kBFloat16 || (m < kMinRows && !stream4) || !enabled()) return false;
  at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  const auto* xb = reinterpret_cast<const uint16_t*>(xc.const_data_ptr());
  const int64_t ldx = xc.stride(0);
  std::vector<float> xsum;
  if (w.has_min()) {  // each row's sum over each group, for the mins
    xsum.resize(m * w.groups);
    for (int64_t r = 0; r < m; ++r)
      for (int64_t g = 0; g < w.groups; ++g)
        xsum[r * w.groups + g] = group_sum(xb + r * ldx + g * w.group, w.group);
  }
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) bias_f = bias->to(at::kFloat).contiguous();
  const float* b = bias_f.defined() ? bias_f.const_data_ptr<float>() : nullptr;
  auto* out = reinterpret_cast<uint16_t*>(y.data_ptr());
  if (stream4) {
    for_each_item(w.panels, stream_run_len(w.panels), [&](int64_t p) {
      run_item4_stream(w, xb, ldx, xsum.empty() ? nullptr : xsum.data(), m, p, b, out, n);
    });
    return true;
  }
  for_each_item((m + kBlockRows - 1) / kBlockRows * w.panels, 1, [&](int64_t i) {
    const int64_t block = i / w.panels, p = i % w.panels, r0 = block * kBlockRows;
    run_item(w, xb + r0 * ldx, ldx, xsum.empty() ? nullptr : xsum.data() + r0 * w.groups,
             std::min(kBlockRows, m - r0), p, b, out + r0 * n, n);
  });
  return true;
}

#else

bool linear_quant_bf16(const QuantPanels&, const at::Tensor&, const std::optional<at::Tensor>&,
                       at::Tensor&) {
  return false;
}

#endif

}  // namespace pdserve::quant
