"""Where a local model's parts come from: its config, tokenizer, generation config and
weights, whatever the format it is stored in (docs/architecture.md, Models).

``open_model(path)`` gives the ``ModelSource`` of a local path:

- a Hugging Face folder (``config.json`` + ``*.safetensors``, sharded or not):
  ``SafetensorsFolder``;
- a ``.gguf`` file, or a folder holding exactly one and no ``config.json``:
  ``engine.gguf_source.GGUFFile``.

A hub id is no local path: ``engine.hub.resolve_model`` downloads it first, once per node,
and hands on the snapshot's folder. Everything above the loader sees only the source's
parts: ``config_dict()`` (shaped like ``config.json``, which ``ModelConfig.from_dict``
reads), ``generation_config()`` (shaped like ``generation_config.json``), ``load_tokenizer()``
and ``iterate_weights()``, which yields transformers-named tensors in the compute dtype,
so the model code never learns where its weights came from. Each format keeps its own
weight iterator (no converted copy is written to disk); the linears a source stores
quantized (a GGUF file's quantized blocks, a quantized checkpoint's integers) come as
``QuantWeight``s, never as a float copy.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from pdserve.engine.families import UnsupportedModelError
from pdserve.engine.weight_shard import WeightShard

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from pdserve.engine.quant_config import CheckpointQuantization, WeightFormat
    from pdserve.kernels.quant_linear import QuantWeight



class ModelSource(Protocol):
    """One local model in one storage format.

    Attributes:
        path: what ``--model`` resolved to (a folder or a ``.gguf`` file); workers get
            this path, so each reopens the same source.
    """

    path: Path

    def config_dict(self) -> dict[str, Any]:
        """The model's configuration, keyed as transformers' ``config.json``."""

    def generation_config(self) -> dict[str, Any]:
        """The model's ``generation_config.json`` (``{}`` when it has none)."""

    def has_tokenizer(self) -> bool:
        """Whether the model carries a tokenizer."""

    def load_tokenizer(self, *, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
        """The model's own tokenizer, with its chat template (nothing downloaded)."""

    def weight_names(self) -> list[str]:
        """The transformers names of the tensors ``iterate_weights`` yields (no data read)."""

    def quant_method(self) -> str | None:
        """How the weights are stored quantized (``gguf``, or a checkpoint's
        ``quant_method``: ``awq``, ``gptq``, ``compressed-tensors``); None for a float one."""

    def quantized_weight_names(self) -> set[str]:
        """The names ``iterate_weights`` gives a ``QuantWeight`` for (no data read)."""

    def iterate_weights(self, dtype: torch.dtype, progress: bool = True,
                        shard: WeightShard | None = None
                        ) -> Iterator[tuple[str, torch.Tensor | QuantWeight]]:
        """``(transformers name, tensor)`` for every weight, floating tensors in ``dtype``;
        a linear stored quantized as one ``(name of its weight, QuantWeight)``. With
        ``shard`` (a tensor-parallel rank's ``LlamaForCausalLM.weight_shard``), each float
        tensor is only the rank's pieces of it, read as such where the format allows."""


def open_model(path: str | os.PathLike) -> ModelSource:
    """The ``ModelSource`` of the local model at ``path``.

    Raises:
        FileNotFoundError: ``path`` does not exist, or is a folder with neither a
            ``config.json`` nor a ``.gguf`` file (the message says what was looked for).
        UnsupportedModelError: a folder with several ``.gguf`` files and no
            ``config.json`` (which one is meant is not known), or a GGUF file pdserve
            cannot read (``engine.gguf_source``).
    """
    from pdserve.engine.gguf_source import GGUFFile

    local = Path(path)
    if local.is_file() and local.suffix == ".gguf":
        return GGUFFile(local)
    if not local.is_dir():
        raise FileNotFoundError(
            f"{local} does not exist: --model takes a Hugging Face checkpoint folder, a "
            ".gguf file, or a Hugging Face hub id (org/name)")
    if (local / "config.json").is_file():
        return SafetensorsFolder(local)
    ggufs = sorted(local.glob("*.gguf"))
    if len(ggufs) == 1:
        return GGUFFile(ggufs[0])
    if len(ggufs) > 1:
        names = ", ".join(p.name for p in ggufs)
        raise UnsupportedModelError(f"{local} holds {len(ggufs)} .gguf files ({names}) and no "
                                    "config.json: pass --model one of the files")
    raise FileNotFoundError(f"{local / 'config.json'} not found: --model must be a Hugging "
                            "Face checkpoint folder, a .gguf file or a folder holding one")


def read_json(file: Path) -> dict[str, Any]:
    """The JSON object in ``file``.

    Raises:
        ValueError: the file is not a JSON object (naming the file).
    """
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise ValueError(  # noqa: TRY004 - bad file content
            f"{file} must hold a JSON object, not {type(value).__name__}")
    return value


class SafetensorsFolder:
    """A Hugging Face checkpoint folder: ``config.json``, ``*.safetensors`` (named by
    ``model.safetensors.index.json`` when sharded), optionally ``generation_config.json``
    and the tokenizer's files. A quantized checkpoint's (``quantization_config``:
    ``engine/quant_config.py``) linears come as ``QuantWeight``s, repacked from their
    stored tensors (``engine/quant_checkpoint.py``), named ``<module>.weight``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._linears: dict[str, tuple[WeightFormat, dict[str, str]]] | None = None

    def config_dict(self) -> dict[str, Any]:
        return read_json(self.path / "config.json")

    def generation_config(self) -> dict[str, Any]:
        file = self.path / "generation_config.json"
        return read_json(file) if file.is_file() else {}

    def has_tokenizer(self) -> bool:
        from pdserve.engine.tokenizer import has_tokenizer

        return has_tokenizer(self.path)

    def load_tokenizer(self, *, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
        from pdserve.engine.tokenizer import load_tokenizer

        return load_tokenizer(self.path, trust_remote_code=trust_remote_code)

    def files(self) -> list[Path]:
        """The weight files.

        Raises:
            FileNotFoundError: no ``*.safetensors`` in the folder.
        """
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            names = sorted(set(read_json(index)["weight_map"].values()))
            files = [self.path / n for n in names]
        else:
            files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors weights in {self.path}")
        return files

    def quantization(self) -> CheckpointQuantization | None:
        """The checkpoint's ``quantization_config``, parsed; None for a float checkpoint.

        Raises:
            UnsupportedModelError: a ``quantization_config`` pdserve does not read.
        """
        from pdserve.engine.quant_config import parse_quantization_config

        return parse_quantization_config(self.config_dict().get("quantization_config"))

    def quant_method(self) -> str | None:
        quant = self.quantization()
        return None if quant is None else quant.method

    def stored_names(self) -> list[str]:
        """The names of the tensors as stored (no data read)."""
        from safetensors import safe_open

        names: list[str] = []
        for file in self.files():
            with safe_open(str(file), framework="pt") as handle:
                names.extend(handle.keys())
        return names

    def _quantized_linears(self) -> dict[str, tuple[WeightFormat, dict[str, str]]]:
        """module -> (format, its stored tensors) of the linears stored quantized."""
        if self._linears is None:
            from pdserve.engine.quant_checkpoint import quantized_linears

            quant = self.quantization()
            self._linears = {} if quant is None else quantized_linears(self.stored_names(),
                                                                       quant)
        return self._linears

    def quantized_weight_names(self) -> set[str]:
        return {f"{module}.weight" for module in self._quantized_linears()}

    def weight_names(self) -> list[str]:
        """The tensors' names, a quantized linear's tensors as its ``<module>.weight``."""
        linears = self._quantized_linears()
        packed = {name for _, stored in linears.values() for name in stored.values()}
        return [n for n in self.stored_names() if n not in packed] + \
            [f"{module}.weight" for module in linears]

    def iterate_weights(self, dtype: torch.dtype, progress: bool = True,
                        shard: WeightShard | None = None
                        ) -> Iterator[tuple[str, torch.Tensor | QuantWeight]]:
        """Each file's tensors as stored, floating ones cast to ``dtype``, with a progress
        bar counting tensors across files; a quantized linear's tensors (from whichever
        files hold them) as one ``QuantWeight``, where its first one is met. ``shard``'s
        pieces are read as slices of the memory-mapped file: a rank never reads (or
        holds) the whole of a tensor it has a share of."""
        from safetensors import safe_open
        from tqdm.auto import tqdm

        from pdserve.engine.quant_checkpoint import quant_weight

        handles = [safe_open(str(f), framework="pt") for f in self.files()]
        where = {name: handle for handle in handles for name in handle.keys()}  # noqa: SIM118
        linears = self._quantized_linears()
        module_of = {name: module for module, (_, stored) in linears.items()
                     for name in stored.values()}
        done: set[str] = set()
        with tqdm(total=len(where), desc="Loading weights", unit="tensor",
                  disable=not progress) as bar:
            for handle in handles:
                for name in handle.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                    if name not in module_of:
                        tensor = _read(handle, name, shard)
                        yield name, tensor.to(dtype) if tensor.is_floating_point() else tensor
                        bar.update(1)
                    elif module_of[name] not in done:  # NOTE: its first tensor met
                        module = module_of[name]
                        done.add(module)
                        fmt, stored = linears[module]
                        parts = {last: where[full].get_tensor(full)
                                 for last, full in stored.items()}
                        yield f"{module}.weight", quant_weight(module, fmt, parts)
                        bar.update(len(parts))


def _read(handle, name: str, shard: WeightShard | None) -> torch.Tensor:
    """Tensor ``name`` of a safetensors ``handle``, or only ``shard``'s pieces of it."""
    if shard is None:
        return handle.get_tensor(name)
    view = handle.get_slice(name)
    pieces = shard(name, tuple(view.get_shape()))
    if pieces is None:
        return handle.get_tensor(name)
    parts = []
    for dim, start, length in pieces:
        index = [slice(None)] * len(view.get_shape())
        index[dim] = slice(start, start + length)
        parts.append(view[tuple(index)])
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=pieces[0][0])
