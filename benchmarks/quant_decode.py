"""Decode speed of quantized weights at batch 1, where decode reads every weight once per
token and is bound by memory, as on a CPU server with one user.

Model: a checkpoint of Llama-3.2-1B's shape (hidden 2048, 16 layers, 32 heads over 8 KV
heads of 64, intermediate 8192, vocabulary 128256, tied embeddings; random bf16 weights,
written once to ``--model-dir``), run by pdserve's ``LLM`` in bf16, then with
``--quantization int8`` and ``int4`` (quantized at load), each in a fresh process of its
own. A run prefills a 128-token prompt, then decodes ``--output-len`` tokens; the time per
output token is the decode's alone (the time of the whole run less that of a run of one
token, over the tokens after the first), best of ``--repeats``. Prints output tokens per
second and each scheme's ratio to bf16, measured in the same run, and the bytes of the
linears each reads per token.

    python benchmarks/quant_decode.py [--output-len 64 --repeats 3 --json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

SCHEMES = ("bf16", "int8", "int4")
SHAPE = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
         "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
         "vocab_size": 128256, "max_position_embeddings": 2048, "tie_word_embeddings": True,
         "rope_theta": 500000.0}
_TIMEOUT_S = 1800


def write_checkpoint(path: Path) -> Path:
    """Llama-3.2-1B's shape with random bf16 weights (fixed seed), once."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if (path / "config.json").is_file():
        return path
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**SHAPE))
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    for param in model.parameters():  # NOTE: init on bf16 storage, a fraction of the time
        torch.nn.init.normal_(param, std=0.02)
    model.save_pretrained(path)
    return path


def _child(model: str, scheme: str, output_len: int, repeats: int, conn) -> None:
    from pdserve.engine import LLM, SamplingParams
    from pdserve.engine.models.quantization import QuantizedLinear

    llm = LLM(model, dtype="bfloat16", max_model_len=1024, load_progress=False,
              quantization=None if scheme == "bf16" else scheme)
    prompt = torch.randint(0, 32000, (128,), generator=torch.Generator().manual_seed(1)).tolist()

    def run(tokens: int) -> float:
        assert llm.reset_prefix_cache()
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=tokens,
                                              ignore_eos=True))
        return time.perf_counter() - start

    run(4)  # warm-up
    tpots = [(run(output_len) - run(1)) / (output_len - 1) for _ in range(repeats)]
    linears = [m for m in llm.engine.model_runner.model.modules()
               if isinstance(m, (QuantizedLinear, torch.nn.Linear))
               or type(m).__name__ == "PackedLinear"]
    weight_bytes = sum(m.nbytes if isinstance(m, QuantizedLinear)
                       else m.in_features * m.out_features * 2 for m in linears)
    conn.send({"tpot_s": min(tpots), "tpots_s": tpots, "linear_bytes": weight_bytes})


def measure(model: Path, scheme: str, output_len: int, repeats: int) -> dict:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(str(model), scheme, output_len, repeats, child))
    proc.start()
    child.close()
    try:
        if not parent.poll(_TIMEOUT_S):
            raise TimeoutError(f"{scheme} took over {_TIMEOUT_S} s")
        return parent.recv()
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=Path(os.environ.get(
        "PDSERVE_CACHE_DIR", Path(tempfile.gettempdir()) / "pdserve-bench")) / "llama-1b-shape")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--schemes", default=",".join(SCHEMES))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    model = write_checkpoint(args.model_dir)
    results = {s: measure(model, s, args.output_len, args.repeats)
               for s in args.schemes.split(",")}
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}; batch 1, {args.output_len} tokens after 128")
    base = results.get("bf16")
    for scheme, r in results.items():
        r["output_tok_s"] = 1.0 / r["tpot_s"]
        line = (f"{scheme:>5}: {r['output_tok_s']:7.2f} tok/s (TPOT {r['tpot_s'] * 1e3:.1f} ms, "
                f"linears {r['linear_bytes'] / 1e9:.2f} GB)")
        if base:
            r["ratio"] = r["output_tok_s"] / base["output_tok_s"]
            line += f"  {r['ratio']:.2f}x bf16"
        print(line)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
