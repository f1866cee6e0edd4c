"""Load a local Hugging Face checkpoint (``*.safetensors``, sharded or not) into a model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from pdserve.engine.config import ModelConfig
from pdserve.engine.models.layers import pack_linears_for_cpu
from pdserve.engine.models.llama import LlamaForCausalLM

_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def safetensors_files(model_dir: Path) -> list[Path]:
    """The checkpoint's weight files: those named by ``model.safetensors.index.json`` if it
    exists, else every ``*.safetensors`` in the folder.

    Raises:
        FileNotFoundError: no safetensors weights in ``model_dir``.
    """
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / n for n in names]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return files


def iterate_weights(files: list[Path], dtype: torch.dtype, progress: bool = True
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` cast to ``dtype`` (floating tensors only), with a progress bar
    counting tensors across all files."""
    handles = [safe_open(str(f), framework="pt") for f in files]
    total = sum(len(h.keys()) for h in handles)
    with tqdm(total=total, desc="Loading weights", unit="tensor", disable=not progress) as bar:
        for handle in handles:
            for name in handle.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                tensor = handle.get_tensor(name)
                yield name, tensor.to(dtype) if tensor.is_floating_point() else tensor
                bar.update(1)


def expected_checkpoint_names(model: LlamaForCausalLM) -> set[str]:
    """The transformers parameter names a complete checkpoint provides for ``model``."""
    names = set()
    for name, _ in model.named_parameters():
        fused = next((f for f in _FUSED if f".{f}." in name), None)
        if fused is None:
            names.add(name)
        else:
            names.update(name.replace(fused, shard) for shard in _FUSED[fused])
    return names


def load_model(config: ModelConfig, device: torch.device, progress: bool = True
               ) -> LlamaForCausalLM:
    """Build the model on ``device`` in ``config.dtype`` and load its weights.

    Raises:
        FileNotFoundError: no weights.
        ValueError: tensors missing from the checkpoint, or of the wrong shape.
        KeyError: a checkpoint tensor the model has no place for.
    """
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    # NOTE: cast on meta first, so the device never holds an fp32 copy of the weights
    model = model.to(config.dtype).to_empty(device=device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    # The RoPE tables are fp32 buffers computed at init, lost by the meta build: remake them.
    model.rotary_emb = type(model.rotary_emb)(config).to(device)
    expected = expected_checkpoint_names(model)
    seen: set[str] = set()

    def tracked():
        for name, tensor in iterate_weights(safetensors_files(Path(config.model)), config.dtype,
                                            progress):
            seen.add(name)
            yield name, tensor

    with torch.no_grad():
        model.load_weights(tracked())
    missing = expected - seen
    if missing:
        raise ValueError(f"checkpoint {config.model} lacks tensors: {sorted(missing)[:8]}")
    if device.type == "cpu":
        pack_linears_for_cpu(model)
    return model.eval()
