"""The ``pdserve`` command line.

    pdserve make-demo-model DIR          write the small demo checkpoint
    pdserve generate [--model DIR] --prompt TEXT [--prompt TEXT ...]
    pdserve serve [MODEL] [--prefill-workers N] [--decode-workers M] [--port 8000]
                  [--config FILE.yaml]
    pdserve scale [--prefill N] [--decode M] [--model NAME] [--url http://127.0.0.1:8000]

Engine flags follow vLLM's names (``--model``, ``--dtype``, ``--max-model-len``, ...).
"""

from __future__ import annotations

import argparse
import json
import os
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


SCALE_TIMEOUT_S = 900.0


def scale_admin_key(args: argparse.Namespace,
                    environ: dict[str, str] | None = None) -> str | None:
    """The admin key ``pdserve scale`` sends: ``--admin-api-key``, else the first key of
    ``--admin-api-key-file``, else ``$PDSERVE_ADMIN_API_KEY`` (``environ``, default
    ``os.environ``), else None (a router with no admin key takes a loopback client
    without one). Only pdserve's own admin variable: never a client key's
    (``PDSERVE_API_KEY``, ``OPENAI_API_KEY``), which the admin endpoints refuse anyway
    and which must not go to whatever ``--url`` names.

    Raises:
        ValueError: the key or file is unusable, or ``$PDSERVE_ADMIN_API_KEY`` is set but
            empty (named as ``router/api_keys.py``'s ``load_admin_api_keys`` names it).
    """
    from pdserve.router.api_keys import load_admin_api_keys

    keys, _ = load_admin_api_keys([args.admin_api_key] if args.admin_api_key else (),
                                  None if args.admin_api_key else args.admin_api_key_file,
                                  os.environ if environ is None else environ)
    return keys[0] if keys else None


def cmd_scale(args: argparse.Namespace) -> int:
    """``pdserve scale``: ``POST /admin/scale`` to a running ``pdserve serve``; prints the
    pool sizes it answers with (JSON). Exit 1 on an error answer or no answer; 2 (via
    ``main``) for an unusable admin key.

    Raises:
        ValueError: an unusable admin key (``scale_admin_key``).
    """
    import httpx

    body = {k: v for k, v in (("prefill_workers", args.prefill),
                              ("decode_workers", args.decode)) if v is not None}
    model = {"model": args.model} if args.model else {}
    key = scale_admin_key(args)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    url = args.url.rstrip("/")
    try:
        if body:
            reply = httpx.post(f"{url}/admin/scale", json={**body, **model}, headers=headers,
                               timeout=args.timeout_s)
        else:
            reply = httpx.get(f"{url}/admin/pools", params=model, headers=headers,
                              timeout=30.0)
    except httpx.HTTPError as exc:
        print(f"pdserve scale: no answer from {url}: {exc}", file=sys.stderr)
        return 1
    if reply.status_code != 200:
        try:
            message = reply.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = reply.text
        print(f"pdserve scale: {reply.status_code}: {message}", file=sys.stderr)
        return 1
    print(json.dumps(reply.json()))
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
    serve.add_argument("model_tag", nargs="?", metavar="MODEL",
                       help="the model, as --model takes it (vLLM's `vllm serve MODEL`)")
    serve.add_argument("--config", metavar="FILE.yaml",
                       help="flags from a YAML mapping of flag names (dashes or "
                       "underscores) to values; the command line's override them")
    add_engine_args(serve)
    add_serve_args(serve)
    serve.set_defaults(func=cmd_serve)

    scale = sub.add_parser("scale", help="resize the pools of a running `pdserve serve` "
                           "(no sizes: print them)")
    scale.add_argument("--prefill", type=int, help="prefill workers wanted")
    scale.add_argument("--decode", type=int, help="decode workers wanted (>= 1)")
    scale.add_argument("--url", default="http://127.0.0.1:8000", help="the router's HTTP URL")
    scale.add_argument("--model", help="the model whose pools to resize (needed when the "
                                       "cluster serves several)")
    scale.add_argument("--admin-api-key", metavar="KEY",
                       help="one of the router's admin API keys (visible in ps: prefer "
                       "--admin-api-key-file or $PDSERVE_ADMIN_API_KEY, the default); "
                       "a client key (--api-key, $PDSERVE_API_KEY, $OPENAI_API_KEY) is "
                       "never sent. A router with no admin key takes loopback clients "
                       "without one")
    scale.add_argument("--admin-api-key-file", metavar="PATH",
                       help="send the first admin API key in this file")
    scale.add_argument("--timeout-s", type=float, default=SCALE_TIMEOUT_S,
                       help="seconds to wait for new workers to serve and removed ones to "
                       "drain")
    scale.set_defaults(func=cmd_scale)
    return parser


def subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The parser of ``parser``'s sub-command ``name`` (``build_parser``'s)."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; a usage or start-up error (a bad flag value, a missing file, a
    taken port) prints ``pdserve: error: ...`` and returns 2."""
    from pdserve.entrypoints.config_file import parse_with_config
    from pdserve.router.serving import StartupError

    parser = build_parser()
    try:
        args = parse_with_config(parser, subcommand(parser, "serve"),
                                 list(sys.argv[1:] if argv is None else argv))
    except ValueError as exc:
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2
    tag = getattr(args, "model_tag", None)
    if tag is not None:
        if args.model is not None and args.model != tag:
            parser.error(f"the model is given twice: {tag} and --model {args.model}")
        args.model = tag
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, FileExistsError, StartupError) as exc:
        print(f"pdserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
