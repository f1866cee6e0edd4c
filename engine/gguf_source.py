"""A model in one GGUF file (llama.cpp's format), read with the ``gguf`` package.

The file holds everything: the configuration and the tokenizer (with its chat template)
as metadata, and the weights as tensors, each stored as F32, F16, BF16 or in llama.cpp's
blocks (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K). pdserve reads it as transformers'
GGUF loader does (``transformers/modeling_gguf_pytorch_utils.py``,
``integrations/ggml.py``), so the same file gives the same model in both:

- config: ``llama.*`` keys mapped to ``config.json``'s names (``GGUF_LLAMA_CONFIG``);
  embeddings are tied when the file has no ``output.weight``;
- tokenizer: transformers builds it from the metadata
  (``AutoTokenizer.from_pretrained(folder, gguf_file=name)``);
- weights: a linear layer's Q8_0, Q4_0, Q4_1, Q4_K, Q5_K or Q6_K blocks stay quantized
  (``engine/gguf_quant.py``: repacked without loss into pdserve's int8 / int4 formats,
  computed by the quantized linear kernels); every other tensor (F32, F16, BF16, norms,
  the embedding table) is dequantized with ``gguf.dequantize`` to float32, then cast to
  the compute dtype. llama.cpp's converter permutes the rows of ``attn_q`` and ``attn_k``
  (its rotary embedding pairs neighbouring dims, transformers' pairs the two halves of a
  head); ``unpermute_rows`` undoes it, for quantized rows too.

Only the ``llama`` architecture is read for now, and only what pdserve computes exactly
as transformers does: anything else is refused when the file is opened, naming the
metadata key or tensor (``UnsupportedModelError``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pdserve.engine.families import UnsupportedModelError
from pdserve.engine.gguf_quant import KEPT_TYPES, permute_rows, quant_weight
from pdserve.engine.weight_shard import WeightShard, take_shard
from pdserve.kernels.quant_linear import QuantWeight

if TYPE_CHECKING:
    from gguf import GGUFReader, ReaderTensor
    from transformers import PreTrainedTokenizerBase


# GGUF key (after "llama.") -> config.json key, as transformers maps them
GGUF_LLAMA_CONFIG = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "rope.dimension_count": "head_dim",
    "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
_REQUIRED = ("context_length", "block_count", "feed_forward_length", "embedding_length",
             "attention.head_count")
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")

_GLOBAL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight",
                   "output_norm.weight": "model.norm.weight",
                   "output.weight": "lm_head.weight"}
_LAYER_TENSORS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                  "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                  "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                  "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                  "ffn_down": "mlp.down_proj"}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


def hf_tensor_name(gguf_name: str) -> str | None:
    """transformers' name of the GGUF tensor ``gguf_name`` (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``), or None when a llama has no such tensor."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_TENSORS:
        return None
    return f"model.layers.{match.group(1)}.{_LAYER_TENSORS[match.group(2)]}.weight"


def unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's row order of a q or k projection (``num_heads``: its heads, the KV
    heads for k): within each head, llama.cpp stores the rows as pairs (dim i of the first
    half, dim i of the second half) for its neighbour-pair rotary embedding.

    ``weight``: ``[num_heads * head_dim, hidden]``; returns the same shape, the rows of
    each head back in transformers' order (first half, then second half). Worked example,
    one head of dim 4: stored rows ``[r0, r2, r1, r3]`` -> ``[r0, r1, r2, r3]``.
    """
    head_dim = weight.shape[0] // num_heads
    rows = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return rows.transpose(1, 2).reshape(weight.shape)


class GGUFFile:
    """A llama model in one ``.gguf`` file (see the module docstring).

    Raises (on construction):
        FileNotFoundError: no such file.
        UnsupportedModelError: another architecture, RoPE scaling, experts, per-layer
            KV head counts, a tensor of another type or with no place in a llama; the
            message names the metadata key or tensor.
        ImportError: the ``gguf`` package is missing.
    """

    def __init__(self, path: Path) -> None:
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist")
        from gguf import GGUFReader

        self.path = path
        self.reader: GGUFReader = GGUFReader(str(path))
        self._config = self._read_config()
        self._check_tensors()

    def _field(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def _read_config(self) -> dict[str, Any]:
        arch = self._field("general.architecture")
        if arch != "llama":
            raise UnsupportedModelError(
                f"general.architecture={arch!r} in {self.path.name} is not supported: pdserve "
                "reads GGUF files of the 'llama' architecture only")
        missing = [f"llama.{key}" for key in _REQUIRED if f"llama.{key}" not in self.reader.fields]
        if missing:
            raise UnsupportedModelError(f"{self.path.name} lacks the metadata key {missing[0]}")
        self._refuse_unsupported_metadata()
        # NOTE: a GGUF file has no dtype of its own (its linears are quantized blocks, its
        # norms F32 by llama.cpp's convention), so it names the one `--dtype auto` computes
        # in: bfloat16, as vLLM takes half precision for a float32 config (and on an x86
        # CPU without AVX-512, cpu_compute_dtype makes that float32 again). transformers
        # computes a GGUF file in float32: `--dtype float32` gives its numbers.
        config: dict[str, Any] = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                  "hidden_act": "silu", "dtype": "bfloat16"}
        for key, name in GGUF_LLAMA_CONFIG.items():
            value = self._field(f"llama.{key}")
            if value is not None:
                config[name] = value
        if "vocab_size" not in config:
            config["vocab_size"] = len(self._field("tokenizer.ggml.tokens") or [])
        names = {t.name for t in self.reader.tensors}
        config["tie_word_embeddings"] = "output.weight" not in names
        for key in ("bos", "eos", "pad"):
            token_id = self._field(f"tokenizer.ggml.{key}_token_id")
            if token_id is not None:
                config[f"{key}_token_id"] = int(token_id)
        return config

    def _refuse_unsupported_metadata(self) -> None:
        scaling = self._field("llama.rope.scaling.type")
        if scaling not in (None, "none"):
            raise UnsupportedModelError(
                f"llama.rope.scaling.type={scaling!r} in {self.path.name} is not supported "
                "from GGUF: pdserve reads unscaled RoPE only")
        experts = self._field("llama.expert_count")
        if experts:
            raise UnsupportedModelError(f"llama.expert_count={experts} in {self.path.name}: "
                                        "mixture-of-experts GGUF files are not supported "
                                        "(pdserve runs MoE safetensors checkpoints)")
        kv_heads = self._field("llama.attention.head_count_kv")
        if isinstance(kv_heads, list):
            raise UnsupportedModelError(
                f"llama.attention.head_count_kv in {self.path.name} is a per-layer list; "
                "pdserve supports one KV head count for every layer")

    def _check_tensors(self) -> None:
        for tensor in self.reader.tensors:
            kind = tensor.tensor_type.name
            if hf_tensor_name(tensor.name) is None:
                raise UnsupportedModelError(
                    f"tensor {tensor.name!r} in {self.path.name} has no place in a llama "
                    "model pdserve computes (e.g. rope_freqs.weight: llama3 RoPE scaling)")
            if kind not in SUPPORTED_TENSOR_TYPES:
                raise UnsupportedModelError(
                    f"tensor {tensor.name!r} in {self.path.name} is of type {kind}; pdserve "
                    f"dequantizes {', '.join(SUPPORTED_TENSOR_TYPES)}")

    def config_dict(self) -> dict[str, Any]:
        return dict(self._config)

    def generation_config(self) -> dict[str, Any]:
        return {}  # NOTE: GGUF has no sampling defaults; the EOS id comes with the tokenizer

    def has_tokenizer(self) -> bool:
        return "tokenizer.ggml.tokens" in self.reader.fields

    def load_tokenizer(self, *, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
        """transformers' tokenizer of the file's metadata, its chat template included.

        Raises:
            ValueError: the file carries no tokenizer.
        """
        from pdserve.engine.tokenizer import load_tokenizer

        if not self.has_tokenizer():
            raise ValueError(f"{self.path.name} carries no tokenizer (tokenizer.ggml.tokens); "
                             "pass --tokenizer")
        return load_tokenizer(self.path)

    def weight_names(self) -> list[str]:
        return [hf_tensor_name(t.name) for t in self.reader.tensors]

    def dequantize(self, tensor: ReaderTensor) -> torch.Tensor:
        """One tensor as transformers' float32 weight: ``[out_features, in_features]``
        (GGUF lists dims innermost first), q and k rows in transformers' order."""
        from gguf import dequantize

        shape = tuple(int(d) for d in reversed(tensor.shape))
        array = dequantize(tensor.data, tensor.tensor_type)
        if not array.flags.writeable:  # NOTE: F32 comes back as a view of the mapped file
            array = array.copy()
        weight = torch.from_numpy(array).reshape(shape)
        if ".attn_q." in tensor.name:
            return unpermute_rows(weight, self._config["num_attention_heads"])
        if ".attn_k." in tensor.name:
            heads = self._config.get("num_key_value_heads", self._config["num_attention_heads"])
            return unpermute_rows(weight, heads)
        return weight

    def _kept_quantized(self, tensor: ReaderTensor) -> bool:
        """Whether ``tensor`` reaches the model quantized: a linear layer's weight (the
        embedding table too where it doubles as the tied LM head) in a quantized type
        (``engine/gguf_quant.py``); everything else is dequantized."""
        if tensor.tensor_type.name not in KEPT_TYPES:
            return False
        return tensor.name != "token_embd.weight" or self._config["tie_word_embeddings"]

    def quant_method(self) -> str:
        """``gguf``: the file's quantized tensors stay quantized (``quantized_weight_names``)."""
        return "gguf"

    def quantized_weight_names(self) -> set[str]:
        """transformers' names of the weights this file gives quantized: its quantized
        linears, a quantized embedding table (``model.embed_tokens.weight``), and
        ``lm_head.weight`` where the LM head shares that table."""
        names = set()
        for tensor in self.reader.tensors:
            name = hf_tensor_name(tensor.name)
            if name == "model.embed_tokens.weight" and tensor.tensor_type.name in KEPT_TYPES:
                names.add(name)
            if self._kept_quantized(tensor):
                names.add("lm_head.weight" if name == "model.embed_tokens.weight" else name)
        return names

    def quant_weight(self, tensor: ReaderTensor) -> QuantWeight:
        """A quantized tensor's blocks as a ``QuantWeight`` (no loss), q and k rows in
        transformers' order."""
        n, k = (int(d) for d in reversed(tensor.shape))
        weight = quant_weight(tensor.data, tensor.tensor_type.name, n, k)
        if ".attn_q." in tensor.name:
            heads = self._config["num_attention_heads"]
        elif ".attn_k." in tensor.name:
            heads = self._config.get("num_key_value_heads", self._config["num_attention_heads"])
        else:
            return weight
        return permute_rows(weight, lambda rows: unpermute_rows(rows, heads))

    def iterate_weights(self, dtype: torch.dtype, progress: bool = True,
                        shard: WeightShard | None = None
                        ) -> Iterator[tuple[str, torch.Tensor | QuantWeight]]:
        """Every tensor, one at a time: a linear's quantized blocks as a ``QuantWeight``
        (``quantized_weight_names``), the others dequantized (float32) and cast to
        ``dtype``. A quantized embedding table comes as a ``QuantWeight`` (the model looks
        rows up quantized: ``QuantizedEmbedding``), and again as the LM head's where that
        shares it. ``shard``: a tensor-parallel rank's pieces of each float tensor
        (``ModelSource``; the loader refuses quantized weights under tensor
        parallelism)."""
        from tqdm.auto import tqdm

        for tensor in tqdm(self.reader.tensors, desc="Reading GGUF weights",
                           unit="tensor", disable=not progress):
            name = hf_tensor_name(tensor.name)
            if name == "model.embed_tokens.weight" and tensor.tensor_type.name in KEPT_TYPES:
                table = self.quant_weight(tensor)
                yield name, table  # NOTE: looked up quantized (QuantizedEmbedding)
                if self._kept_quantized(tensor):
                    yield "lm_head.weight", table
            elif not self._kept_quantized(tensor):
                weight = self.dequantize(tensor)
                pieces = shard(name, tuple(weight.shape)) if shard is not None else None
                yield name, take_shard(weight, pieces).to(dtype)
            else:
                yield name, self.quant_weight(tensor)
