"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019, https://arxiv.org/abs/1909.08053):
which share of each weight a rank holds, and the collectives between a worker's ranks.

A worker at ``--tensor-parallel-size N`` is one scheduler and N rank processes
(``engine/tp_executor.py``). Each rank holds:

- ``qkv_proj`` (column-parallel): its ``num_heads / N`` query heads and its KV heads:
  ``num_kv_heads / N`` of them, or, with fewer KV heads than ranks, the one its query
  heads read (replicated on ``N / num_kv_heads`` ranks);
- ``o_proj`` (row-parallel): the input columns of its query heads; its output is a
  partial sum, all-reduced (the attention block's one collective);
- ``gate_up_proj`` (column-parallel) and ``down_proj`` (row-parallel): ``1 / N`` of the
  intermediate size, all-reduced after ``down_proj`` (the MLP block's one collective);
- the embedding and the LM head (vocab-parallel): ``ceil(vocab / N)`` rows each, the last
  padded; a token's embedding row is on one rank (the others add zeros, so the all-reduce
  is exact) and rank 0 gathers the logits;
- a mixture-of-experts block (``engine/models/moe.py``): every expert's ``1 / N`` of
  the expert intermediate size (and of the shared expert's), the router whole,
  all-reduced once after the block;
- norms and everything else whole.

A rank's KV cache holds its own KV heads only (``TensorParallel.local_config``), so the
same number of blocks costs each rank ``1 / N`` of the memory (or more, replicated).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pdserve.engine.config import ModelConfig, UnsupportedModelError


class RankFailedError(RuntimeError):
    """A rank of this worker's tensor-parallel group died or stopped answering (a
    collective failed or timed out, or the rank's process exited): the worker cannot
    compute another step."""


@dataclass(slots=True)
class TensorParallel:
    """This process's place in its worker's tensor-parallel group.

    ``rank`` in ``[0, size)``; ``group`` the worker's ranks' process group
    (``ProcessGroupGloo`` on CPU, ``ProcessGroupNCCL`` on CUDA, made by
    ``tp_executor.make_group`` and used directly, outside ``torch.distributed``'s default
    group, which KV transfer's pair groups leave alone too), None at ``size`` 1, where
    every collective is the identity. Every collective on ``group`` has the group's
    timeout: a dead rank fails the step, it never hangs it.
    """

    rank: int = 0
    size: int = 1
    group: Any = None

    def shard(self, total: int) -> tuple[int, int]:
        """``(start, length)`` of this rank's share of a dimension of ``total`` split evenly.

        Raises:
            ValueError: ``total`` not divisible by ``size``.
        """
        if total % self.size:
            raise ValueError(f"{total} does not split over tensor_parallel_size={self.size}")
        length = total // self.size
        return self.rank * length, length

    def kv_head_shard(self, num_kv_heads: int) -> tuple[int, int]:
        """``(first KV head, count)`` this rank holds: ``num_kv_heads / size`` of them, or
        with fewer KV heads than ranks, the single head its query heads read."""
        if num_kv_heads >= self.size:
            return self.shard(num_kv_heads)
        return self.rank * num_kv_heads // self.size, 1

    def vocab_shard(self, vocab_size: int) -> tuple[int, int]:
        """``(first row, rows)`` of the vocab-parallel embedding and LM head this rank
        holds: ``ceil(vocab_size / size)`` rows each (the last rank's run may pass
        ``vocab_size``: its rows there are zero padding, never loaded or sampled)."""
        rows = -(-vocab_size // self.size)
        return self.rank * rows, rows

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """``config`` with this rank's head counts and intermediate size: what its model
        shard and its KV cache are built from (``hidden_size``, ``head_dim`` and the
        vocabulary stay whole; the attention scale is kept explicit).

        Raises:
            UnsupportedModelError: a size the model's heads or MLP do not split into,
                naming the field and its value.
        """
        if self.size == 1:
            return config
        check_tensor_parallel(config, self.size)
        return dataclasses.replace(
            config, num_heads=config.num_heads // self.size,
            num_kv_heads=self.kv_head_shard(config.num_kv_heads)[1],
            intermediate_size=config.intermediate_size // self.size,
            attn_scale=config.softmax_scale)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group in place and return it (identity at size 1).

        Raises:
            RankFailedError: a rank died or the group's timeout passed.
        """
        if self.size > 1:
            _wait(self.group.allreduce([x]), "all-reduce")
        return x

    def gather_to_first(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's ``x: [N, C]`` along its last dimension on rank 0
        (``[N, size * C]``); other ranks get None. Identity at size 1.

        Raises:
            RankFailedError: a rank died or the group's timeout passed.
        """
        if self.size == 1:
            return x
        x = x.contiguous()
        opts = dist.GatherOptions()
        opts.rootRank = 0
        if self.rank == 0:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            _wait(self.group.gather([parts], [x], opts), "gather")
            return torch.cat(parts, dim=-1)
        _wait(self.group.gather([], [x], opts), "gather")
        return None


def _wait(work, what: str) -> None:
    try:
        work.wait()
    except RuntimeError as exc:  # NOTE: gloo's connection reset, or its timeout
        raise RankFailedError(f"tensor-parallel {what} failed: {exc}") from exc


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """Refuse a tensor-parallel size ``config``'s model cannot be split into.

    Raises:
        UnsupportedModelError: ``num_attention_heads``, ``num_key_value_heads`` or
            ``intermediate_size`` not divisible by ``size`` (KV heads may also divide
            ``size``: then they are replicated), naming the field.
    """
    if size < 1:
        raise ValueError(f"tensor_parallel_size={size} must be >= 1")
    heads, kv_heads = config.num_heads, config.num_kv_heads
    problems = []
    if heads % size:
        problems.append(f"num_attention_heads={heads}")
    if kv_heads % size and size % kv_heads:
        problems.append(f"num_key_value_heads={kv_heads} (nor does it divide it)")
    if config.intermediate_size % size:
        problems.append(f"intermediate_size={config.intermediate_size}")
    # MoE: each rank holds every expert's (and the shared expert's) 1 / size columns
    if config.moe_intermediate_size % size:
        problems.append(f"moe_intermediate_size={config.moe_intermediate_size}")
    if config.shared_expert_intermediate_size % size:
        problems.append(f"shared_expert_intermediate_size="
                        f"{config.shared_expert_intermediate_size}")
    if problems:
        raise UnsupportedModelError(
            f"tensor_parallel_size={size} does not divide {', '.join(problems)} of "
            f"{config.architecture}")
