// Drawing one token per row of a batch's logits on the CPU, and the min-p, top-k and
// top-p filters before it, built on first use by pdserve/kernels/cpu_ext.py; the
// references are pdserve.kernels.layers.sample_rows_ref and filter_rows_ref.
//
// Inverse transform sampling (Devroye, "Non-Uniform Random Variate Generation", 1986,
// section II.2): with weights w_j = exp((l_j - max_j l_j) / T), the token is the first
// index whose running sum of weights reaches (1 - u) * sum_j w_j, for u uniform in
// [0, 1). That is softmax(l / T) sampled with one uniform per row, without writing the
// probabilities or their running sums out: one pass for the row's max, one for the total
// weight, and one that adds 64-token blocks until the block holding the target, then
// walks that block token by token. Where torch's softmax, cumsum and searchsorted took
// several milliseconds per decode step for 32 rows of a 32000-token vocabulary, this
// takes a fraction of one. Rows with T = 0 take the argmax (the first index of the
// largest value, a NaN counting as the largest, as torch.argmax); so do rows whose
// largest value is not finite, which have no distribution to draw from.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "cpu_common.h"

namespace {

using pdserve::exp_f32;

constexpr int64_t kBlock = 64;  // tokens summed at once before the walk

// A logit's weight; 0 below e^-87 (exp_f32 clamps its argument there), so -inf weighs 0.
inline float weight(float logit, float max_logit, float inv_t) {
  const float x = (logit - max_logit) * inv_t;
  return x < -87.0f ? 0.0f : exp_f32(x);
}

// The first index of row[0..n) whose running weight reaches (1 - u) of the total.
int64_t draw_row(const float* row, int64_t n, float max_logit, float inv_t, double u) {
  float total = 0.0f;
#pragma omp simd reduction(+ : total)
  for (int64_t i = 0; i < n; ++i) total += weight(row[i], max_logit, inv_t);
  // NOTE: (0, total]; the max token's weight is 1, so total >= 1
  const float target = std::min(static_cast<float>((1.0 - u) * total), total);
  float running = 0.0f;
  for (int64_t start = 0; start < n; start += kBlock) {
    const int64_t end = std::min(n, start + kBlock);
    float block = 0.0f;
#pragma omp simd reduction(+ : block)
    for (int64_t i = start; i < end; ++i) block += weight(row[i], max_logit, inv_t);
    if (running + block < target) {
      running += block;
      continue;
    }
    for (int64_t i = start; i < end; ++i) {
      const float w = weight(row[i], max_logit, inv_t);
      running += w;
      if (w > 0.0f && running >= target) return i;
    }
  }
  // NOTE: rounding left the target a hair above every running sum: the last token
  // that has weight (there is one: the max's)
  int64_t last = n - 1;
  while (weight(row[last], max_logit, inv_t) == 0.0f) --last;
  return last;
}

// out[r] = a token drawn from softmax(logits[r] / temperature[r]) with u[r], or the
// argmax of logits[r] where temperature[r] is 0. logits: [rows, n] fp32, last dim
// contiguous; temperature: [rows] fp32 >= 0; u: [rows] fp64 in [0, 1); out: [rows] int64.
void sample_rows(at::Tensor out, const at::Tensor& logits, const at::Tensor& temperature,
                 const at::Tensor& u) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0 && logits.stride(1) == 1 &&
                  logits.scalar_type() == at::kFloat,
              "sample_rows: logits must be fp32 [rows, n >= 1] with a contiguous last dim");
  const int64_t rows = logits.size(0), n = logits.size(1), stride = logits.stride(0);
  TORCH_CHECK(out.dim() == 1 && out.size(0) == rows && out.scalar_type() == at::kLong &&
                  out.is_contiguous(),
              "sample_rows: out must be contiguous int64 [rows]");
  TORCH_CHECK(temperature.dim() == 1 && temperature.size(0) == rows &&
                  temperature.scalar_type() == at::kFloat && temperature.is_contiguous(),
              "sample_rows: temperature must be contiguous fp32 [rows]");
  TORCH_CHECK(u.dim() == 1 && u.size(0) == rows && u.scalar_type() == at::kDouble &&
                  u.is_contiguous(),
              "sample_rows: u must be contiguous fp64 [rows]");
  const float* ptr = logits.const_data_ptr<float>();
  const float* temps = temperature.const_data_ptr<float>();
  const double* uniforms = u.const_data_ptr<double>();
  int64_t* result = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, std::max<int64_t>(1, (1 << 14) / n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = ptr + r * stride;
      const pdserve::RowMax m = pdserve::row_max(row, n);
      if (temps[r] == 0.0f || m.nan || !std::isfinite(m.max)) {
        result[r] = pdserve::argmax_of(row, m);
      } else {
        result[r] = draw_row(row, n, m.max, 1.0f / temps[r], uniforms[r]);
      }
    }
  });
}

// Each filter keeps the tokens whose logit reaches a threshold (ties at it kept), as
// vLLM's top-k does: min-p keeps l >= max + ln(min_p), that is p >= min_p * p_max
// (Nguyen et al. 2024, https://arxiv.org/abs/2407.01082); top-k keeps l >= the k-th
// largest logit; top-p keeps l >= the logit of the token whose probability, added to
// those of every better token, first reaches p: the nucleus (Holtzman et al. 2019,
// https://arxiv.org/abs/1904.09751), after min-p and top-k and renormalized over what
// they kept. The last two thresholds are found without sorting the row, by a bisection
// over its values (largest_threshold: vectorized passes of a count, or sum of weights):
// the largest logit t with count(l >= t) >= k, or mass(l >= t) >= p; torch's sort of 32
// rows of 32000 took ~40 ms per step on 2 cores.

// What one pass over a row learns about a threshold t: how many logits are >= t and
// their weight (top-p), the smallest of them and the largest of the others.
struct Split {
  int32_t count;  // NOTE: 32-bit lanes (n < 2^31): 16 per AVX-512 compare
  float mass;
  float min_at_least;  // +inf when none
  float max_below;     // -inf when none
};
template <bool kWeighted>
inline Split split_at(const float* __restrict row, const float* __restrict w, int64_t n,
                      float t) {
  int32_t count = 0;
  float mass = 0.0f, lowest = INFINITY, highest = -INFINITY;
#pragma omp simd reduction(+ : count, mass) reduction(min : lowest) reduction(max : highest)
  for (int64_t i = 0; i < n; ++i) {
    const float x = row[i];
    const bool ge = x >= t;
    count += ge ? 1 : 0;
    if (kWeighted) mass += ge ? w[i] : 0.0f;
    lowest = std::min(lowest, ge ? x : INFINITY);
    highest = std::max(highest, ge ? -INFINITY : x);
  }
  return {count, mass, lowest, highest};
}

// The largest logit t of row[0..n) with measure(l >= t) >= target, where a logit's
// measure is its weight w[i] (kWeighted: top-p) or 1 (top-k); -inf logits never count.
// `lowest` is the row's smallest finite logit (where measure(l >= lowest) is the whole
// measure, `whole`) and `highest` its largest. A bisection over the values, each pass
// snapping the bounds to the logits found on either side of the midpoint: the search
// range only ever holds logits, ties end it at once, and a row of random logits takes
// ~15 passes (a bisection over the 2^32 orders of the fp32 bit patterns took 32). Once
// at most an eighth of the row lies in the range, its logits (and weights) are gathered
// into `scratch` and the passes go on over them alone. `low` is returned when even the
// whole measure falls short (rounding, when p is within an ulp of 1).
template <bool kWeighted>
float largest_threshold(const float* row, const float* w, int64_t n, double target,
                        float lowest, float highest, double whole, float low,
                        std::vector<float>& scratch) {
  auto measure = [](const Split& s) {
    return kWeighted ? static_cast<double>(s.mass) : static_cast<double>(s.count);
  };
  if (whole < target) return low;
  const Split top = split_at<kWeighted>(row, w, n, highest);
  if (measure(top) >= target) return highest;
  float lo = lowest, hi = highest;  // logits, with enough(lo) and the answer in [lo, hi]
  // over the whole row: the count of logits >= lo, and the count and measure of those > hi
  int64_t count_lo = n, count_above = 0;  // NOTE: count_lo counts -inf logits too
  double above = 0.0;
  bool gathered = false;  // searching the logits gathered from the range [lo, hi] alone
  double extra = 0.0;     // then: the measure of the logits above that range
  const float* values = row;
  const float* weights = w;
  int64_t m = n;
  for (bool first = true; lo < hi; first = false) {
    if (!gathered && !first && n >= 2048 && (count_lo - count_above) * 8 <= n) {
      scratch.resize(kWeighted ? 2 * n : n);
      float* v = scratch.data();
      float* cw = kWeighted ? v + n : nullptr;
      int64_t k = 0;
      for (int64_t i = 0; i < n; ++i) {  // NOTE: without a branch; one cursor moves
        const float x = row[i];
        v[k] = x;
        if (kWeighted) cw[k] = w[i];
        k += (x >= lo) & (x <= hi);
      }
      values = v, weights = cw, m = k, extra = above, gathered = true;
    }
    float mid = lo + (hi - lo) * 0.5f;
    if (!(mid > lo)) mid = hi;  // adjacent floats
    const Split s = split_at<kWeighted>(values, weights, m, mid);
    const double at_least = (gathered ? extra : 0.0) + measure(s);
    if (at_least >= target) {
      lo = s.min_at_least;
      if (!gathered) count_lo = s.count;
    } else {
      hi = s.max_below;
      if (!gathered) count_above = s.count, above = at_least;
    }
  }
  return lo;
}

// Set the logits of row[0..n) below each filter's threshold to -inf, given the row's
// largest logit (finite). min_p 0, top_k 0 and top_p >= 1 are off.
void filter_row(float* row, int64_t n, float max_logit, float min_p, int64_t top_k,
                float top_p) {
  float floor = -INFINITY;
  if (min_p > 0.0f) floor = max_logit + std::log(min_p);
  auto mask_below = [&](float t) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) row[i] = row[i] < t ? -INFINITY : row[i];
  };
  if (floor > -INFINITY) mask_below(floor);
  // the finite logits left: how many, and the smallest
  auto finite = [&]() {
    return split_at<false>(row, nullptr, n, -std::numeric_limits<float>::max());
  };
  thread_local std::vector<float> scratch;  // NOTE: one row's, reused across calls
  if (top_k > 0 && top_k < n) {
    const Split left = finite();
    const float kth = largest_threshold<false>(row, nullptr, n, static_cast<double>(top_k),
                                               left.min_at_least, max_logit,
                                               static_cast<double>(left.count), floor,
                                               scratch);
    mask_below(kth);
    floor = std::max(floor, kth);
  }
  if (top_p < 1.0f) {
    thread_local std::vector<float> weights;  // NOTE: one row's, reused across calls
    weights.resize(n);
    float* w = weights.data();
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t i = 0; i < n; ++i) {
      w[i] = weight(row[i], max_logit, 1.0f);
      total += w[i];
    }
    mask_below(largest_threshold<true>(row, w, n, static_cast<double>(top_p) * total,
                                       finite().min_at_least, max_logit, total, floor,
                                       scratch));
  }
}

// In place, row r of logits ([rows, n] fp32, last dim contiguous): min_p[r] (fp32,
// 0 off), top_k[r] (int64, 0 off), top_p[r] (fp32, 1 off), in that order. Rows whose
// largest logit is not finite, or that hold a NaN, are left alone.
void filter_rows(at::Tensor logits, const at::Tensor& min_p, const at::Tensor& top_k,
                 const at::Tensor& top_p) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0 && logits.stride(1) == 1 &&
                  logits.scalar_type() == at::kFloat,
              "filter_rows: logits must be fp32 [rows, n >= 1] with a contiguous last dim");
  const int64_t rows = logits.size(0), n = logits.size(1), stride = logits.stride(0);
  auto check = [rows](const at::Tensor& t, at::ScalarType type, const char* what) {
    TORCH_CHECK(t.dim() == 1 && t.size(0) == rows && t.scalar_type() == type &&
                    t.is_contiguous(),
                "filter_rows: ", what, " [rows]");
  };
  check(min_p, at::kFloat, "min_p must be contiguous fp32");
  check(top_k, at::kLong, "top_k must be contiguous int64");
  check(top_p, at::kFloat, "top_p must be contiguous fp32");
  float* ptr = logits.data_ptr<float>();
  const float* min_ps = min_p.const_data_ptr<float>();
  const int64_t* top_ks = top_k.const_data_ptr<int64_t>();
  const float* top_ps = top_p.const_data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = ptr + r * stride;
      const pdserve::RowMax m = pdserve::row_max(row, n);
      if (m.nan || !std::isfinite(m.max)) continue;  // NOTE: the draw takes its argmax
      filter_row(row, n, m.max, min_ps[r], top_ks[r], top_ps[r]);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("sample_rows(Tensor(a!) out, Tensor logits, Tensor temperature, Tensor u) -> ()");
  m.impl("sample_rows", c10::DispatchKey::CPU, &sample_rows);
  m.def("filter_rows(Tensor(a!) logits, Tensor min_p, Tensor top_k, Tensor top_p) -> ()");
  m.impl("filter_rows", c10::DispatchKey::CPU, &filter_rows);
}
