"""The model's own sampling defaults: its ``generation_config.json``, read as vLLM's
``--generation-config`` says.

``--generation-config auto`` (the default) reads the model's file, ``vllm`` reads none
(vLLM's own defaults), and a folder reads ``FOLDER/generation_config.json``. Of the file,
``temperature``, ``top_p``, ``top_k``, ``min_p`` and ``repetition_penalty`` become the
defaults of every request that leaves them unset (``GenerationDefaults.sampling_kwargs``:
the router applies them, over HTTP and gRPC alike), and its ``eos_token_id`` (an int or a
list) ends generation (``tokenizer.eos_token_ids``, on the workers).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from pdserve.engine.sampling_params import SamplingParams

GENERATION_CONFIG_MODES = ("auto", "vllm")  # or a folder
SAMPLING_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_config_file(model_path: str | os.PathLike, mode: str = "auto") -> Path | None:
    """The ``generation_config.json`` that ``--generation-config mode`` names for the local
    model ``model_path``: the model folder's for ``auto`` (None for a GGUF file, which has
    none), none for ``vllm``, ``mode/generation_config.json`` for a folder. The file may
    not exist for ``auto``.

    Raises:
        ValueError: ``mode`` is neither ``auto``, ``vllm`` nor a folder holding a
            ``generation_config.json`` (naming ``--generation-config``).
    """
    if mode == "vllm":
        return None
    if mode == "auto":
        path = Path(model_path)
        return path / "generation_config.json" if path.is_dir() else None
    file = Path(mode) / "generation_config.json"
    if not file.is_file():
        raise ValueError(f"--generation-config {mode!r}: no generation_config.json there; "
                         "use auto, vllm or a folder holding one")
    return file


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """Sampling defaults from a ``generation_config.json``; None: the field is not set
    there, and SamplingParams' own default (vLLM's) applies."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    @classmethod
    def load(cls, model_path: str | os.PathLike, mode: str = "auto") -> GenerationDefaults:
        """The defaults ``--generation-config mode`` gives the local model ``model_path``.

        Raises:
            ValueError: a bad ``mode`` (``generation_config_file``), a file that is not a
                JSON object, or a value SamplingParams refuses (naming the file and field).
        """
        file = generation_config_file(model_path, mode)
        if file is None or not file.is_file():
            return cls()
        try:
            raw = json.loads(file.read_text(encoding="utf-8"))
        except ValueError as e:
            raise ValueError(f"{file} is not valid JSON: {e}") from e
        if not isinstance(raw, dict):
            raise ValueError(f"{file} must hold a JSON object")  # noqa: TRY004
        return cls.from_dict(raw, str(file))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "generation_config") -> GenerationDefaults:
        """The sampling fields of ``raw`` (others are ignored).

        Raises:
            ValueError: a field SamplingParams refuses, e.g. ``top_p=0``, naming ``where``.
        """
        values = {name: raw[name] for name in SAMPLING_DEFAULT_FIELDS if raw.get(name) is not None}
        for name, value in values.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{where}: {name}={value!r} must be a number")  # noqa: TRY004
        try:
            SamplingParams(**values)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from e
        if "top_k" in values:
            values["top_k"] = int(values["top_k"])
        return cls(**values)

    def as_dict(self) -> dict[str, float | int]:
        """The fields that are set."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) is not None}

    def sampling_kwargs(self, **given: float | None) -> dict[str, float | int]:
        """SamplingParams keyword arguments for the fields of ``SAMPLING_DEFAULT_FIELDS``:
        a request's own value (``given``, None when it left the field unset), else this
        default; a field set by neither is left out (SamplingParams' default applies)."""
        out = self.as_dict()
        out.update({name: value for name, value in given.items() if value is not None})
        return out
