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

Both engines run on ``--device`` (default: CUDA when there is a GPU, else the CPU). The
first pdserve run also times W1's decode steps one by one (the steps where every prompt
decodes) and sets their median against the memory roofline of such a step: the bytes it
must read (every linear layer's weights once, the LM head's included, and each sequence's
K and V) over the device's copy bandwidth measured in the same process (a 1 GiB
``Tensor.copy_``, bytes read + written).

    python benchmarks/offline_throughput.py [--num-prompts 32 --input-len 256 --output-len 128]

``--model`` runs W1 on another model instead (a checkpoint folder, a ``.gguf`` file, or a
hub id in the Hugging Face cache; its vocabulary must hold the 32000 ids W1 draws from):
transformers loads a GGUF file with ``gguf_file=``, dequantized, in ``--dtype``.

``--kv-cache-dtype int8`` (repeatable; ``fp8``, ``fp8_e5m2`` too) adds pdserve with that
KV cache dtype to the alternation, as an engine of its own (``pdserve:int8``), and prints
its throughput as a ratio to pdserve's with the model's dtype (best over best, and per
repeat).

``--speculative-config JSON`` adds pdserve with speculative decoding (``pdserve:spec``)
and prints its throughput as a ratio to pdserve's without.

``--tensor-parallel-size 2`` (repeatable) adds pdserve split over that many ranks
(``pdserve:tp2``; on the CPU each rank takes an equal share of the cores) and prints its
throughput as a ratio to pdserve's at TP=1, with rank 0's time in the collectives (the
two all-reduces per layer, the embedding's, the logits' gather: the transfer and the
wait for the slower rank) per engine step, and their share of the run.
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


def copy_bandwidth_gbps(device: torch.device, num_bytes: int = 2**30) -> float:
    """The device's copy bandwidth: a ``num_bytes`` tensor copied, bytes read + written
    per second (best of 5), in GB/s."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(6):
        _synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        _synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * num_bytes / best / 1e9


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_step_probe(llm, prompts: list[list[int]], params) -> dict:
    """Generate W1 once more, timing each engine step; over the steps where every prompt
    decodes: the median step seconds and its memory roofline (bytes a step must read over
    the copy bandwidth)."""
    engine = llm.engine
    runner = engine.model_runner
    config = runner.config
    scheduled: list[int] = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        out = schedule()
        scheduled.append(out.total_num_scheduled_tokens)
        return out

    step = engine.step
    times: list[float] = []

    def timed_step():
        start = time.perf_counter()
        outputs = step()  # NOTE: ends with the sampled ids on the host: synchronized
        times.append(time.perf_counter() - start)
        return outputs

    engine.scheduler.schedule, engine.step = recording_schedule, timed_step
    try:
        assert llm.reset_prefix_cache()
        llm.generate(prompts, params)
    finally:
        del engine.scheduler.schedule, engine.step
    batch = len(prompts)
    decode = [(i, t) for i, (n, t) in enumerate(zip(scheduled, times)) if n == batch]
    if not decode:
        return {}
    median_s = sorted(t for _, t in decode)[len(decode) // 2]
    # NOTE: buffers too: the CPU's packed linears hold their weights as buffers
    tensors = [*runner.model.named_parameters(), *runner.model.named_buffers()]
    weight_bytes = sum(t.numel() * t.element_size() for name, t in tensors
                       if "rotary_emb" not in name
                       and ("embed_tokens" not in name or config.tie_word_embeddings))
    # NOTE: the middle decode step's contexts: prompt + tokens so far, one new token each
    middle = len(decode) // 2
    context = len(prompts[0]) + middle + 1
    layout = runner.kv_layout  # NOTE: a block's bytes, a quantized cache's scales included
    kv_bytes = batch * context * layout.block_bytes // layout.block_size
    gbps = copy_bandwidth_gbps(runner.device)
    roofline_s = (weight_bytes + kv_bytes) / (gbps * 1e9)
    return {"decode_steps": len(decode), "median_step_s": median_s, "batch": batch,
            "weight_bytes": weight_bytes, "kv_bytes": kv_bytes, "copy_gbps": gbps,
            "roofline_s": roofline_s, "step_over_roofline": median_s / roofline_s}


def pdserve_runner(model_dir: Path, prompts: list[list[int]], output_len: int, dtype: str,
                   device: str, kv_cache_dtype: str = "auto", tensor_parallel_size: int = 1,
                   speculative_config: str | None = None):
    """Load pdserve's ``LLM`` and warm it up; return a function that generates W1 once
    and returns its wall seconds, and one that runs ``decode_step_probe``."""
    from pdserve.engine import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype=dtype, max_model_len=1024, load_progress=False,
              device=device, kv_cache_dtype=kv_cache_dtype,
              tensor_parallel_size=tensor_parallel_size, speculative_config=speculative_config)
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

    return run, lambda: decode_step_probe(llm, prompts, params)


def transformers_runner(model_dir: Path, prompts: list[list[int]], output_len: int,
                        dtype: torch.dtype, device: str):
    """Load the checkpoint with transformers and warm it up; return a function that runs
    static-batch greedy ``generate`` on W1 once and returns its wall seconds."""
    from transformers import AutoModelForCausalLM

    if str(model_dir).endswith(".gguf"):
        model = AutoModelForCausalLM.from_pretrained(
            model_dir.parent, gguf_file=model_dir.name, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model = model.to(device).eval()
    ids = torch.tensor(prompts, device=device)
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
            _synchronize(out.device)
            elapsed = time.perf_counter() - start
        assert out.shape[1] == ids.shape[1] + output_len
        return elapsed

    return run


def time_collectives() -> dict:
    """Count rank 0's seconds in tensor-parallel collectives and its engine steps from now
    on (wraps ``TensorParallel``'s collectives and ``ModelRunner.execute``); returns the
    live counters."""
    from pdserve.engine import parallel
    from pdserve.engine.model_runner import ModelRunner

    counters = {"collective_s": 0.0, "collectives": 0, "steps": 0}

    def timed(method):
        def wrapper(self, x):
            start = time.perf_counter()
            try:
                return method(self, x)
            finally:
                counters["collective_s"] += time.perf_counter() - start
                counters["collectives"] += 1
        return wrapper

    def counted(method):
        def wrapper(self, *args):
            counters["steps"] += 1
            return method(self, *args)
        return wrapper

    for attr in ("all_reduce", "gather_to_first"):
        setattr(parallel.TensorParallel, attr, timed(getattr(parallel.TensorParallel, attr)))
    ModelRunner.execute = counted(ModelRunner.execute)
    return counters


def _run_in_child(name: str, model_dir: Path, prompts: list[list[int]], output_len: int,
                  dtype: str, device: str, probe: bool, conn,
                  speculative_config: str | None = None) -> None:
    """Child process: load and warm up one engine (``pdserve``, ``pdserve:<kv cache
    dtype>``, ``pdserve:tp<N>`` or ``transformers``), time one W1 run, send the seconds
    (and pdserve's ``decode_step_probe`` when ``probe``, or the collectives' counters of a
    ``tp`` run)."""
    extra = None
    if name.startswith("pdserve"):
        variant = name.partition(":")[2]
        size = int(variant[2:]) if variant.startswith("tp") else 1
        counters = time_collectives() if size > 1 else None
        spec = speculative_config if variant == "spec" else None
        kv = "auto" if size > 1 or spec else variant or "auto"
        run, probe_steps = pdserve_runner(model_dir, prompts, output_len, dtype, device, kv,
                                          size, spec)
        if counters is not None:
            counters.update(collective_s=0.0, collectives=0, steps=0)  # NOTE: W1's alone
            extra = counters
    else:
        run = transformers_runner(model_dir, prompts, output_len, getattr(torch, dtype), device)
    seconds = run()
    if probe and name.startswith("pdserve"):
        extra = probe_steps()
    conn.send((seconds, extra))
    conn.close()


def timed_run(name: str, model_dir: Path, prompts: list[list[int]], output_len: int,
              dtype: str, device: str, probe: bool = False,
              speculative_config: str | None = None) -> tuple[float, dict | None]:
    """One timed W1 run of ``name`` in a fresh process, so neither engine's memory,
    threads or caches are there while the other runs; returns its wall seconds (and
    the decode step probe's result when ``probe``)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_run_in_child, args=(name, model_dir, prompts, output_len,
                                                   dtype, device, probe, child,
                                                   speculative_config))
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


def parse_args() -> argparse.Namespace:
    """The benchmark's command line (``--help`` lists it)."""
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
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where both engines run (default: cuda when there is a GPU)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed runs of each, alternating; the best (least time) of "
                             "each is reported, which filters other jobs' load")
    parser.add_argument("--json", type=Path, help="write the result here")
    parser.add_argument("--kv-cache-dtype", action="append", default=[],
                        choices=["int8", "fp8", "fp8_e4m3", "fp8_e5m2"],
                        help="also time pdserve with this KV cache dtype (repeatable), "
                             "reported as a ratio to pdserve's with the model's dtype")
    parser.add_argument("--tensor-parallel-size", action="append", default=[], type=int,
                        help="also time pdserve split over this many ranks (repeatable), "
                             "reported as a ratio to pdserve's at 1, with its collectives' "
                             "time per step")
    parser.add_argument("--speculative-config", metavar="JSON",
                        help="also time pdserve with this speculative decoding config "
                             "(pdserve:spec), reported as a ratio to pdserve without")
    return parser.parse_args()


def time_engines(args: argparse.Namespace, model_dir: Path, prompts: list[list[int]]
                 ) -> tuple[dict[str, list[float]], dict[str, list[dict]], dict | None]:
    """Time each engine ``args.repeats`` times, alternating, each run in a child process.

    Returns ``(times, collectives, step_probe)``: seconds of each run by engine name
    (``pdserve``, ``pdserve:<kv dtype>``, ``pdserve:tp<n>``, ``pdserve:spec``,
    ``transformers``), the tensor-parallel runs' collective timings, and the decode-step
    probe of the first pdserve run (None without one).
    """
    names = (["pdserve", *(f"pdserve:{kv}" for kv in args.kv_cache_dtype),
              *(f"pdserve:tp{n}" for n in args.tensor_parallel_size),
              *(["pdserve:spec"] if args.speculative_config else [])]
             + ([] if args.skip_transformers else ["transformers"]))
    times: dict[str, list[float]] = {name: [] for name in names}
    collectives: dict[str, list[dict]] = {}
    step_probe = None
    for repeat in range(args.repeats):
        for name in names:
            seconds, extra = timed_run(name, model_dir, prompts, args.output_len, args.dtype,
                                       args.device, probe=repeat == 0 and name == "pdserve",
                                       speculative_config=args.speculative_config)
            times[name].append(seconds)
            if ":tp" in name:
                collectives.setdefault(name, []).append(extra | {"seconds": seconds})
            else:
                step_probe = step_probe or extra
    return times, collectives, step_probe


def report_variants(args: argparse.Namespace, result: dict, times: dict[str, list[float]],
                    collectives: dict[str, list[dict]]) -> None:
    """Print, and record in ``result``, each pdserve variant's throughput as a ratio to
    plain pdserve's: KV cache dtypes, speculation, then tensor parallelism with its
    collectives' time per step."""

    def against_pdserve(name: str) -> str:
        """Record ``name``'s throughput over pdserve's (best over best, and per repeat);
        return them in words."""
        result[f"{name}_ratio"] = min(times["pdserve"]) / min(times[name])
        paired = [base / other for base, other in zip(times["pdserve"], times[name])]
        result[f"{name}_ratio_per_repeat"] = paired
        return (f"{result[f'{name}_ratio']:.2f}x output tok/s (best over best; per repeat "
                f"{', '.join(f'{r:.2f}' for r in paired)})")

    for kv in args.kv_cache_dtype:
        print(f"{kv} KV / {args.dtype} KV: {against_pdserve(f'pdserve:{kv}')}")
    if args.speculative_config:
        print(f"speculation on / off: {against_pdserve('pdserve:spec')}")
    for n in args.tensor_parallel_size:
        name = f"pdserve:tp{n}"
        ratio = against_pdserve(name)
        result[f"{name}_collectives"] = collectives[name]
        best = min(collectives[name], key=lambda c: c["seconds"])
        print(f"TP={n} / TP=1: {ratio}; rank 0 in collectives "
              f"{best['collective_s'] / best['steps'] * 1e3:.2f} ms per step "
              f"({best['collectives'] / best['steps']:.0f} per step, {best['steps']} steps), "
              f"{best['collective_s'] / best['seconds']:.0%} of the run")


def main() -> None:
    """Run the benchmark: time the engines, print each one's output tokens per second and
    the ratios, and write the result to ``--json`` when given."""
    args = parse_args()

    dtype = getattr(torch, args.dtype)
    model_dir = args.model or write_checkpoint(args.model_dir, dtype)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, 32000, (args.num_prompts, args.input_len), generator=gen).tolist()
    num_output = args.num_prompts * args.output_len

    times, collectives, step_probe = time_engines(args, model_dir, prompts)
    machine = (torch.cuda.get_device_name() if args.device.startswith("cuda")
               else f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                    f"{torch.get_num_threads()} threads")
    result = {"workload": vars(args) | {"model_dir": str(model_dir), "json": None,
                                        "model": str(args.model)},
              "machine": f"{machine}, torch {torch.__version__}",
              "seconds": times, "decode_step": step_probe}
    for name, runs in times.items():
        best = min(runs)
        result[f"{name}_output_tok_s"] = num_output / best
        print(f"{name + ':':15}{num_output / best:8.1f} output tok/s (best {best:.1f} s of "
              f"{', '.join(f'{t:.1f}' for t in runs)})")
    if "transformers" in times:
        result["ratio"] = min(times["transformers"]) / min(times["pdserve"])
        paired = [hf / ours for ours, hf in zip(times["pdserve"], times["transformers"])]
        result["ratio_per_repeat"] = paired
        print(f"ratio:        {result['ratio']:8.2f}x (best over best; per repeat "
              f"{', '.join(f'{r:.2f}' for r in paired)})")

    report_variants(args, result, times, collectives)
    if step_probe:
        print(f"decode step:  {step_probe['median_step_s'] * 1e3:8.2f} ms median over "
              f"{step_probe['decode_steps']} steps of {step_probe['batch']} sequences; "
              f"roofline {step_probe['roofline_s'] * 1e3:.3f} ms ("
              f"{(step_probe['weight_bytes'] + step_probe['kv_bytes']) / 1e6:.0f} MB at "
              f"{step_probe['copy_gbps']:.0f} GB/s copy): "
              f"{step_probe['step_over_roofline']:.1f}x the roofline")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
