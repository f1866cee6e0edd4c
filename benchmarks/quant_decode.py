"""Decode speed of quantized weights at batch 1, where decode reads every weight once per
token and is bound by memory, as on a CPU server with one user.

Model: a checkpoint of Llama-3.2-1B's shape (hidden 2048, 16 layers, 32 heads over 8 KV
heads of 64, intermediate 8192, vocabulary 128256, tied embeddings; random bf16 weights,
written once to ``--model-dir``), run by pdserve's ``LLM`` in bf16, then with
``--quantization int8`` and ``int4`` (quantized at load), each in a fresh process of its
own, all loaded at once and measured in turn (bf16, int8, int4, bf16, ...), so that the
machine's drift (a shared VM's neighbours) falls on every scheme alike. A run prefills a
128-token prompt, then decodes ``--output-len`` tokens; the time per output token is the
decode's alone (the time of the whole run less that of a run of one token, over the
tokens after the first), best of ``--repeats`` turns. Prints output tokens per second and
each scheme's ratio to bf16, measured in the same run, and the bytes of the linears each
reads per token.

    python benchmarks/quant_decode.py [--output-len 64 --repeats 3 --json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import platform
import statistics
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


def _child(model: str, scheme: str, output_len: int, conn) -> None:
    """Load ``scheme``; then, per ``"turn"`` received, measure one TPOT and send it."""
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
    linears = [m for m in llm.engine.model_runner.model.modules()
               if isinstance(m, (QuantizedLinear, torch.nn.Linear))
               or type(m).__name__ == "PackedLinear"]
    conn.send(sum(m.nbytes if isinstance(m, QuantizedLinear)
                  else m.in_features * m.out_features * 2 for m in linears))
    while conn.poll(_TIMEOUT_S) and conn.recv() == "turn":
        conn.send((run(output_len) - run(1)) / (output_len - 1))


def measure(model: Path, schemes: list[str], output_len: int, repeats: int) -> dict:
    """Each scheme in a process of its own, loaded once; ``repeats`` turns in order."""
    ctx = mp.get_context("spawn")
    procs, conns = {}, {}
    try:
        for scheme in schemes:
            conns[scheme], child = ctx.Pipe()
            procs[scheme] = ctx.Process(target=_child, args=(str(model), scheme, output_len,
                                                             child))
            procs[scheme].start()
            child.close()
        results = {}
        for scheme, conn in conns.items():
            if not conn.poll(_TIMEOUT_S):
                raise TimeoutError(f"{scheme} did not load in {_TIMEOUT_S} s")
            results[scheme] = {"linear_bytes": conn.recv(), "tpots_s": []}
        for _ in range(repeats):
            for scheme, conn in conns.items():
                conn.send("turn")
                if not conn.poll(_TIMEOUT_S):
                    raise TimeoutError(f"{scheme} took over {_TIMEOUT_S} s")
                results[scheme]["tpots_s"].append(conn.recv())
        for r in results.values():
            r["tpot_s"] = min(r["tpots_s"])
        return results
    finally:
        for scheme, conn in conns.items():
            with contextlib.suppress(OSError):
                conn.send("stop")
        for proc in procs.values():
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
    results = measure(model, args.schemes.split(","), args.output_len, args.repeats)
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
            # NOTE: each turn's ratio to bf16's turn just before it, for the spread
            turns = [b / t for b, t in zip(base["tpots_s"], r["tpots_s"])]
            r["turn_ratios"] = turns
            r["median_turn_ratio"] = statistics.median(turns)
            line += (" (turns: " + ", ".join(f"{x:.2f}" for x in turns)
                     + f"; median {r['median_turn_ratio']:.2f})")
        print(line)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
