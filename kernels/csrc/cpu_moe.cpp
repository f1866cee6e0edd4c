// Grouped expert MLPs of a sparse mixture-of-experts block for CPUs (Shazeer et al. 2017,
// https://arxiv.org/abs/1701.06538; Mixtral, https://arxiv.org/abs/2401.04088); built on
// first use by pdserve/kernels/cpu_ext.py. The Python contract and the reference it must
// equal are pdserve/kernels/moe.py's fused_moe and moe_ref.
//
// The T x k (token, slot) pairs are sorted by expert (a counting sort), then each expert
// with tokens runs its gate_up matmul, SiLU-and-mul and down matmul (at::mm, in the
// activation dtype as transformers' linears) over its gathered rows; each result row,
// widened to fp32 and times its routing weight, is written to its (token, slot) row of an
// fp32 buffer, and the buffer's k slots are summed per token and rounded once. No two
// experts write the same row, so experts run in parallel (at::parallel_for) when the
// step is small (decode: a few rows per expert, where one matmul cannot use the threads);
// a large step runs them one after the other, each matmul on all threads.

#include <torch/library.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>

#include <algorithm>
#include <vector>

namespace {

// Below this many (token, slot) rows the experts run in parallel, each matmul on one thread.
constexpr int64_t kParallelExpertRows = 256;

at::Tensor moe_grouped(const at::Tensor& hidden, const at::Tensor& topk_ids,
                       const at::Tensor& topk_weights, const at::Tensor& w13,
                       const at::Tensor& w2) {
  TORCH_CHECK(hidden.dim() == 2, "hidden must be [T, H]");
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == hidden.size(0),
              "topk_ids must be [T, k]");
  TORCH_CHECK(topk_weights.sizes() == topk_ids.sizes(), "topk_weights must be [T, k]");
  TORCH_CHECK(topk_weights.scalar_type() == at::kFloat, "topk_weights must be float32");
  TORCH_CHECK(w13.dim() == 3 && w2.dim() == 3, "w13 and w2 must be 3-D");
  const int64_t num_tokens = hidden.size(0), hidden_size = hidden.size(1);
  const int64_t top_k = topk_ids.size(1), num_experts = w13.size(0);
  const int64_t inter = w13.size(1) / 2;
  TORCH_CHECK(w13.size(1) == 2 * inter && w13.size(2) == hidden_size,
              "w13 must be [E, 2 * I, H]");
  TORCH_CHECK(w2.size(0) == num_experts && w2.size(1) == hidden_size && w2.size(2) == inter,
              "w2 must be [E, H, I]");
  TORCH_CHECK(w13.scalar_type() == hidden.scalar_type() &&
                  w2.scalar_type() == hidden.scalar_type(),
              "w13, w2 and hidden must share a dtype");

  const int64_t num_rows = num_tokens * top_k;
  at::Tensor buffer = at::zeros({num_rows, hidden_size}, hidden.options().dtype(at::kFloat));
  if (num_rows == 0) {
    return buffer.view({num_tokens, top_k, hidden_size}).sum(1).to(hidden.scalar_type());
  }

  // Counting sort of the (token, slot) rows by expert.
  at::Tensor ids = topk_ids.to(at::kLong).contiguous().view(-1);
  const int64_t* id = ids.data_ptr<int64_t>();
  std::vector<int64_t> start(num_experts + 1, 0);
  for (int64_t r = 0; r < num_rows; ++r) {
    TORCH_CHECK(id[r] >= 0 && id[r] < num_experts, "topk_ids out of [0, ", num_experts, ")");
    ++start[id[r] + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) start[e + 1] += start[e];
  at::Tensor order = at::empty({num_rows}, ids.options());  // rows sorted by expert
  int64_t* ord = order.data_ptr<int64_t>();
  {
    std::vector<int64_t> next(start.begin(), start.end() - 1);
    for (int64_t r = 0; r < num_rows; ++r) ord[next[id[r]]++] = r;
  }
  at::Tensor tokens = at::floor_divide(order, top_k);
  at::Tensor weights = topk_weights.contiguous().view(-1);

  auto run_expert = [&](int64_t e) {
    const int64_t n = start[e + 1] - start[e];
    if (n == 0) return;
    at::Tensor rows = order.narrow(0, start[e], n);
    at::Tensor x = hidden.index_select(0, tokens.narrow(0, start[e], n));  // [n, H]
    at::Tensor gate_up = at::mm(x, w13[e].t());                              // [n, 2I]
    at::Tensor act = at::silu(gate_up.narrow(1, 0, inter)) * gate_up.narrow(1, inter, inter);
    at::Tensor y = at::mm(act, w2[e].t());                                   // [n, H]
    at::Tensor scaled = y.to(at::kFloat) * weights.index_select(0, rows).unsqueeze(1);
    buffer.index_copy_(0, rows, scaled);
  };
  if (num_rows <= kParallelExpertRows) {
    // NOTE: the ATen ops in the workers need the caller's inference / grad mode
    const at::ThreadLocalState caller_state;
    at::parallel_for(0, num_experts, 1, [&](int64_t begin, int64_t end) {
      at::ThreadLocalStateGuard guard(caller_state);
      for (int64_t e = begin; e < end; ++e) run_expert(e);
    });
  } else {
    for (int64_t e = 0; e < num_experts; ++e) run_expert(e);
  }
  return buffer.view({num_tokens, top_k, hidden_size}).sum(1).to(hidden.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("moe_grouped(Tensor hidden, Tensor topk_ids, Tensor topk_weights, Tensor w13, "
        "Tensor w2) -> Tensor");
  m.impl("moe_grouped", c10::DispatchKey::CPU, &moe_grouped);
}
