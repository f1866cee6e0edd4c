"""From ``--model`` to a local model that is known to load: resolution (hub ids to the
cache's folders) and the checks that refuse, at start-up, a model pdserve would not
compute exactly (docs/architecture.md, Models)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.engine.hub import is_local, resolve_model, resolve_tokenizer

if TYPE_CHECKING:
    from pdserve.engine.config import ModelConfig
    from pdserve.engine.engine_config import EngineConfig


def resolve_model_paths(config: EngineConfig) -> EngineConfig:
    """``config`` with its ``model`` and ``tokenizer`` as absolute local paths (hub ids
    downloaded or found in the cache: ``hub.resolve_model``), so a worker whose working
    folder differs finds them; the model keeps the name it was given (a hub id, a relative
    path) as its ``served_model_name``, as vLLM's does. ``config`` itself when nothing
    changes.

    Raises: as ``hub.resolve_model``.
    """
    changes: dict[str, str] = {}
    model = _absolute(resolve_model(config.model, revision=config.revision,
                                    download_dir=config.download_dir))
    if model != config.model:
        changes["model"] = model
        changes["served_model_name"] = config.served_model_name or config.model
    if config.tokenizer is not None:
        tokenizer = _absolute(resolve_tokenizer(config.tokenizer,
                                                download_dir=config.download_dir))
        if tokenizer != config.tokenizer:
            changes["tokenizer"] = tokenizer
    return dataclasses.replace(config, **changes) if changes else config


def _absolute(path: str) -> str:
    return str(Path(path).expanduser().absolute())


def check_model(config: EngineConfig) -> ModelConfig:
    """Check, without reading a weight, that the local model of ``config`` loads as pdserve
    computes it: its configuration (``ModelConfig.from_pretrained``), its tensors' names
    (``loader.check_model``), ``--quantization`` against how it is stored, its generation
    config and chat template. Returns its ``ModelConfig``.

    Raises:
        UnsupportedModelError: an architecture, RoPE type, ``quantization_config``, GGUF
            key or tensor outside what pdserve computes, naming it (a quantized
            checkpoint's tensors are checked by name here, by shape and ``g_idx`` at load).
        FileNotFoundError: no such model, weights or tokenizer.
        ValueError: a bad ``--generation-config``, ``--chat-template``, ``--quantization``
            or setting.
    """
    from pdserve.engine.config import ModelConfig
    from pdserve.engine.generation_config import GenerationDefaults
    from pdserve.engine.model_source import open_model
    from pdserve.engine.models.loader import check_model as check_weights
    from pdserve.engine.models.quantization import check_quantization
    from pdserve.engine.tokenizer import eos_token_ids, read_chat_template

    model_config = ModelConfig.from_pretrained(config.model, dtype=config.dtype,
                                               max_model_len=config.max_model_len)
    check_quantization(config.quantization, open_model(config.model).quant_method())
    check_weights(model_config)
    GenerationDefaults.load(config.model, config.generation_config)
    eos_token_ids(config.model, None, config.generation_config)
    read_chat_template(config.chat_template)
    if config.tokenizer is not None and not is_local(config.tokenizer):
        raise FileNotFoundError(f"--tokenizer {config.tokenizer} does not exist")
    return model_config
