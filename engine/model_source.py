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
weight iterator (no converted copy is written to disk), so a later format-aware path can
read GGUF blocks as they are stored.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

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

    def iterate_weights(self, dtype: torch.dtype, progress: bool = True
                        ) -> Iterator[tuple[str, torch.Tensor]]:
        """``(transformers name, tensor)`` for every weight, floating tensors in ``dtype``."""


def open_model(path: str | os.PathLike) -> ModelSource:
    """The ``ModelSource`` of the local model at ``path``.

    Raises:
        FileNotFoundError: ``path`` does not exist, or is a folder with neither a
            ``config.json`` nor a ``.gguf`` file (the message says what was looked for).
        UnsupportedModelError: a folder with several ``.gguf`` files and no
            ``config.json`` (which one is meant is not known), or a GGUF file pdserve
            cannot read (``engine.gguf_source``).
    """
    from pdserve.engine.config import UnsupportedModelError
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
    and the tokenizer's files."""

    def __init__(self, path: Path) -> None:
        self.path = path

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

    def weight_names(self) -> list[str]:
        from safetensors import safe_open

        names: list[str] = []
        for file in self.files():
            with safe_open(str(file), framework="pt") as handle:
                names.extend(handle.keys())
        return names

    def iterate_weights(self, dtype: torch.dtype, progress: bool = True
                        ) -> Iterator[tuple[str, torch.Tensor]]:
        """Each file's tensors as stored, floating ones cast to ``dtype``, with a progress
        bar counting tensors across files."""
        from safetensors import safe_open
        from tqdm.auto import tqdm

        handles = [safe_open(str(f), framework="pt") for f in self.files()]
        total = sum(len(h.keys()) for h in handles)
        with tqdm(total=total, desc="Loading weights", unit="tensor",
                  disable=not progress) as bar:
            for handle in handles:
                for name in handle.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                    tensor = handle.get_tensor(name)
                    yield name, tensor.to(dtype) if tensor.is_floating_point() else tensor
                    bar.update(1)
