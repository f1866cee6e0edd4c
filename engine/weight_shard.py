"""A tensor-parallel rank's share of a weight, as the checkpoint readers take it
(``engine/model_source.py``, ``engine/gguf_source.py``; which share: ``engine/parallel.py``
and ``LlamaForCausalLM.weight_shard``)."""

from __future__ import annotations

from collections.abc import Callable

import torch

# (name, shape) -> pieces (dim, start, length) of a tensor-parallel rank's share, or None
WeightShard = Callable[[str, tuple[int, ...]], "list[tuple[int, int, int]] | None"]


def take_shard(tensor: torch.Tensor, pieces: list[tuple[int, int, int]] | None
               ) -> torch.Tensor:
    """The pieces ``(dim, start, length)`` of ``tensor`` (``LlamaForCausalLM.weight_shard``)
    concatenated along their dimension; ``tensor`` itself for None."""
    if pieces is None:
        return tensor
    parts = [tensor.narrow(dim, start, length) for dim, start, length in pieces]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=pieces[0][0])
