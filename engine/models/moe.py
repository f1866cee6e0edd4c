"""The sparse mixture-of-experts block of Mixtral, Qwen2-MoE and Qwen3-MoE: a router picks
each token's top-k experts, whose SwiGLU MLPs' outputs are summed with the routing
weights (Shazeer et al. 2017, https://arxiv.org/abs/1701.06538; Mixtral,
https://arxiv.org/abs/2401.04088); Qwen2-MoE adds a shared expert behind a sigmoid gate.

Routing follows transformers 5's ``*TopKRouter`` step for step: router logits in the
activation dtype, softmax over all experts in fp32, top-k, then

- Mixtral: the top-k weights divided by their sum (the softmax over the top-k logits of
  the paper, in transformers' rounding), kept in fp32;
- Qwen2-MoE / Qwen3-MoE: divided by their sum only where ``norm_topk_prob``, then
  rounded to the activation dtype.

The experts are stacked: ``w13 [E, 2 * I_local, H]`` (each expert's gate rows, then its
up rows) and ``w2 [E, H, I_local]``; ``kernels/moe.py``'s ``fused_moe`` runs them.

Tensor parallelism (``engine/parallel.py``): each rank holds every expert's ``1 / N``
slice of the expert intermediate dimension (and of the shared expert's), as a dense MLP's
column/row-parallel split; the router and the shared expert's gate are whole. A rank's
output is then a partial sum (``forward_partial``), which ``forward`` all-reduces, once.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from pdserve.engine.config import ModelConfig, UnsupportedModelError
from pdserve.engine.parallel import TensorParallel
from pdserve.kernels.layers import silu_and_mul
from pdserve.kernels.moe import fused_moe

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"experts\.(\d+)\.(\w+)\.weight")
# transformers' per-expert names -> (w13 gate rows | w13 up rows | w2)
_EXPERT_PARTS = {"w1": "gate", "w3": "up", "w2": "down",
                 "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


class SharedExpert(nn.Module):
    """Qwen2-MoE's shared expert: a SwiGLU MLP of this rank's ``inter`` columns,
    ``[T, hidden] -> [T, hidden]`` (a partial sum under tensor parallelism)."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class MoEBlock(nn.Module):
    """A decoder layer's sparse MoE block: ``forward(x [T, hidden])`` -> ``[T, hidden]``
    in ``x``'s dtype (bf16, fp16 or fp32), the full output on every rank.

    Args:
        config: the FULL model config (``moe_intermediate_size`` and
            ``shared_expert_intermediate_size`` whole; this block takes ``tp``'s share).
        tp: this rank's place in its tensor-parallel group (size 1: the whole block).

    Parameters: ``gate.weight [E, hidden]`` (the router), ``w13 [E, 2 * I_local,
    hidden]``, ``w2 [E, hidden, I_local]``; with a shared expert,
    ``shared_expert.gate_up_proj`` / ``down_proj`` (its ``S_local`` columns) and
    ``shared_expert_gate.weight [1, hidden]``.
    """

    def __init__(self, config: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.router_weights_fp32 = config.router_weights_fp32
        hidden = config.hidden_size
        self.full_inter = config.moe_intermediate_size
        self.inter_start, self.inter = tp.shard(self.full_inter)
        # NOTE: Mixtral's checkpoints name the block block_sparse_moe, Qwen's mlp
        self.checkpoint_prefix = ("block_sparse_moe" if config.architecture == "MixtralForCausalLM"
                                  else "mlp")
        self.gate = nn.Linear(hidden, self.num_experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(self.num_experts, 2 * self.inter, hidden))
        self.w2 = nn.Parameter(torch.empty(self.num_experts, hidden, self.inter))
        self.full_shared = config.shared_expert_intermediate_size
        self.shared_expert = self.shared_expert_gate = None
        if self.full_shared:
            self.shared_start, self.shared_inter = tp.shard(self.full_shared)
            self.shared_expert = SharedExpert(hidden, self.shared_inter)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k experts ``[T, k]`` int64 and routing weights ``[T, k]``
        (fp32 for Mixtral, else ``x``'s dtype), in transformers' order of operations."""
        logits = self.gate(x)  # [T, E] in x's dtype
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.router_weights_fp32:
            weights = weights.to(x.dtype)
        return ids, weights

    def forward_partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum of the block's output, ``[T, hidden]`` in ``x``'s dtype
        (the whole output at size 1); the ranks' partials sum to the output."""
        ids, weights = self.route(x)
        out = fused_moe(x, ids, weights, self.w13, self.w2)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.forward_partial(x))

    def checkpoint_names(self, fused_experts: bool = False) -> list[str]:
        """The transformers names (relative to the decoder layer) of the tensors this
        block reads: per expert (``experts.{e}.w1`` ... as transformers saves them), or
        with ``fused_experts``, transformers 5's stacked ``mlp.experts.gate_up_proj`` and
        ``mlp.experts.down_proj`` (its in-memory names, Mixtral's block as ``mlp`` too)."""
        p = "mlp" if fused_experts else self.checkpoint_prefix
        names = [f"{p}.gate.weight"]
        if fused_experts:
            names += [f"{p}.experts.gate_up_proj", f"{p}.experts.down_proj"]
        else:
            parts = ("w1", "w2", "w3") if p == "block_sparse_moe" else \
                ("gate_proj", "up_proj", "down_proj")
            names += [f"{p}.experts.{e}.{part}.weight" for e in range(self.num_experts)
                      for part in parts]
        if self.shared_expert is not None:
            names += [f"{p}.shared_expert.{part}.weight"
                      for part in ("gate_proj", "up_proj", "down_proj")]
            names.append(f"{p}.shared_expert_gate.weight")
        return names

    @torch.no_grad()
    def load_weight(self, name: str, tensor: torch.Tensor) -> str | None:
        """Copy the transformers tensor ``name`` (relative to the decoder layer, e.g.
        ``block_sparse_moe.experts.3.w1.weight``, ``mlp.shared_expert.up_proj.weight``,
        ``mlp.experts.gate_up_proj``) into this rank's slice of its place, cut with
        ``tensor.narrow`` along the expert intermediate dimension.

        Returns:
            The name of the parameter written (relative to this block), or None where
            ``name`` is not this block's.

        Raises:
            UnsupportedModelError: a quantized (non-float) tensor.
            ValueError: a tensor whose shape does not match its place.
        """
        # NOTE: transformers 5 holds Mixtral's block as mlp, its checkpoints as block_sparse_moe
        prefix = next((p for p in (self.checkpoint_prefix + ".", "mlp.")
                       if name.startswith(p)), None)
        if prefix is None:
            return None
        name = name[len(prefix):]
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            raise UnsupportedModelError(
                f"{prefix}{name}: quantized expert weights are not supported; pdserve runs "
                "mixture-of-experts models in bf16/fp16/fp32")
        inter, start = self.inter, self.inter_start
        if name == "gate.weight":
            return _copy(self.gate.weight, tensor, name, "gate.weight")
        if name == "experts.gate_up_proj":  # [E, 2 * I, H], gate rows then up rows
            full = self.full_inter
            _copy(self.w13[:, :inter], _narrow(tensor, 1, start, inter, 2 * full), name, "w13")
            _copy(self.w13[:, inter:], tensor.narrow(1, full + start, inter), name, "w13")
            return "w13"
        if name == "experts.down_proj":  # [E, H, I]
            return _copy(self.w2, _narrow(tensor, 2, start, inter, self.full_inter), name, "w2")
        match = _EXPERT.fullmatch(name)
        if match and _EXPERT_PARTS.get(match[2]) and int(match[1]) < self.num_experts:
            e, part = int(match[1]), _EXPERT_PARTS[match[2]]
            if part == "down":  # [H, I]: this rank's input columns
                return _copy(self.w2[e], _narrow(tensor, 1, start, inter, self.full_inter),
                             name, "w2")
            rows = self.w13[e, :inter] if part == "gate" else self.w13[e, inter:]
            return _copy(rows, _narrow(tensor, 0, start, inter, self.full_inter), name, "w13")
        if self.shared_expert is not None:
            return self._load_shared(name, tensor)
        return None

    def _load_shared(self, name: str, tensor: torch.Tensor) -> str | None:
        if name == "shared_expert_gate.weight":
            return _copy(self.shared_expert_gate.weight, tensor, name,
                         "shared_expert_gate.weight")
        start, inter, full = self.shared_start, self.shared_inter, self.full_shared
        gate_up = self.shared_expert.gate_up_proj.weight
        if name == "shared_expert.gate_proj.weight":
            return _copy(gate_up[:inter], _narrow(tensor, 0, start, inter, full), name,
                         "shared_expert.gate_up_proj.weight")
        if name == "shared_expert.up_proj.weight":
            return _copy(gate_up[inter:], _narrow(tensor, 0, start, inter, full), name,
                         "shared_expert.gate_up_proj.weight")
        if name == "shared_expert.down_proj.weight":
            return _copy(self.shared_expert.down_proj.weight,
                         _narrow(tensor, 1, start, inter, full), name,
                         "shared_expert.down_proj.weight")
        return None


def _narrow(tensor: torch.Tensor, dim: int, start: int, length: int, full: int
            ) -> torch.Tensor:
    """This rank's ``[start, start + length)`` of ``tensor``'s ``dim``, which must be
    ``full`` long (else ``ValueError``)."""
    if tensor.dim() <= dim or tensor.shape[dim] != full:
        raise ValueError(f"checkpoint shape {tuple(tensor.shape)}: expected {full} along "
                         f"dim {dim}")
    return tensor.narrow(dim, start, length)


def _copy(dest: torch.Tensor, src: torch.Tensor, name: str, param: str) -> str:
    if dest.shape != src.shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(src.shape)} != expected "
                         f"{tuple(dest.shape)}")
    dest.copy_(src)
    return param


def load_moe_weight(blocks: dict[int, MoEBlock], name: str, tensor) -> str | None:
    """Hand the checkpoint tensor ``name`` (``model.layers.{i}.…``) to layer ``i``'s MoE
    block in ``blocks`` (layer index -> block); returns the model parameter written
    (``model.layers.{i}.mlp.…``), or None where it is not an MoE block's."""
    match = _LAYER.fullmatch(name)
    if not match or int(match[1]) not in blocks:
        return None
    written = blocks[int(match[1])].load_weight(match[2], tensor)
    return None if written is None else f"model.layers.{match[1]}.mlp.{written}"
