"""Load a local model's weights into pdserve's model, from whatever source stores them.

The source (``engine/model_source.py``: safetensors, GGUF) yields transformers-named
tensors in the compute dtype, and ``QuantWeight``s for the linears it stores quantized;
the model maps them onto its fused parameters (``LlamaForCausalLM.load_weights``) and
never learns where they came from.
"""

from __future__ import annotations

import torch

from pdserve.engine.config import ModelConfig, UnsupportedModelError
from pdserve.engine.model_source import ModelSource, open_model
from pdserve.engine.models.cpu_decode import CpuDecodeLayers
from pdserve.engine.models.layers import RotaryEmbedding, pack_linears_for_cpu
from pdserve.engine.models.llama import LlamaForCausalLM
from pdserve.engine.models.moe import MoEBlock
from pdserve.engine.models.quantization import (
    RTN_SCHEMES,
    drop_quantized_weights,
    quantize_linears,
)
from pdserve.engine.parallel import TensorParallel

_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def expected_checkpoint_names(model: LlamaForCausalLM, fused_experts: bool = False
                              ) -> set[str]:
    """The transformers parameter names a complete checkpoint provides for ``model``
    (its fused projections split, but where the family stores them fused: Phi-3; an MoE
    block's router and experts as ``MoEBlock.checkpoint_names`` says, per expert or, with
    ``fused_experts``, stacked as transformers 5 holds them)."""
    names = set()
    moe = {f"{n}.": m for n, m in model.named_modules() if isinstance(m, MoEBlock)}
    for prefix, block in moe.items():
        layer = prefix[:-len("mlp.")]
        names.update(layer + n for n in block.checkpoint_names(fused_experts))
    for name, _ in model.named_parameters():
        if moe and any(name.startswith(prefix) for prefix in moe):
            continue
        fused = next((f for f in _FUSED if f".{f}." in name), None)
        if fused is None or model.config.fused_checkpoint:
            names.add(name)
        else:
            names.update(name.replace(fused, shard) for shard in _FUSED[fused])
    return names


def check_weight_names(source: ModelSource, model: LlamaForCausalLM) -> None:
    """Compare the source's tensor names with those ``model`` needs, before any is read.

    Raises:
        UnsupportedModelError: a tensor the model has no place for (naming it).
        ValueError: tensors the model needs that the source lacks.
    """
    names = set(source.weight_names())
    fused_experts = any(n.endswith(".experts.gate_up_proj") for n in names)
    expected = expected_checkpoint_names(model, fused_experts)
    if model.config.tie_word_embeddings:  # NOTE: a tied checkpoint may still store lm_head
        expected.discard("lm_head.weight")
        names.discard("lm_head.weight")
    extra = sorted(n for n in names - expected if "rotary_emb" not in n)
    if extra:
        raise UnsupportedModelError(
            f"tensor {extra[0]!r} of {source.path} has no place in {model.config.architecture} "
            f"as pdserve computes it ({len(extra)} such tensors)")
    missing = expected - names
    if missing:
        raise ValueError(f"checkpoint {source.path} lacks tensors: {sorted(missing)[:8]}")


def check_model(config: ModelConfig) -> None:
    """Check that the weights at ``config.model`` fit pdserve's model of ``config``, by
    their names alone (no tensor is read; the model is built on the meta device).

    Raises: as ``check_weight_names``.
    """
    check_moe_quantization(config)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    check_weight_names(open_model(config.model), model)


def check_moe_quantization(config: ModelConfig) -> None:
    """Refuse a mixture-of-experts model with weight quantization (``--quantization``, a
    quantized checkpoint): its experts run in bf16/fp16/fp32 only.

    Raises:
        UnsupportedModelError: naming ``quantization``.
    """
    if config.num_experts and config.quantization:
        raise UnsupportedModelError(
            f"quantization={config.quantization!r} is not supported for "
            f"{config.architecture}: pdserve runs mixture-of-experts weights unquantized")


def load_model(config: ModelConfig, device: torch.device, progress: bool = True,
               source: ModelSource | None = None, tp: TensorParallel | None = None
               ) -> LlamaForCausalLM:
    """Build the model on ``device`` in ``config.dtype`` and load its weights from
    ``source`` (default: ``model_source.open_model(config.model)``); under tensor
    parallelism, only rank ``tp.rank``'s share of them (``engine/parallel.py``), read
    as slices of the checkpoint.

    Raises:
        FileNotFoundError: no weights.
        UnsupportedModelError: a tensor the model has no place for; quantized weights
            under tensor parallelism.
        ValueError: tensors missing from the checkpoint, or of the wrong shape.
    """
    check_moe_quantization(config)
    source = source or open_model(config.model)
    tp = tp or TensorParallel()
    with torch.device("meta"):
        model = LlamaForCausalLM(config, tp)
    check_weight_names(source, model)
    quantized = quantized_targets(source)
    if tp.size > 1 and (quantized or config.quantization):
        raise UnsupportedModelError(
            f"tensor_parallel_size={tp.size} with quantized weights "
            f"({config.quantization or source.quant_method()}) is not supported yet: "
            "serve a float checkpoint, or tensor_parallel_size=1")
    drop_quantized_weights(model, quantized)
    # NOTE: cast on meta first, so the device never holds an fp32 copy of the weights
    model = model.to(config.dtype).to_empty(device=device)
    if config.tie_word_embeddings and "lm_head.weight" not in quantized:
        model.lm_head.weight = model.model.embed_tokens.weight
    # The RoPE tables are fp32 buffers computed at init, lost by the meta build: remake them.
    model.rotary_emb = RotaryEmbedding(config).to(device)
    if model.local_rotary_emb is not None:
        model.local_rotary_emb = RotaryEmbedding(config, config.local_rope_parameters).to(device)
    with torch.no_grad():
        shard = model.weight_shard if tp.size > 1 else None
        model.load_weights(source.iterate_weights(config.dtype, progress, shard))
        if config.quantization in RTN_SCHEMES:
            quantize_linears(model, config.quantization, device)
    if device.type == "cpu":
        pack_linears_for_cpu(model)
        model.cpu_decode = CpuDecodeLayers.build(model)
    return model.eval()


def quantized_targets(source: ModelSource) -> set[str]:
    """The model's linears (``"<module path>.weight"``, fused names) that ``source`` gives
    quantized weights for, at least for one shard (a GGUF file's: ``engine/gguf_quant.py``;
    a quantized checkpoint's: ``engine/quant_checkpoint.py``)."""
    names = source.quantized_weight_names()
    targets = set()
    for name in names:
        for fused, parts in _FUSED.items():
            for part in parts:
                name = name.replace(f".{part}.", f".{fused}.")
        targets.add(name)
    return targets
