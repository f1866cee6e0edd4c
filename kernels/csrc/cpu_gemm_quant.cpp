// Weight-only quantized linear layers on the CPU (W8A16, W4A16): y = x W^T (+ b) with W
// stored as int8 or unsigned int4 values in groups along K, each group with a scale and
// (int4, or int8 with a min) a min: W[n][k] = q[n][k] * scale[n][g] + min[n][g]
// (pdserve/kernels/quant_linear.py). Built on first use by pdserve/kernels/cpu_ext.py.
//
// The weight is packed once, at load, into panels of 32 output features, as the bf16/fp32
// packed linear's (cpu_gemm_avx512.cpp, after GotoBLAS: Goto and van de Geijn, ACM TOMS
// 34(3), 2008): panel p holds, for each k (int8) or pair of k's (int4: the even k in each
// byte's low nibble), the 32 features' values in order, and its groups' scales and mins as
// [groups][32]. A work item is (a block of rows of x, one panel); its K runs in slices of
// whole groups that fit 16 KiB, so the slice stays in L1 while the row tiles pass over it.
// Inside a tile each k's 32 values are widened to fp32 and multiplied by their group's
// scale once (two zmm), then every row of the tile takes one FMA per zmm: the dequantizing
// is paid once per k and panel, not per row. The min enters once per group and row, as
// min[n][g] * sum(x[r][k], k in g), from the rows' group sums computed once per call.
// Calls of 9 rows or more dequantize each 128-k slice of the panel once instead, into
// fp32 (min included), and run the bf16 packed linear's 12 x 32 tiles over it.
//
// On AVX-512 the tile is intrinsics; elsewhere (AVX2 and others) a portable loop over the
// panel's 32 features, written for the compiler's vectorizer (`omp simd`). On CPUs with
// AMX, bf16 x of 16 rows or more takes AMX's tile multiplies instead (cpu_gemm_quant_amx.cpp):
// at 1024 rows the FMA tiles ran at ~150 GFLOP/s on a 2-core Xeon, oneDNN's bf16 linear on
// AMX at ~800.
// Elsewhere, bf16 x of 5 rows or more on an AMD CPU with AVX512-BF16 takes vdpbf16ps on the
// raw integers (cpu_gemm_quant_bf16.cpp), twice the multiply-adds of an FMA per instruction,
// and so does bf16 x of 1-4 rows times an int4 weight (fewer instructions per value).

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "cpu_common.h"
#include "cpu_gemm.h"
#include "cpu_gemm_quant.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

using pdserve::Elem;
using pdserve::load_as_float;
using namespace pdserve::quant;  // the packed weight: cpu_gemm_quant.h

constexpr int kTileRows = 8;         // rows of x per register tile
constexpr int64_t kBlockM = 64;      // rows of x per work item
constexpr int kSmallRows = 4;        // tiles of at most this many rows take tile_small
// The least row count of x whose calls dequantize each slice once (below); tests and
// benchmarks/cpu_quant_linear.py move it to compare that path with the tiles on one CPU.
constexpr int64_t kSliceRows = kTileRows + 1;
std::atomic<int64_t> g_slice_rows{kSliceRows};

// Sets the least row count that dequantizes slices (< 1: the default) and returns the one
// it replaces.
int64_t set_linear_quant_slice_rows(int64_t rows) {
  return g_slice_rows.exchange(rows < 1 ? kSliceRows : rows);
}

// Per row of x and group: the sum of the row's values in the group (for the mins).
void group_sums(const float* a, int64_t lda, int64_t m, const QuantPanels& w, float* out) {
  for (int64_t r = 0; r < m; ++r)
    for (int64_t g = 0; g < w.groups; ++g) {
      float s = 0.0f;
      const float* x = a + r * lda + g * w.group;
#pragma omp simd reduction(+ : s)
      for (int64_t i = 0; i < w.group; ++i) s += x[i];
      out[r * w.groups + g] = s;
    }
}

// Tile arguments: rows [r0, r0 + rows) of x (fp32, lda apart), K [k0, k0 + kc) of panel p,
// accumulating into acc (rows x 32 fp32, the item's partial sums).
struct TileArgs {
  const float* a;
  int64_t lda;
  const float* xsum;  // [m, groups] of the item's rows, or null
  int64_t rows, p, k0, kc;
  float* acc;
};

#ifdef PDSERVE_QUANT_AVX512

template <int kRows>
void tile(const QuantPanels& w, const TileArgs& t) {
  __m512 acc[kRows][2];
  for (int r = 0; r < kRows; ++r) {
    acc[r][0] = _mm512_loadu_ps(t.acc + r * kPanel);
    acc[r][1] = _mm512_loadu_ps(t.acc + r * kPanel + 16);
  }
  const uint8_t* panel = w.q + t.p * w.panel_bytes();
  for (int64_t k = t.k0; k < t.k0 + t.kc;) {
    const int64_t g = k / w.group, end = std::min(t.k0 + t.kc, (g + 1) * w.group);
    __m512 s0, s1;
    load_scales(w, t.p, g, s0, s1);
    if (w.bits == 8) {
      for (; k < end; ++k) {
        __m512 w0, w1;
        dequant8(panel + k * kPanel, s0, s1, w0, w1);
        for (int r = 0; r < kRows; ++r) {
          const __m512 x = _mm512_set1_ps(t.a[r * t.lda + k]);
          acc[r][0] = _mm512_fmadd_ps(x, w0, acc[r][0]);
          acc[r][1] = _mm512_fmadd_ps(x, w1, acc[r][1]);
        }
      }
    } else {
      for (; k < end; k += 2) {
        __m512 e0, e1, o0, o1;
        dequant4(panel + k / 2 * kPanel, s0, s1, e0, e1, o0, o1);
        for (int r = 0; r < kRows; ++r) {
          const __m512 x0 = _mm512_set1_ps(t.a[r * t.lda + k]);
          const __m512 x1 = _mm512_set1_ps(t.a[r * t.lda + k + 1]);
          acc[r][0] = _mm512_fmadd_ps(x1, o0, _mm512_fmadd_ps(x0, e0, acc[r][0]));
          acc[r][1] = _mm512_fmadd_ps(x1, o1, _mm512_fmadd_ps(x0, e1, acc[r][1]));
        }
      }
    }
    if (w.has_min() && end == (g + 1) * w.group) {  // NOTE: once, where the group ends
      __m512 m0, m1;
      load_mins(w, t.p, g, m0, m1);
      for (int r = 0; r < kRows; ++r) {
        const __m512 xs = _mm512_set1_ps(t.xsum[r * w.groups + g]);
        acc[r][0] = _mm512_fmadd_ps(xs, m0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(xs, m1, acc[r][1]);
      }
    }
  }
  for (int r = 0; r < kRows; ++r) {
    _mm512_storeu_ps(t.acc + r * kPanel, acc[r][0]);
    _mm512_storeu_ps(t.acc + r * kPanel + 16, acc[r][1]);
  }
}

// Few rows (decode's m = 1 to 4): the products of the raw values (not yet scaled) are summed
// per group, in separate sums for even and odd k, and scaled once where the segment of the
// group ends. That takes the two multiplies per k off the dequantizing and splits the one
// FMA dependency chain per row into two, which at m = 1 bound the loop (a chain of 4-cycle
// FMAs); the panel is prefetched into L2 kPrefetch bytes ahead (cpu_gemm_quant.h).

template <int kRows>
void tile_small(const QuantPanels& w, const TileArgs& t) {
  __m512 acc[kRows][2];
  for (int r = 0; r < kRows; ++r) {
    acc[r][0] = _mm512_loadu_ps(t.acc + r * kPanel);
    acc[r][1] = _mm512_loadu_ps(t.acc + r * kPanel + 16);
  }
  const uint8_t* panel = w.q + t.p * w.panel_bytes();
  for (int64_t k = t.k0; k < t.k0 + t.kc;) {
    const int64_t g = k / w.group, end = std::min(t.k0 + t.kc, (g + 1) * w.group);
    __m512 ev[kRows][2], od[kRows][2];
    for (int r = 0; r < kRows; ++r)
      ev[r][0] = ev[r][1] = od[r][0] = od[r][1] = _mm512_setzero_ps();
    if (w.bits == 8) {
      for (; k + 1 < end; k += 2) {
        const uint8_t* row = panel + k * kPanel;
        _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetch), _MM_HINT_T1);
        __m512 e0, e1, o0, o1;
        raw8(row, e0, e1);
        raw8(row + kPanel, o0, o1);
        for (int r = 0; r < kRows; ++r) {
          const __m512 x0 = _mm512_set1_ps(t.a[r * t.lda + k]);
          const __m512 x1 = _mm512_set1_ps(t.a[r * t.lda + k + 1]);
          ev[r][0] = _mm512_fmadd_ps(x0, e0, ev[r][0]);
          ev[r][1] = _mm512_fmadd_ps(x0, e1, ev[r][1]);
          od[r][0] = _mm512_fmadd_ps(x1, o0, od[r][0]);
          od[r][1] = _mm512_fmadd_ps(x1, o1, od[r][1]);
        }
      }
      for (; k < end; ++k) {  // an odd segment's last k
        __m512 e0, e1;
        raw8(panel + k * kPanel, e0, e1);
        for (int r = 0; r < kRows; ++r) {
          const __m512 x0 = _mm512_set1_ps(t.a[r * t.lda + k]);
          ev[r][0] = _mm512_fmadd_ps(x0, e0, ev[r][0]);
          ev[r][1] = _mm512_fmadd_ps(x0, e1, ev[r][1]);
        }
      }
    } else {
      for (; k < end; k += 2) {
        const uint8_t* row = panel + k / 2 * kPanel;
        _mm_prefetch(reinterpret_cast<const char*>(row + kPrefetch), _MM_HINT_T1);
        __m512 e0, e1, o0, o1;
        raw4(row, e0, e1, o0, o1);
        for (int r = 0; r < kRows; ++r) {
          const __m512 x0 = _mm512_set1_ps(t.a[r * t.lda + k]);
          const __m512 x1 = _mm512_set1_ps(t.a[r * t.lda + k + 1]);
          ev[r][0] = _mm512_fmadd_ps(x0, e0, ev[r][0]);
          ev[r][1] = _mm512_fmadd_ps(x0, e1, ev[r][1]);
          od[r][0] = _mm512_fmadd_ps(x1, o0, od[r][0]);
          od[r][1] = _mm512_fmadd_ps(x1, o1, od[r][1]);
        }
      }
    }
    __m512 s0, s1;
    load_scales(w, t.p, g, s0, s1);
    for (int r = 0; r < kRows; ++r) {
      acc[r][0] = _mm512_fmadd_ps(_mm512_add_ps(ev[r][0], od[r][0]), s0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(_mm512_add_ps(ev[r][1], od[r][1]), s1, acc[r][1]);
    }
    if (w.has_min() && end == (g + 1) * w.group) {  // NOTE: once, where the group ends
      __m512 m0, m1;
      load_mins(w, t.p, g, m0, m1);
      for (int r = 0; r < kRows; ++r) {
        const __m512 xs = _mm512_set1_ps(t.xsum[r * w.groups + g]);
        acc[r][0] = _mm512_fmadd_ps(xs, m0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(xs, m1, acc[r][1]);
      }
    }
  }
  for (int r = 0; r < kRows; ++r) {
    _mm512_storeu_ps(t.acc + r * kPanel, acc[r][0]);
    _mm512_storeu_ps(t.acc + r * kPanel + 16, acc[r][1]);
  }
}

// More rows than one tile (prefill, decode batches of 9 or more): each slice of the panel
// is dequantized once, to fp32 in L1 (W = q * scale + min, as the reference computes it),
// and the bf16 packed linear's 12 x 32 register tiles (gemm_avx512::accumulate_slice) pass
// over it, two loads and 24 FMAs a k with no widening in the loop. The tiles above
// dequantize each k again for each 8 rows; on a 2-core Xeon without AMX they ran 1.15-1.45x
// slower than that GEMM on bf16 weights from 16 to 256 rows (benchmarks/cpu_quant_linear.py).
constexpr int64_t kDequantK = 128;  // K per dequantized slice: 16 KiB of fp32

void dequant_slice(const QuantPanels& w, int64_t p, int64_t k0, int64_t kc, float* out) {
  const uint8_t* panel = w.q + p * w.panel_bytes();
  __m512 s0, s1, m0 = _mm512_setzero_ps(), m1 = _mm512_setzero_ps();
  for (int64_t k = k0; k < k0 + kc;) {
    const int64_t g = k / w.group, end = std::min(k0 + kc, (g + 1) * w.group);
    load_scales(w, p, g, s0, s1);
    if (w.has_min()) load_mins(w, p, g, m0, m1);
    float* row = out + (k - k0) * kPanel;
    if (w.bits == 8) {
      for (; k < end; ++k, row += kPanel) {
        __m512 v0, v1;
        raw8(panel + k * kPanel, v0, v1);
        _mm512_storeu_ps(row, _mm512_fmadd_ps(v0, s0, m0));
        _mm512_storeu_ps(row + 16, _mm512_fmadd_ps(v1, s1, m1));
      }
    } else {  // NOTE: groups and slices start at even k's: a pair is in one group
      for (; k < end; k += 2, row += 2 * kPanel) {
        __m512 e0, e1, o0, o1;
        raw4(panel + k / 2 * kPanel, e0, e1, o0, o1);
        _mm512_storeu_ps(row, _mm512_fmadd_ps(e0, s0, m0));
        _mm512_storeu_ps(row + 16, _mm512_fmadd_ps(e1, s1, m1));
        _mm512_storeu_ps(row + kPanel, _mm512_fmadd_ps(o0, s0, m0));
        _mm512_storeu_ps(row + kPanel + 16, _mm512_fmadd_ps(o1, s1, m1));
      }
    }
  }
}

void accumulate_dequantized(const QuantPanels& w, const float* a, int64_t lda, int64_t m,
                            int64_t p, float* acc) {
  alignas(64) float slice[kDequantK * kPanel];
  for (int64_t k0 = 0; k0 < w.k; k0 += kDequantK) {
    const int64_t kc = std::min(kDequantK, w.k - k0);
    dequant_slice(w, p, k0, kc, slice);
    pdserve::gemm_avx512::accumulate_slice(a + k0, lda, m, slice, kc, acc);
  }
}

bool dequantizes_slices(int64_t m) { return m >= g_slice_rows.load(std::memory_order_relaxed); }

template <int kRows = kTileRows>
void tile_rows(const QuantPanels& w, const TileArgs& t) {
  if constexpr (kRows > 0) {
    if (t.rows == kRows) {
      if constexpr (kRows <= kSmallRows) return tile_small<kRows>(w, t);
      else return tile<kRows>(w, t);
    }
    tile_rows<kRows - 1>(w, t);
  }
}

#else

bool dequantizes_slices(int64_t) { return false; }

// Portable: the 32 features of a panel in the inner loop, for the vectorizer.
void tile_rows(const QuantPanels& w, const TileArgs& t) {
  const uint8_t* panel = w.q + t.p * w.panel_bytes();
  alignas(64) float s[kPanel], mn[kPanel], v[kPanel];
  for (int64_t k = t.k0; k < t.k0 + t.kc;) {
    const int64_t g = k / w.group, end = std::min(t.k0 + t.kc, (g + 1) * w.group);
    load_scales(w, t.p, g, s);
    for (; k < end; ++k) {
      if (w.bits == 8) {
        const auto* q = reinterpret_cast<const int8_t*>(panel + k * kPanel);
#pragma omp simd
        for (int j = 0; j < kPanel; ++j) v[j] = static_cast<float>(q[j]) * s[j];
      } else {
        const uint8_t* q = panel + k / 2 * kPanel;
        const int shift = (k % 2) * 4;
#pragma omp simd
        for (int j = 0; j < kPanel; ++j) v[j] = static_cast<float>((q[j] >> shift) & 0xF) * s[j];
      }
      for (int64_t r = 0; r < t.rows; ++r) {
        const float x = t.a[r * t.lda + k];
        float* acc = t.acc + r * kPanel;
#pragma omp simd
        for (int j = 0; j < kPanel; ++j) acc[j] += x * v[j];
      }
    }
    if (w.has_min() && end == (g + 1) * w.group) {
      load_mins(w, t.p, g, mn);
      for (int64_t r = 0; r < t.rows; ++r) {
        const float xs = t.xsum[r * w.groups + g];
        float* acc = t.acc + r * kPanel;
#pragma omp simd
        for (int j = 0; j < kPanel; ++j) acc[j] += xs * mn[j];
      }
    }
  }
}

#endif

// acc [m, 32] += rows [0, m) of x times panel p, on the register tiles above.
void accumulate_tiles(const QuantPanels& w, const float* a, int64_t lda, const float* xsum,
                      int64_t m, int64_t p, float* acc) {
  const int64_t kc = w.slice_k();
  for (int64_t k0 = 0; k0 < w.k; k0 += kc) {
    for (int64_t r0 = 0; r0 < m; r0 += kTileRows) {
      const TileArgs t{a + r0 * lda, lda, xsum ? xsum + r0 * w.groups : nullptr,
                       std::min<int64_t>(kTileRows, m - r0), p, k0, std::min(kc, w.k - k0),
                       acc + r0 * kPanel};
      tile_rows(w, t);
    }
  }
}

// Rows [0, m) of x times panel p into y's columns [32p, 32p + cols), in y's dtype; slices:
// the call dequantizes slices (dequantizes_slices of its row count, where xsum is null).
template <typename Out>
void run_item(const QuantPanels& w, const float* a, int64_t lda, const float* xsum, int64_t m,
              int64_t p, bool slices, const float* bias, Out* y, int64_t n) {
  alignas(64) float acc[kBlockM * kPanel];
  std::fill(acc, acc + m * kPanel, 0.0f);
#ifdef PDSERVE_QUANT_AVX512
  if (slices)
    accumulate_dequantized(w, a, lda, m, p, acc);
  else
#endif
    accumulate_tiles(w, a, lda, xsum, m, p, acc);
  const int64_t n0 = p * kPanel, cols = std::min(kPanel, n - n0);
  auto* out = reinterpret_cast<typename Elem<Out>::raw*>(y);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t j = 0; j < cols; ++j)
      out[r * n + n0 + j] = Elem<Out>::narrow(acc[r * kPanel + j] + (bias ? bias[n0 + j] : 0.0f));
}

// Work items (row block, panel) on torch's intra-op threads (for_each_item): in runs of
// neighbouring panels where tile_small streams the weight, one at a time otherwise.
template <typename Out>
void run(const QuantPanels& w, const float* a, int64_t lda, const float* xsum, int64_t m,
         const float* bias, Out* y, int64_t n) {
  const int64_t items = (m + kBlockM - 1) / kBlockM * w.panels;
  const bool slices = dequantizes_slices(m);
  for_each_item(items, m <= kSmallRows ? stream_run_len(items) : 1, [&](int64_t i) {
    const int64_t block = i / w.panels, p = i % w.panels, r0 = block * kBlockM;
    run_item(w, a + r0 * lda, lda, xsum ? xsum + r0 * w.groups : nullptr,
             std::min(kBlockM, m - r0), p, slices, bias, y + r0 * n, n);
  });
}

bool is_scale_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kChar;
}

// t [N, X] -> [P, X, 32], panel p's rows side by side, the rows past N zero.
at::Tensor pack_quant_groups(const at::Tensor& t) {
  TORCH_CHECK(t.dim() == 2 && t.device().is_cpu(),
              "pack_quant_groups: expected a 2-D CPU tensor, got ", t.sizes());
  const int64_t n = t.size(0), panels = (n + kPanel - 1) / kPanel;
  at::Tensor out = at::zeros({panels * kPanel, t.size(1)}, t.options());
  out.narrow(0, 0, n).copy_(t);
  return out.view({panels, kPanel, t.size(1)}).transpose(1, 2).contiguous();
}

// q [N, K] int8 or [N, K / 2] uint8 (int4, two per byte), scale and min [N, K / group]
// (fp32, fp16, or int8 codes of two-level scales) -> (panels [P, K * bits / 8, 32] uint8,
// scales [P, groups, 32], mins or an empty tensor), the features past N zero (scale 0). A
// 4-bit weight without mins is a symmetric one stored as q + 8 (min = -8 * scale).
std::tuple<at::Tensor, at::Tensor, at::Tensor> pack_quant_weight(
    const at::Tensor& q, const at::Tensor& scale, const std::optional<at::Tensor>& min,
    int64_t bits, int64_t group) {
  TORCH_CHECK(bits == 8 || bits == 4, "pack_quant_weight: bits must be 8 or 4, got ", bits);
  TORCH_CHECK(q.dim() == 2 && q.device().is_cpu() &&
                  q.scalar_type() == (bits == 8 ? at::kChar : at::kByte),
              "pack_quant_weight: q must be a 2-D CPU ", bits == 8 ? "int8" : "uint8",
              " tensor, got ", q.sizes(), " ", q.scalar_type());
  const int64_t n = q.size(0), k = q.size(1) * 8 / bits;
  TORCH_CHECK(group > 0 && group % 2 == 0 && k % group == 0,
              "pack_quant_weight: group_size ", group, " must be even and divide K = ", k);
  const int64_t groups = k / group, panels = (n + kPanel - 1) / kPanel, row = k * bits / 8;
  TORCH_CHECK(scale.dim() == 2 && scale.size(0) == n && scale.size(1) == groups &&
                  is_scale_dtype(scale.scalar_type()),
              "pack_quant_weight: scale must be fp32/fp16/int8 [", n, ", ", groups, "], got ",
              scale.sizes(), " ", scale.scalar_type());
  const bool has_min = min.has_value() && min->defined();
  TORCH_CHECK(!has_min || (min->sizes() == scale.sizes() &&
                           min->scalar_type() == scale.scalar_type()),
              "pack_quant_weight: min must match scale's shape and dtype");
  TORCH_CHECK(!has_min || group <= 1024,
              "pack_quant_weight: a weight with mins needs group_size <= 1024, got ", group);
  at::Tensor qc = q.contiguous();
  at::Tensor packed = at::zeros({panels, row, kPanel}, q.options().dtype(at::kByte));
  const auto* src = reinterpret_cast<const uint8_t*>(qc.const_data_ptr());
  auto* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t j = 0; j < kPanel && p * kPanel + j < n; ++j)
        for (int64_t i = 0; i < row; ++i)
          dst[(p * row + i) * kPanel + j] = src[(p * kPanel + j) * row + i];
  });
  return {packed, pack_quant_groups(scale), has_min ? pack_quant_groups(*min) : at::Tensor()};
}

bool given(const std::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() && t->numel() > 0;
}

// Checks codes' super-block scales (packed [P, groups / ratio, 32] fp32) and returns them.
const float* super_scales(const std::optional<at::Tensor>& super, const at::Tensor& codes,
                          const char* name, int64_t& ratio) {
  TORCH_CHECK(given(super), "linear_quant: int8 ", name, " need their ", name, "_super");
  TORCH_CHECK(super->dim() == 3 && super->size(0) == codes.size(0) &&
                  super->size(2) == kPanel && super->scalar_type() == at::kFloat &&
                  super->is_contiguous() && super->size(1) > 0 &&
                  codes.size(1) % super->size(1) == 0,
              "linear_quant: ", name, "_super must come from pack_quant_groups, got ",
              super->sizes());
  TORCH_CHECK(ratio == 0 || ratio == codes.size(1) / super->size(1),
              "linear_quant: scale_super and min_super must have the same super-blocks");
  ratio = codes.size(1) / super->size(1);
  return super->const_data_ptr<float>();
}

// y [M, N] = x [M, K] W^T + bias, x and y bf16, fp16 or fp32; W packed by pack_quant_weight
// (int8 scale or min codes with their super-block scales packed by pack_quant_groups).
at::Tensor linear_quant(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                        const std::optional<at::Tensor>& mins,
                        const std::optional<at::Tensor>& scale_super,
                        const std::optional<at::Tensor>& min_super,
                        const std::optional<at::Tensor>& bias, int64_t bits, int64_t group,
                        int64_t out_features) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous() &&
                  packed.scalar_type() == at::kByte && (bits == 8 || bits == 4),
              "linear_quant: packed must come from pack_quant_weight, got ", packed.sizes());
  const int64_t k = packed.size(1) * 8 / bits, panels = packed.size(0), n = out_features;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k && x.device().is_cpu(),
              "linear_quant: x must be a 2-D CPU tensor [tokens, ", k, "], got ", x.sizes());
  TORCH_CHECK(n > (panels - 1) * kPanel && n <= panels * kPanel, "linear_quant: out_features ",
              n, " does not fit ", panels, " panels of ", kPanel);
  TORCH_CHECK(group > 0 && k % group == 0 && scales.dim() == 3 && scales.size(0) == panels &&
                  scales.size(1) == k / group && scales.is_contiguous() &&
                  is_scale_dtype(scales.scalar_type()),
              "linear_quant: scales must come from pack_quant_weight with group_size ", group);
  const bool has_min = given(mins);
  TORCH_CHECK(!has_min || (mins->sizes() == scales.sizes() && mins->is_contiguous() &&
                           mins->scalar_type() == scales.scalar_type()),
              "linear_quant: mins must match the scales");
  QuantPanels w{packed.data_ptr<uint8_t>(), scales.const_data_ptr(),
                has_min ? mins->const_data_ptr() : nullptr,
                scales.scalar_type() == at::kHalf, bits, k, group, k / group, panels};
  int64_t ratio = 0;
  if (scales.scalar_type() == at::kChar) {
    w.scale_super = super_scales(scale_super, scales, "scales", ratio);
    if (has_min) w.min_super = super_scales(min_super, *mins, "mins", ratio);
    w.super_ratio = ratio;
  } else {
    TORCH_CHECK(!given(scale_super) && !given(min_super),
                "linear_quant: scale_super and min_super go with int8 scale codes only");
  }
  w.sym4 = bits == 4 && !has_min;
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "linear_quant: bias must be [", n, "]");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  const int64_t m = x.size(0);
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  if (linear_quant_amx(w, x, bias, y)) return y;
  if (linear_quant_bf16(w, x, bias, y)) return y;
  // x as fp32 rows, padded so that rows a multiple of 1 KiB apart do not alias in L1
  at::Tensor a = at::empty({m, k + 16}, x.options().dtype(at::kFloat));
  at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "linear_quant", [&] {
    const auto* src = xc.const_data_ptr<scalar_t>();
    for (int64_t r = 0; r < m; ++r)
      load_as_float(src + r * xc.stride(0), a.data_ptr<float>() + r * a.stride(0), k);
  });
  at::Tensor xsum;
  if (w.has_min() && !dequantizes_slices(m)) {
    xsum = at::empty({m, k / group}, a.options());
    group_sums(a.const_data_ptr<float>(), a.stride(0), m, w, xsum.data_ptr<float>());
  }
  const float* b = bias_f.defined() ? bias_f.const_data_ptr<float>() : nullptr;
  const float* xs = xsum.defined() ? xsum.const_data_ptr<float>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "linear_quant", [&] {
    run(w, a.const_data_ptr<float>(), a.stride(0), xs, m, b, y.data_ptr<scalar_t>(), n);
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("pack_quant_weight(Tensor q, Tensor scale, Tensor? min, int bits, int group_size) "
        "-> (Tensor, Tensor, Tensor)");
  m.impl("pack_quant_weight", c10::DispatchKey::CPU, &pack_quant_weight);
  m.def("pack_quant_groups(Tensor t) -> Tensor");
  m.impl("pack_quant_groups", c10::DispatchKey::CPU, &pack_quant_groups);
  m.def("linear_quant(Tensor x, Tensor packed, Tensor scales, Tensor? mins, "
        "Tensor? scale_super, Tensor? min_super, Tensor? bias, int bits, int group_size, "
        "int out_features) -> Tensor");
  m.impl("linear_quant", c10::DispatchKey::CPU, &linear_quant);
  m.def("set_linear_quant_bf16(int mode) -> bool", &set_linear_quant_bf16_mode);
  m.def("set_linear_quant_slice_rows(int rows) -> int", &set_linear_quant_slice_rows);
}
