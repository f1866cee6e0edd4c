"""Offline throughput: pdserve's ``LLM.generate`` against transformers' static-batch
``generate`` on the same prompts, in the same run.

Workload W1: 32 prompts of 256 random token ids, 128 output tokens each (``ignore_eos``),
greedy, on a ~125M-parameter Llama (hidden 768, 12 layers, 12 heads, 4 KV heads,
intermediate 2048, vocab 32000) in bf16 that this script writes itself (random weights).
Each is timed ``--repeats`` times (default 3), the two alternating, every run in a fresh
process of its own (loaded and warmed up there, untimed), so neither engine's memory or
threads are present while the other runs; prints each one's best output tokens per
second (least time: the run least disturbed by other jobs on the machine), their ratio,
and the ratio of each repeat's pair; ``--json`` writes the result with every time.

    python benchmarks/offline_throughput.py [--num-prompts 32 --input-len 256 --output-len 128]

``--model`` runs W1 on another model instead (a checkpoint folder, a ``.gguf`` file, or a
hub id in the Hugging Face cache; its vocabulary must hold the 32000 ids W1 draws from):
transformers loads a GGUF file with ``gguf_file=``, dequantized, in ``--dtype``.
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

_RUN_TIMEOUT_S = 1800


def write_checkpoint(path: Path, dtype: torch.dtype) -> Path:
    """Write the ~125M Llama benchmark checkpoint (random weights, fixed seed) once."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if (path / "config.json").is_file():
        return path
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                         num_key_value_heads=4, intermediate_size=2048, vocab_size=32000,
                         max_position_embeddings=2048, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(path)
    return path


def pdserve_runner(model_dir: Path, prompts: list[list[int]], output_len: int, dtype: str):
    """Load pdserve's ``LLM`` and warm it up; return a function that generates W1 once
    and returns its wall seconds."""
    from pdserve.engine import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype=dtype, max_model_len=1024, load_progress=False)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    # Warm up on other tokens, so no benchmark prompt is prefix-cached.
    warmup = [[(t + 1) % 32000 for t in p] for p in prompts[:2]]
    llm.generate(warmup, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))

    def run() -> float:
        assert llm.reset_prefix_cache()  # NOTE: every run prefills all of W1
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == output_len for o in outputs)
        return elapsed

    return run


def transformers_runner(model_dir: Path, prompts: list[list[int]], output_len: int,
                        dtype: torch.dtype):
    """Load the checkpoint with transformers and warm it up; return a function that runs
    static-batch greedy ``generate`` on W1 once and returns its wall seconds."""
    from transformers import AutoModelForCausalLM

    if str(model_dir).endswith(".gguf"):
        model = AutoModelForCausalLM.from_pretrained(
            model_dir.parent, gguf_file=model_dir.name, dtype=dtype).eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    ids = torch.tensor(prompts)
    kwargs = {"do_sample": False, "eos_token_id": None, "pad_token_id": 0,
              "attention_mask": torch.ones_like(ids)}
    with torch.inference_mode():
        model.generate(ids[:2], max_new_tokens=4, min_new_tokens=4, **{
            **kwargs, "attention_mask": torch.ones_like(ids[:2])})

    def run() -> float:
        with torch.inference_mode():
            start = time.perf_counter()
            out = model.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len,
                                 **kwargs)
            elapsed = time.perf_counter() - start
        assert out.shape[1] == ids.shape[1] + output_len
        return elapsed

    return run


def _run_in_child(name: str, model_dir: Path, prompts: list[list[int]], output_len: int,
                  dtype: str, conn) -> None:
    """Child process: load and warm up one engine, time one W1 run, send the seconds."""
    if name == "pdserve":
        run = pdserve_runner(model_dir, prompts, output_len, dtype)
    else:
        run = transformers_runner(model_dir, prompts, output_len, getattr(torch, dtype))
    conn.send(run())
    conn.close()


def timed_run(name: str, model_dir: Path, prompts: list[list[int]], output_len: int,
              dtype: str) -> float:
    """One timed W1 run of ``name`` in a fresh process, so neither engine's memory,
    threads or caches are there while the other runs; returns its wall seconds."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_run_in_child,
                       args=(name, model_dir, prompts, output_len, dtype, child))
    proc.start()
    child.close()
    try:
        if not parent.poll(_RUN_TIMEOUT_S):
            raise TimeoutError(f"{name} took over {_RUN_TIMEOUT_S} s")
        return parent.recv()
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    parser.add_argument("--model-dir", type=Path, default=Path(os.environ.get(
        "PDSERVE_CACHE_DIR", Path(tempfile.gettempdir()) / "pdserve-bench")) / "llama-125m")
    parser.add_argument("--model", type=Path, default=None,
                        help="run W1 on this model (folder, .gguf file) instead of writing "
                             "the 125M Llama into --model-dir")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed runs of each, alternating; the best (least time) of "
                             "each is reported, which filters other jobs' load")
    parser.add_argument("--json", type=Path, help="write the result here")
    args = parser.parse_args()

    dtype = getattr(torch, args.dtype)
    model_dir = args.model or write_checkpoint(args.model_dir, dtype)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 32000, (args.num_prompts, args.input_len), generator=gen).tolist()
    num_output = args.num_prompts * args.output_len

    names = ["pdserve"] + ([] if args.skip_transformers else ["transformers"])
    times: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(args.repeats):
        for name in names:
            times[name].append(timed_run(name, model_dir, prompts, args.output_len, args.dtype))
    result = {"workload": vars(args) | {"model_dir": str(model_dir), "json": None,
                                        "model": str(args.model)},
              "machine": f"{platform.processor() or platform.machine()}, "
                         f"{os.cpu_count()} cores, torch {torch.__version__}, "
                         f"{torch.get_num_threads()} threads",
              "seconds": times}
    for name, runs in times.items():
        best = min(runs)
        result[f"{name}_output_tok_s"] = num_output / best
        print(f"{name + ':':14}{num_output / best:8.1f} output tok/s (best {best:.1f} s of "
              f"{', '.join(f'{t:.1f}' for t in runs)})")
    if "transformers" in times:
        result["ratio"] = min(times["transformers"]) / min(times["pdserve"])
        paired = [hf / ours for ours, hf in zip(times["pdserve"], times["transformers"])]
        result["ratio_per_repeat"] = paired
        print(f"ratio:        {result['ratio']:8.2f}x (best over best; per repeat "
              f"{', '.join(f'{r:.2f}' for r in paired)})")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
