"""A mixture-of-experts model's W1 throughput beside a dense model of the same active
parameters, in the same run.

The dense model is W1's ~125M Llama (``offline_throughput.write_checkpoint``: hidden 768,
12 layers, 12 heads, 4 KV heads, intermediate 2048, vocab 32000). The MoE model is a
Mixtral of the same shape whose MLPs are 8 experts of intermediate 1024 with 2 active per
token: each token runs 2 x 1024 = 2048 columns, as the dense model's one MLP, so both
compute the same FLOPs per token (plus the router's 8 logits), while the MoE model holds
4x the MLP weights and reads, at W1's batch of 32, most experts every decode step.
Random weights (fixed seed), bf16. Both run W1 (32 prompts of 256 random ids, 128 greedy
output tokens, ``ignore_eos``) through ``pdserve.engine.LLM``, alternating, each run in a
fresh process (``offline_throughput.timed_run``); prints each one's best output tokens
per second and their ratio (best over best, and per repeat).

    python benchmarks/moe_throughput.py [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch
from offline_throughput import timed_run, write_checkpoint


def write_moe_checkpoint(path: Path, dtype: torch.dtype) -> Path:
    """Write the W1-shaped Mixtral (8 experts of 1024, top-2) once."""
    from transformers import MixtralConfig, MixtralForCausalLM

    if (path / "config.json").is_file():
        return path
    torch.manual_seed(0)
    config = MixtralConfig(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                           num_key_value_heads=4, intermediate_size=1024, num_local_experts=8,
                           num_experts_per_tok=2, vocab_size=32000,
                           max_position_embeddings=2048, tie_word_embeddings=False,
                           sliding_window=None)
    MixtralForCausalLM(config).to(dtype).save_pretrained(path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--cache-dir", type=Path, default=Path(os.environ.get(
        "PDSERVE_CACHE_DIR", Path(tempfile.gettempdir()) / "pdserve-bench")))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    models = {"dense": write_checkpoint(args.cache_dir / "llama-125m", torch.bfloat16),
              "moe": write_moe_checkpoint(args.cache_dir / "mixtral-w1-8x1024-top2",
                                          torch.bfloat16)}
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 32000, (args.num_prompts, args.input_len),
                            generator=gen).tolist()
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(args.repeats):
        for name, path in models.items():
            seconds, _ = timed_run("pdserve", path, prompts, args.output_len, "bfloat16",
                                   args.device)
            times[name].append(seconds)
    num_output = args.num_prompts * args.output_len
    for name, runs in times.items():
        print(f"{name + ':':7}{num_output / min(runs):8.1f} output tok/s (best {min(runs):.1f} s "
              f"of {', '.join(f'{t:.1f}' for t in runs)})")
    ratio = min(times["dense"]) / min(times["moe"])
    paired = [d / m for d, m in zip(times["dense"], times["moe"])]
    print(f"MoE / dense: {ratio:.2f}x output tok/s (best over best; per repeat "
          f"{', '.join(f'{r:.2f}' for r in paired)})")
    if args.json:
        args.json.write_text(json.dumps({"seconds": times, "ratio": ratio,
                                         "ratio_per_repeat": paired}, indent=2))


if __name__ == "__main__":
    main()
