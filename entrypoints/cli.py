"""The ``pdserve`` command line.

    pdserve make-demo-model DIR          write the small demo checkpoint
    pdserve generate [--model DIR] --prompt TEXT [--prompt TEXT ...]
    pdserve serve [--model DIR] [--prefill-workers N] [--decode-workers M] [--port 8000]

Engine flags follow vLLM's names (``--model``, ``--dtype``, ``--max-model-len``, ...).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from pdserve.engine.args import add_engine_args, engine_kwargs


def cmd_make_demo_model(args: argparse.Namespace) -> int:
    from pdserve.engine.demo_model import make_demo_model

    path = make_demo_model(args.path, overwrite=args.overwrite)
    print(f"demo model written to {path}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from pdserve.engine import LLM, SamplingParams

    kwargs = engine_kwargs(args)
    llm = LLM(kwargs.pop("model"), **kwargs)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.sampling_seed,
                            ignore_eos=args.ignore_eos)
    prompts = args.prompt
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outputs = llm.generate(prompts, params)
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        if args.json:
            print(json.dumps({"prompt": prompt, "text": completion.text,
                              "token_ids": completion.token_ids,
                              "finish_reason": completion.finish_reason}))
        else:
            print(f"{prompt!r} -> {completion.text!r} ({completion.finish_reason})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("make-demo-model", help="write the small demo checkpoint")
    demo.add_argument("path", help="output folder")
    demo.add_argument("--overwrite", action="store_true")
    demo.set_defaults(func=cmd_make_demo_model)

    gen = sub.add_parser("generate", help="generate offline from prompts")
    add_engine_args(gen)
    gen.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    gen.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sampling-seed", type=int)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt")
    gen.set_defaults(func=cmd_generate)

    from pdserve.entrypoints.serve import add_serve_args, cmd_serve

    serve = sub.add_parser("serve", help="run the cluster: workers under Ray, Redis, router")
    add_engine_args(serve)
    add_serve_args(serve)
    serve.set_defaults(func=cmd_serve)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; a usage or start-up error (a bad flag value, a missing file, a
    taken port) prints ``pdserve: error: ...`` and returns 2."""
    from pdserve.entrypoints.serve import StartupError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, FileExistsError, StartupError) as exc:
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
