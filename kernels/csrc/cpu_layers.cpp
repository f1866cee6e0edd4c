// Fused elementwise layers for CPUs: RMSNorm (with the residual add), rotary position
// embedding and SiLU-and-mul, and a row argmax for greedy sampling; built on first use by
// pdserve/kernels/cpu_ext.py.
//
// Each op does in one pass over memory what the PyTorch reference does in 4-10 ops, and
// rounds to the activation dtype exactly where the reference (and transformers) rounds,
// so bf16/fp16 outputs match it bit for bit up to the order of fp32 sums. Rows run on
// torch's intra-op threads (at::parallel_for); small tensors stay on one thread.

#include <torch/library.h>

#include <sched.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu_common.h"

namespace {

using pdserve::Elem;
using pdserve::exp_f32;
using pdserve::raw_ptr;
using pdserve::round_to;

constexpr int64_t kGrainElements = 1 << 15;  // below this many elements: one thread

int64_t grain_rows(int64_t row_elements) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, row_elements));
}

void check_rows(const at::Tensor& t, const char* name, int64_t dims) {
  TORCH_CHECK(t.dim() == dims, name, " must be ", dims, "-D, got ", t.dim(), "-D");
  TORCH_CHECK(t.stride(-1) == 1, name, ": the last dim must be contiguous");
}

// One row: out = weight * round(x * rsqrt(mean(x^2) + eps)), statistics in fp32.
// With `residual`: first residual = round(x + residual), then the norm of that.
template <typename T, typename R = typename Elem<T>::raw>
void rms_norm_row(const R* x, R* residual, const R* weight, R* out, int64_t n, float eps) {
  using E = Elem<T>;
  float sum_sq = 0.0f;
  if (residual != nullptr) {
#pragma omp simd reduction(+ : sum_sq)
    for (int64_t i = 0; i < n; ++i) {
      const float v = round_to<T>(E::widen(x[i]) + E::widen(residual[i]));
      residual[i] = E::narrow(v);
      sum_sq += v * v;
    }
    x = residual;
  } else {
#pragma omp simd reduction(+ : sum_sq)
    for (int64_t i = 0; i < n; ++i) sum_sq += E::widen(x[i]) * E::widen(x[i]);
  }
  const float inv_rms = 1.0f / std::sqrt(sum_sq / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i)
    out[i] = E::narrow(E::widen(weight[i]) * round_to<T>(E::widen(x[i]) * inv_rms));
}

template <typename T>
void rms_norm_rows(const at::Tensor& x, at::Tensor* residual, const at::Tensor& weight,
                   at::Tensor& out, double eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  const auto* x_ptr = raw_ptr<T>(x);
  auto* res_ptr = residual ? raw_ptr<T>(*residual) : nullptr;
  const auto* w_ptr = raw_ptr<T>(weight);
  auto* out_ptr = raw_ptr<T>(out);
  const int64_t x_s = x.stride(0), o_s = out.stride(0), r_s = residual ? residual->stride(0) : 0;
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      rms_norm_row<T>(x_ptr + r * x_s, res_ptr ? res_ptr + r * r_s : nullptr, w_ptr,
                      out_ptr + r * o_s, n, static_cast<float>(eps));
  });
}

#define PDSERVE_DISPATCH_FLOAT(dtype, name, ...)                               \
  switch (dtype) {                                                             \
    case at::kFloat: { using scalar_t = float; __VA_ARGS__; break; }           \
    case at::kBFloat16: { using scalar_t = c10::BFloat16; __VA_ARGS__; break; } \
    case at::kHalf: { using scalar_t = c10::Half; __VA_ARGS__; break; }        \
    default: TORCH_CHECK(false, name, ": unsupported dtype ", dtype);          \
  }

void check_norm_args(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& out) {
  check_rows(x, "rms_norm: x", 2);
  check_rows(out, "rms_norm: out", 2);
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1),
              "rms_norm: weight must be contiguous [", x.size(1), "]");
  TORCH_CHECK(out.sizes() == x.sizes(), "rms_norm: out must have x's shape");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && out.scalar_type() == x.scalar_type(),
              "rms_norm: x, weight and out must share a dtype");
}

void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm_args(x, weight, out);
  PDSERVE_DISPATCH_FLOAT(x.scalar_type(), "rms_norm",
                         rms_norm_rows<scalar_t>(x, nullptr, weight, out, eps));
}

void fused_add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight,
                        double eps) {
  check_norm_args(x, weight, x);
  check_rows(residual, "fused_add_rms_norm: residual", 2);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "fused_add_rms_norm: residual must have x's shape and dtype");
  // NOTE: x is read (into the sum) before it is overwritten with the norm, row by row.
  PDSERVE_DISPATCH_FLOAT(x.scalar_type(), "fused_add_rms_norm",
                         rms_norm_rows<scalar_t>(x, &residual, weight, x, eps));
}

// Rotate-half RoPE in place on each [head_dim] row of `t` ([tokens, heads, head_dim]):
// out = round(round(t * cos) + round(rotate_half(t) * sin)), as transformers' bf16 ops.
template <typename T>
void rotary_rows(at::Tensor& t, const at::Tensor& cos, const at::Tensor& sin) {
  using E = Elem<T>;
  const int64_t tokens = t.size(0), heads = t.size(1), dim = t.size(2), half = dim / 2;
  const int64_t t_s = t.stride(0), h_s = t.stride(1), cs_s = cos.stride(0);
  auto* ptr = raw_ptr<T>(t);
  const auto* cos_ptr = raw_ptr<T>(cos);
  const auto* sin_ptr = raw_ptr<T>(sin);
  at::parallel_for(0, tokens, grain_rows(heads * dim), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const auto* c = cos_ptr + i * cs_s;
      const auto* s = sin_ptr + i * cs_s;
      for (int64_t h = 0; h < heads; ++h) {
        auto* row = ptr + i * t_s + h * h_s;
#pragma omp simd
        for (int64_t d = 0; d < half; ++d) {
          const float x1 = E::widen(row[d]), x2 = E::widen(row[d + half]);
          const float y1 = round_to<T>(x1 * E::widen(c[d])) + round_to<T>(-x2 * E::widen(s[d]));
          const float y2 = round_to<T>(x2 * E::widen(c[d + half])) +
                           round_to<T>(x1 * E::widen(s[d + half]));
          row[d] = E::narrow(y1);
          row[d + half] = E::narrow(y2);
        }
      }
    }
  });
}

void rotary_embedding(at::Tensor query, at::Tensor key, const at::Tensor& cos,
                      const at::Tensor& sin) {
  check_rows(query, "rotary_embedding: query", 3);
  check_rows(key, "rotary_embedding: key", 3);
  check_rows(cos, "rotary_embedding: cos", 2);
  TORCH_CHECK(sin.sizes() == cos.sizes() && sin.strides() == cos.strides(),
              "rotary_embedding: sin must be laid out as cos");
  TORCH_CHECK(query.size(0) == key.size(0) && cos.size(0) == query.size(0),
              "rotary_embedding: query, key, cos and sin must have the same token count");
  TORCH_CHECK(query.size(2) == key.size(2) && cos.size(1) == query.size(2) &&
                  query.size(2) % 2 == 0,
              "rotary_embedding: head_dim must be even and the same for all");
  TORCH_CHECK(key.scalar_type() == query.scalar_type() &&
                  cos.scalar_type() == query.scalar_type() &&
                  sin.scalar_type() == query.scalar_type(),
              "rotary_embedding: query, key, cos and sin must share a dtype");
  PDSERVE_DISPATCH_FLOAT(query.scalar_type(), "rotary_embedding", {
    rotary_rows<scalar_t>(query, cos, sin);
    rotary_rows<scalar_t>(key, cos, sin);
  });
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define PDSERVE_AVX512_BF16 1

inline __m512 bf16x16_to_f32(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// bf16 silu_and_mul on 16 lanes at a time (tail masked), rounding as the reference.
void silu_and_mul_row_avx512_bf16(const uint16_t* gate, const uint16_t* up, uint16_t* out,
                                  int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 g = bf16x16_to_f32(_mm256_maskz_loadu_epi16(m, gate + i));
    const __m512 u = bf16x16_to_f32(_mm256_maskz_loadu_epi16(m, up + i));
    const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.0f), pdserve::exp512(_mm512_sub_ps(_mm512_setzero_ps(), g)));
    const __m256bh act = _mm512_cvtneps_pbh(_mm512_div_ps(g, d));
    const __m512 y = _mm512_mul_ps(bf16x16_to_f32((__m256i)act), u);
    _mm256_mask_storeu_epi16(out + i, m, (__m256i)_mm512_cvtneps_pbh(y));
  }
}
#endif

// out[t] = round(round(silu(gate[t])) * up[t]) with x[t] = [gate | up].
template <typename T>
void silu_and_mul_rows(at::Tensor& out, const at::Tensor& x) {
  using E = Elem<T>;
  const int64_t rows = x.size(0), n = out.size(1);
  const auto* x_ptr = raw_ptr<T>(x);
  auto* out_ptr = raw_ptr<T>(out);
  const int64_t x_s = x.stride(0), o_s = out.stride(0);
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const auto* gate = x_ptr + r * x_s;
      const auto* up = gate + n;
      auto* o = out_ptr + r * o_s;
#ifdef PDSERVE_AVX512_BF16
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        silu_and_mul_row_avx512_bf16(gate, up, o, n);
        continue;
      }
#endif
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        const float g = E::widen(gate[i]);
        const float act = round_to<T>(g / (1.0f + exp_f32(-g)));
        o[i] = E::narrow(act * E::widen(up[i]));
      }
    }
  });
}

void silu_and_mul(at::Tensor out, const at::Tensor& x) {
  check_rows(x, "silu_and_mul: x", 2);
  check_rows(out, "silu_and_mul: out", 2);
  TORCH_CHECK(x.size(1) == 2 * out.size(1) && x.size(0) == out.size(0),
              "silu_and_mul: x must be [tokens, 2 * d] and out [tokens, d]");
  TORCH_CHECK(out.scalar_type() == x.scalar_type(), "silu_and_mul: out must have x's dtype");
  PDSERVE_DISPATCH_FLOAT(x.scalar_type(), "silu_and_mul", silu_and_mul_rows<scalar_t>(out, x));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm);
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.impl("fused_add_rms_norm", c10::DispatchKey::CPU, &fused_add_rms_norm);
  m.def("rotary_embedding(Tensor(a!) query, Tensor(b!) key, Tensor cos, Tensor sin) -> ()");
  m.impl("rotary_embedding", c10::DispatchKey::CPU, &rotary_embedding);
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.impl("silu_and_mul", c10::DispatchKey::CPU, &silu_and_mul);
}

namespace {

// out[r] = the first index of the largest value of row r of x ([rows, n] fp32; a NaN
// counts as the largest, as torch.argmax). Two vectorized passes per row (max, then the
// first index holding it); rows in parallel.
void argmax_rows(at::Tensor out, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0 && x.stride(1) == 1 &&
                  x.scalar_type() == at::kFloat,
              "argmax_rows: x must be fp32 [rows, n >= 1] with a contiguous last dim");
  TORCH_CHECK(out.dim() == 1 && out.size(0) == x.size(0) && out.scalar_type() == at::kLong &&
                  out.is_contiguous(),
              "argmax_rows: out must be contiguous int64 [rows]");
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  const float* ptr = x.const_data_ptr<float>();
  int64_t* result = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, std::max<int64_t>(1, (1 << 16) / n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = ptr + r * stride;
      result[r] = pdserve::argmax_of(row, pdserve::row_max(row, n));
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("argmax_rows(Tensor(a!) out, Tensor x) -> ()");
  m.impl("argmax_rows", c10::DispatchKey::CPU, &argmax_rows);
}

// Binds intra-op thread i of the calling thread's OpenMP team (torch's intra-op pool, as
// at::parallel_for runs it) to CPU cpus[i] (Linux sched_setaffinity on that thread), as
// vLLM's CPU worker binds its OpenMP threads (VLLM_CPU_OMP_THREADS_BIND). A bound team
// is never stacked on one core by the kernel's load balancing while other processes
// take the other core: its threads are preempted in place instead, and the team meets
// at the next barrier as soon as they run again. Returns the number of threads bound.
int64_t bind_intra_op_threads(std::vector<int64_t> cpus) {
  const int64_t n = at::get_num_threads();
  TORCH_CHECK(static_cast<int64_t>(cpus.size()) >= n, "bind_intra_op_threads: ", n,
              " intra-op threads, but only ", cpus.size(), " CPUs given");
  std::vector<int> bound(n, 0);
  // NOTE: a range of n with grain 1 gives each of the team's n threads one index
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int thread = at::get_thread_num();
      if (cpus[thread] < 0 || cpus[thread] >= CPU_SETSIZE) continue;  // counted as unbound
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(static_cast<int>(cpus[thread]), &set);
      bound[thread] = sched_setaffinity(0, sizeof(set), &set) == 0;
    }
  });
  int64_t count = 0;
  for (int b : bound) count += b;
  return count;
}

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("bind_intra_op_threads(int[] cpus) -> int");
  m.impl("bind_intra_op_threads", &bind_intra_op_threads);
}
