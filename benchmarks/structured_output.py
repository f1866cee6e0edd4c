"""Structured output: do unconstrained requests keep their throughput beside constrained
ones? ``LLM.generate`` on the same engine, in the same run, with the same batch size.

- **alone**: ``--num-prompts`` unconstrained requests;
- **beside**: half of them unconstrained, half constrained to a JSON schema (an array of
  ``3 * --output-len`` bounded integers, so no constrained request ends before the others).

Every request has a ``--input-len``-token prompt of random token ids, is sampled at
temperature 1 with a seed of its own (so the two runs differ only in the grammar's
bitmask, not in greedy against sampled rows) and generates exactly ``--output-len``
tokens (``ignore_eos``; a constrained request's grammar is still open then, so it ends by
length too). All rows of a step run together, so an unconstrained request's token rate is
``output_len / wall seconds`` of its run. The two runs alternate ``--repeats`` times
(default 5) after an untimed warm-up that also compiles the grammar; the best (least time)
of each is reported with the ratio of unconstrained token rates, beside over alone (1.0:
no slowdown), and each repeat's pair. The first run also checks that the mixed batch's
unconstrained outputs equal the alone run's.

The model is the demo model (random weights, a real byte-level BPE tokenizer of 2,048
tokens), unless ``--model`` names a checkpoint with a tokenizer.

    python benchmarks/structured_output.py [--num-prompts 32 --input-len 64 --output-len 128]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.demo_model import ensure_demo_model
from pdserve.engine.structured_output import json_schema_spec


def make_params(num_prompts: int, output_len: int, constrained: bool) -> list[SamplingParams]:
    """``num_prompts`` seeded, sampled params of ``output_len`` tokens; with
    ``constrained``, the second half carries the JSON schema."""
    schema = {"type": "array", "minItems": 3 * output_len, "maxItems": 3 * output_len,
              "items": {"type": "integer", "minimum": 0, "maximum": 999}}
    spec = json_schema_spec(schema)
    return [SamplingParams(temperature=1.0, seed=i, max_tokens=output_len, ignore_eos=True,
                           structured_output=spec if constrained and i >= num_prompts // 2
                           else None)
            for i in range(num_prompts)]


def timed(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]):
    """One run (the prefix cache reset first); returns (wall seconds, outputs)."""
    assert llm.reset_prefix_cache()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == p.max_tokens for o, p in zip(outputs, params))
    return elapsed, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a checkpoint with a tokenizer (default: the demo model)")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, help="write the result here")
    args = parser.parse_args()

    model = args.model or str(ensure_demo_model())
    llm = LLM(model, dtype="float32", max_model_len=args.input_len + args.output_len + 16,
              load_progress=False)
    vocab = llm.engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, min(vocab, 2000), (args.num_prompts, args.input_len),
                            generator=gen).tolist()
    runs = {"alone": make_params(args.num_prompts, args.output_len, False),
            "beside": make_params(args.num_prompts, args.output_len, True)}
    llm.generate(prompts[:2], runs["beside"][-2:])  # warm-up; compiles the grammar
    half = args.num_prompts // 2
    times: dict[str, list[float]] = {name: [] for name in runs}
    for repeat in range(args.repeats):
        outputs = {}
        for name, params in runs.items():
            seconds, outputs[name] = timed(llm, prompts, params)
            times[name].append(seconds)
        if repeat == 0:  # unconstrained rows are untouched by their neighbours' grammars
            assert [o.outputs[0].token_ids for o in outputs["alone"][:half]] == \
                   [o.outputs[0].token_ids for o in outputs["beside"][:half]]
            json.loads(outputs["beside"][-1].outputs[0].text + "0]")  # an open array
    best = {name: min(t) for name, t in times.items()}
    ratio = best["alone"] / best["beside"]
    paired = [a / b for a, b in zip(times["alone"], times["beside"])]
    total_tokens = args.num_prompts * args.output_len
    for name, runs_s in times.items():
        print(f"{name + ':':8}{total_tokens / best[name]:8.1f} output tok/s, "
              f"{args.output_len / best[name]:6.1f} tok/s per request (best {best[name]:.2f} s "
              f"of {', '.join(f'{t:.2f}' for t in runs_s)})")
    print(f"ratio:  {ratio:8.3f} (unconstrained token rate beside constrained / alone, best "
          f"over best; per repeat {', '.join(f'{r:.3f}' for r in paired)})")
    if args.json:
        args.json.write_text(json.dumps({
            "workload": vars(args) | {"model": model, "json": None, "vocab_size": vocab},
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} "
                       f"cores, torch {torch.__version__}, {torch.get_num_threads()} threads",
            "seconds": times, "ratio": ratio, "ratio_per_repeat": paired}, indent=2))


if __name__ == "__main__":
    main()
