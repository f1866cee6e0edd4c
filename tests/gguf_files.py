"""Tiny llama GGUF files, written as llama.cpp's converter writes them, for tests.

``write_tiny_gguf`` takes a random transformers ``LlamaForCausalLM``, renames its tensors
to GGUF's names, permutes the q and k rows as llama.cpp does, and stores each 2-D weight
in the type asked for: F32, F16, BF16, Q8_0, Q4_0 and Q4_1 are quantized from the weights
with ``gguf.quants.quantize``; Q4_K, Q5_K and Q6_K (which gguf cannot quantize) are random
blocks with small scales. Norms stay F32, as in llama.cpp's files.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

# the gguf-py byte offsets of the float16 scales in one 256-value K block, and its size
K_BLOCKS = {"Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)), "Q6_K": (210, (208,))}
HF_TO_GGUF = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
TINY_GGUF = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 320,
             "max_position_embeddings": 512, "rope_theta": 10000.0, "rms_norm_eps": 1e-5}


def gguf_name(hf_name: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight",
             "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{HF_TO_GGUF[rest.removesuffix('.weight')]}.weight"


def permute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's ``convert_hf_to_gguf.LlamaModel.permute``."""
    return (weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def random_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Valid random GGUF blocks of ``kind`` (a kept quantized type) for a ``[rows, cols]``
    tensor (finite fp16 scales)."""
    import gguf

    if kind in ("Q8_0", "Q4_0", "Q4_1"):
        return gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32),
                                    gguf.GGMLQuantizationType[kind])
    return random_k_blocks(kind, rows, cols, rng)


def random_k_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """``[rows, cols // 256 * block bytes]`` uint8 of random K blocks whose float16 scales
    are small (so the weights stay O(0.1))."""
    size, scale_offsets = K_BLOCKS[kind]
    blocks = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(2e-3 if kind != "Q6_K" else 5e-4).tobytes(), np.uint8)
    for offset in scale_offsets:
        blocks[..., offset:offset + 2] = scale
    return blocks.reshape(rows, -1)


def write_tiny_gguf(path: Path, qtype="F32", *, seed: int = 0, tied: bool = False,
                    arch: str = "llama", metadata: dict | None = None,
                    extra_tensors: dict[str, np.ndarray] | None = None, **config) -> Path:
    """A tiny random llama written to ``path`` with every 2-D weight in ``qtype`` (a type
    name, or a function of the GGUF tensor name giving one).

    ``metadata`` adds ``{key: value}`` (ints as uint32, floats as float32, str as
    string); ``extra_tensors`` adds F32 tensors under GGUF names; ``config`` overrides
    ``TINY_GGUF``. Returns ``path``.
    """
    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = {**TINY_GGUF, **config}
    torch.manual_seed(seed)
    hf_model = LlamaForCausalLM(LlamaConfig(**cfg, tie_word_embeddings=tied)).eval()
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(path), arch)
    _write_metadata(writer, cfg, metadata or {})
    rng = np.random.default_rng(seed)
    for name, tensor in hf_model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        weight = tensor.float().numpy()
        if ".q_proj." in name:
            weight = permute_rows(weight, heads)
        elif ".k_proj." in name:
            weight = permute_rows(weight, kv_heads)
        kind = qtype(gguf_name(name)) if callable(qtype) else qtype
        _add_tensor(writer, gguf_name(name), weight, kind, rng)
    for name, weight in (extra_tensors or {}).items():
        writer.add_tensor(name, weight.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_metadata(writer, cfg: dict, metadata: dict) -> None:
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_rope_freq_base(cfg["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_dimension_count(cfg["hidden_size"] // cfg["num_attention_heads"])
    writer.add_vocab_size(cfg["vocab_size"])
    for key, value in metadata.items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)


def _add_tensor(writer, name: str, weight: np.ndarray, qtype: str, rng) -> None:
    import gguf

    kind = gguf.GGMLQuantizationType[qtype]
    if weight.ndim == 1 or qtype == "F32":
        writer.add_tensor(name, weight)
    elif qtype == "F16":
        writer.add_tensor(name, weight.astype(np.float16))
    elif qtype in K_BLOCKS:
        writer.add_tensor(name, random_k_blocks(qtype, *weight.shape, rng), raw_dtype=kind)
    else:
        writer.add_tensor(name, gguf.quants.quantize(weight, kind), raw_dtype=kind)
