"""Fused elementwise layers: RMSNorm (with the residual add), rotary embedding, SiLU-and-mul;
and the greedy sampler's row argmax.

Each entry point sends CPU tensors to a C++ kernel (``kernels/csrc/cpu_layers.cpp``,
``pdserve.kernels.cpu_ext``) where it is built, and everything else to its ``*_ref``,
plain PyTorch in transformers' order of operations (fp32 statistics, the cast back to
the activation dtype in the same places). The kernels round where the references round,
so both agree to the order of fp32 sums. Names and in-place contracts follow vLLM's
custom ops (``rms_norm``, ``fused_add_rms_norm``, ``rotary_embedding``, ``silu_and_mul``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.kernels import cpu_ext


def _on_cpu_kernels(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" for t in tensors) and cpu_ext.load()


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019, https://arxiv.org/abs/1910.07467).

    Args:
        x: ``[tokens, hidden]`` float; weight: ``[hidden]`` in ``x``'s dtype.

    Returns:
        ``weight * (x * rsqrt(mean(x**2) + eps)).to(x.dtype)``, statistics in fp32.
    """
    # mean(x^2) as one fused fp32 reduction: ||x||^2 / dim.
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)
    inv_rms = torch.rsqrt(norm.square_().div_(x.shape[-1]).add_(eps))
    return weight * (x.float() * inv_rms).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``rms_norm_ref``, fused on CPU. ``x: [..., hidden]`` (last dim contiguous)."""
    if x.dim() == 2 and _on_cpu_kernels(x) and weight.dtype == x.dtype and x.stride(-1) == 1:
        out = torch.empty(x.shape, dtype=x.dtype)
        torch.ops.pdserve_cpu.rms_norm(out, x, weight, eps)
        return out
    return rms_norm_ref(x, weight, eps)


def gemma_rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm (transformers' ``Gemma2RMSNorm``): ``x: [..., hidden]`` float,
    ``weight: [hidden]`` -> ``(x.float() * rsqrt(mean(x**2) + eps) * (1 + weight.float()))``
    cast to ``x``'s dtype at the end. Plain PyTorch on every device."""
    xf = x.float()
    inv_rms = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * inv_rms * (1.0 + weight.float())).to(x.dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual = x + residual`` (in ``x``'s dtype), then ``rms_norm(residual)``.

    Args:
        x, residual: ``[tokens, hidden]``, same dtype; weight ``[hidden]``.

    Returns:
        ``(normed, residual)``. On the CPU kernel both are written in place (``x`` holds
        the norm, ``residual`` the sum), as vLLM's op; callers must use the returned
        tensors and not rely on either input afterwards.
    """
    if (_on_cpu_kernels(x, residual) and x.dim() == 2 and weight.dtype == x.dtype
            and x.stride(-1) == 1 and residual.stride(-1) == 1):
        torch.ops.pdserve_cpu.fused_add_rms_norm(x, residual, weight, eps)
        return x, residual
    residual = x + residual
    return rms_norm_ref(residual, weight, eps), residual


def rotary_embedding_ref(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE (RoFormer, https://arxiv.org/abs/2104.09864), as transformers'
    Llama: ``x * cos + rotate_half(x) * sin``.

    Args:
        query: ``[tokens, heads, head_dim]``; key: ``[tokens, kv_heads, head_dim]``.
        cos, sin: ``[tokens, head_dim]`` in the query's dtype.

    Returns:
        New rotated ``(query, key)``.
    """
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return query * cos + _rotate_half(query) * sin, key * cos + _rotate_half(key) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def rotary_embedding(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``rotary_embedding_ref``; on CPU the rotation is done in place (query and key may be
    strided views, e.g. of the fused qkv projection) and the inputs are returned."""
    if (_on_cpu_kernels(query, key) and query.stride(-1) == 1 and key.stride(-1) == 1
            and cos.stride(-1) == 1 and sin.stride(-1) == 1
            and cos.dtype == sin.dtype == query.dtype == key.dtype):
        torch.ops.pdserve_cpu.rotary_embedding(query, key, cos, sin)
        return query, key
    return rotary_embedding_ref(query, key, cos, sin)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate (Shazeer 2020, https://arxiv.org/abs/2002.05202): ``x = [gate | up]``
    ``[tokens, 2 * d]`` -> ``silu(gate) * up`` ``[tokens, d]``."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """GeGLU's gate (Shazeer 2020), Gemma's MLP: ``x = [gate | up]`` ``[tokens, 2 * d]`` ->
    ``gelu_tanh(gate) * up`` ``[tokens, d]`` (the tanh approximation, transformers'
    ``gelu_pytorch_tanh``). Plain PyTorch on every device."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu_and_mul_ref``, fused on CPU."""
    if x.dim() == 2 and _on_cpu_kernels(x) and x.stride(-1) == 1:
        out = torch.empty((x.shape[0], x.shape[1] // 2), dtype=x.dtype)
        torch.ops.pdserve_cpu.silu_and_mul(out, x)
        return out
    return silu_and_mul_ref(x)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` for fp32 ``[rows, n]``: the first index of each row's largest
    value (a NaN counts as the largest), int64 ``[rows]``. On CPU a C++ kernel: two
    vectorized passes per row, rows in parallel (torch's takes ~0.8 ms for 32 x 32000
    on 2 cores, a per-step cost in greedy decoding)."""
    if (x.dim() == 2 and x.dtype == torch.float32 and x.shape[1] > 0 and x.stride(-1) == 1
            and _on_cpu_kernels(x)):
        out = torch.empty(x.shape[0], dtype=torch.int64)
        torch.ops.pdserve_cpu.argmax_rows(out, x)
        return out
    return x.argmax(dim=-1)


def sample_rows_ref(logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor
                    ) -> torch.Tensor:
    """One token per row of ``logits: [rows, vocab]`` fp32: the argmax where
    ``temperature: [rows]`` fp32 is 0, else a draw from ``softmax(logits / temperature)``
    by inverse transform sampling with ``u: [rows]`` fp64 uniform in [0, 1): the first
    index whose running sum of probabilities reaches ``(1 - u)`` of the row's total (so
    a token of probability 0 is never drawn). A row whose largest logit is not finite
    takes the argmax. Returns int64 ``[rows]``."""
    greedy = (temperature == 0) | ~torch.isfinite(logits.amax(dim=-1))
    scaled = logits / torch.where(greedy, 1.0, temperature)[:, None]
    probs = torch.softmax(scaled.masked_fill(greedy[:, None], 0.0), dim=-1)  # [rows, vocab]
    cdf = probs.cumsum(dim=-1)
    target = ((1.0 - u) * cdf[:, -1].to(u.dtype)).to(cdf.dtype)  # (0, total]
    # NOTE: fp32 rounding can put the target a hair above the last running sum.
    target = torch.minimum(target, cdf[:, -1])
    drawn = torch.searchsorted(cdf, target[:, None]).squeeze(1)
    return torch.where(greedy, logits.argmax(dim=-1), drawn)


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor
                ) -> torch.Tensor:
    """``sample_rows_ref``; on CPU a C++ kernel (``kernels/csrc/cpu_sampling.cpp``) that
    never writes the probabilities or their running sums: rows in parallel, the draw
    within 64-token blocks of the running sum. The two agree token for token but where
    the target falls within rounding of a boundary between two tokens."""
    if (logits.dim() == 2 and logits.dtype == torch.float32 and logits.shape[1] > 0
            and logits.stride(-1) == 1 and _on_cpu_kernels(logits)):
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        torch.ops.pdserve_cpu.sample_rows(out, logits, temperature.float().contiguous(),
                                          u.double().contiguous())
        return out
    return sample_rows_ref(logits, temperature, u)


def filter_rows_ref(logits: torch.Tensor, min_p: torch.Tensor, top_k: torch.Tensor,
                    top_p: torch.Tensor) -> torch.Tensor:
    """Row ``r`` of ``logits: [rows, vocab]`` fp32 with min-p, top-k and top-p applied in
    that order (``min_p: [rows]`` fp32, 0 off; ``top_k: [rows]`` int64, 0 off; ``top_p:
    [rows]`` fp32, 1 off): each sets to -inf the logits below a threshold, so ties at it
    are kept (as vLLM's top-k). min-p (https://arxiv.org/abs/2407.01082): ``max +
    ln(min_p)``, a probability ``min_p`` times the top one's; top-k: the k-th largest
    logit; top-p, the nucleus (https://arxiv.org/abs/1904.09751) of what is left: the
    logit of the token whose probability, added to every better token's, first reaches
    ``top_p``. Rows whose largest logit is not finite, or that hold a NaN, are returned as
    they are. Batched torch ops (a sort per filter in use), on any device: the sampler's
    path on GPUs and where the C++ kernels are off. Returns a new tensor."""
    out = logits.clone()
    if out.numel() == 0:
        return out
    vocab = out.shape[1]
    top = out.amax(dim=-1)  # [rows]
    usable = torch.isfinite(top) & ~out.isnan().any(dim=-1)
    neg_inf = float("-inf")
    # min-p: log(0) = -inf leaves rows with min_p 0 alone
    floor = top + torch.log(min_p.to(out.dtype))
    out = out.masked_fill(usable[:, None] & (out < floor[:, None]), neg_inf)
    k = top_k.to(torch.int64)
    on = usable & (k > 0) & (k < vocab)
    if bool(on.any()):
        ordered = out.sort(dim=-1, descending=True).values
        kth = ordered.gather(1, (k.clamp(1, vocab) - 1)[:, None])  # [rows, 1]
        out = out.masked_fill(on[:, None] & (out < kth), neg_inf)
    on = usable & (top_p < 1)
    if bool(on.any()):
        weights = torch.exp(out - top[:, None])  # [rows, vocab], 0 where -inf
        ordered, order = weights.sort(dim=-1, descending=True)
        running = ordered.cumsum(dim=-1)
        target = (top_p.to(out.dtype) * weights.sum(dim=-1))[:, None]
        crossing = torch.searchsorted(running, target).clamp_max(vocab - 1)  # [rows, 1]
        threshold = out.gather(1, order.gather(1, crossing))
        out = out.masked_fill(on[:, None] & (out < threshold), neg_inf)
    return out


def filter_rows(logits: torch.Tensor, min_p: torch.Tensor, top_k: torch.Tensor,
                top_p: torch.Tensor) -> torch.Tensor:
    """``filter_rows_ref``; on CPU a C++ kernel (``kernels/csrc/cpu_sampling.cpp``) that
    finds each threshold by bisection over the row instead of sorting it, in place on
    ``logits`` (returned)."""
    if (logits.dim() == 2 and logits.dtype == torch.float32 and logits.shape[1] > 0
            and logits.stride(-1) == 1 and _on_cpu_kernels(logits)):
        torch.ops.pdserve_cpu.filter_rows(logits, min_p.float().contiguous(),
                                          top_k.long().contiguous(),
                                          top_p.float().contiguous())
        return logits
    return filter_rows_ref(logits, min_p, top_k, top_p)
