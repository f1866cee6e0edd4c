"""The models ``pdserve serve`` serves: ``--models-config``'s entries, or the command line's
one (``ModelSpec``), and the engine flags of each pool (``--prefill-engine-args``,
``--decode-engine-args``) applied over the shared ones."""

from __future__ import annotations

import argparse
import dataclasses
import shlex
from pathlib import Path

DEMO_MODEL = "demo"  # a models YAML's name for the demo model pdserve writes itself
DEMO_MODEL_NAME = "pdserve-demo"  # the API's model name when serving the demo model
# Flags that must be the same in both pools: the model and where it comes from, the
# names clients and the prefix index use, the block size KV moves in and the KV cache
# dtype it is stored in (a pair of workers of two KV dtypes is refused, and the router
# hashes blocks with one), the tokenizer and EOS ids.
SHARED_ENGINE_FLAGS = ("model", "served_model_name", "block_size", "kv_cache_dtype",
                       "tokenizer", "revision", "download_dir", "generation_config",
                       "chat_template")


def pool_flags(args: argparse.Namespace, role: str) -> str:
    """``--<role>-engine-args``, with ``--<role>-tensor-parallel-size`` when given."""
    flags = getattr(args, f"{role}_engine_args")
    size = getattr(args, f"{role}_tensor_parallel_size", None)
    return flags if size is None else f"{flags} --tensor-parallel-size {size}"


def pool_engine_config(engine, flags: str, role: str):
    """``engine`` with the engine flags in ``flags`` (``--prefill-engine-args`` or
    ``--decode-engine-args``, as on the command line) applied over it.

    Raises:
        ValueError: a flag that is not an engine flag, one of ``SHARED_ENGINE_FLAGS``, or
            a bad value; the message names the flag and ``--<role>-engine-args``.
    """
    return apply_engine_flags(engine, flags, f"--{role}-engine-args", SHARED_ENGINE_FLAGS,
                              "must be the same in both pools; set it once, outside")


def apply_engine_flags(engine, flags: str, where: str, forbidden: tuple[str, ...],
                       why: str):
    """``engine`` with the engine flags in ``flags`` (as on the command line) applied.

    Raises:
        ValueError: a flag that is not an engine flag, one of ``forbidden`` (``why``), or a
            bad value; the message names the flag and ``where`` they came from.
    """
    from pdserve.engine.args import add_engine_args

    if not flags.strip():
        return engine
    parser = argparse.ArgumentParser(prog=where, add_help=False, exit_on_error=False)
    add_engine_args(parser)
    defaults = vars(parser.parse_args([]))
    try:
        given, unknown = parser.parse_known_args(shlex.split(flags))
    except (argparse.ArgumentError, SystemExit) as exc:
        raise ValueError(f"{where}: {exc}") from None
    if unknown:
        raise ValueError(f"{where}: {' '.join(unknown)} is not an engine flag")
    changed = {k: v for k, v in vars(given).items() if v != defaults[k]}
    refused = sorted(set(changed) & set(forbidden))
    if refused:
        raise ValueError(f"{where}: --{refused[0].replace('_', '-')} {why}")
    if "enable_prefix_caching" in changed:
        changed["enable_prefix_caching"] = given.enable_prefix_caching
    return dataclasses.replace(engine, **changed)


class _GivenOnce(argparse.Action):
    """Mixed into a flag's own action: the flag given twice on one command line is a usage
    error (exit 2) pointing to ``--models-config``, instead of the last one silently
    winning. A value from ``--config FILE`` is the flag's default, so the command line
    may still replace it once."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest, None) is not self.default:
            names = (f"; give all of one model's names after one {option_string} "
                     f"({option_string} NAME [NAME ...])" if self.nargs == "+" else "")
            parser.error(f"{option_string} is given twice: one command line serves one "
                         f"model{names}; to serve several models, list them in "
                         "--models-config FILE (README, Several models)")
        super().__call__(parser, namespace, values, option_string)


def refuse_repeated(parser: argparse.ArgumentParser, flags: tuple[str, ...]) -> None:
    """Make each of ``flags`` that ``parser`` has refuse a second use (``_GivenOnce``); a
    flag it lacks is skipped."""
    for flag in flags:
        action = parser._option_string_actions.get(flag)
        if action is None:
            continue
        action.__class__ = type(f"Once{type(action).__name__}", (_GivenOnce, type(action)),
                                {})


@dataclasses.dataclass(slots=True)
class ModelSpec:
    """One model ``pdserve serve`` serves: its engine (``served_model_name`` set) and its
    own pools' sizes (workers)."""

    engine: object
    prefill_workers: int
    decode_workers: int
    aliases: tuple[str, ...] = ()  # further names clients may use (--served-model-name)
    demo: bool = False  # the demo model, which every Ray node writes where it is missing

    @property
    def name(self) -> str:
        return self.engine.served_model_name


MODEL_ENTRY_KEYS = ("model", "served_model_name", "prefill_workers", "decode_workers",
                    "engine_args")


def models_from_config(path: str, base, args: argparse.Namespace) -> list[ModelSpec]:
    """The models of ``--models-config`` (YAML or JSON)::

        models:
          - model: /models/llama-3.1-8b       # required: a checkpoint folder, or demo
            served_model_name: llama          # default: the folder's name
            prefill_workers: 2                # default: --prefill-workers
            decode_workers: 2                 # default: --decode-workers
            engine_args: "--max-num-seqs 128" # engine flags over the command line's

    ``model: demo`` is the demo model that ``pdserve serve`` without ``--model`` serves
    (written on first use; served as ``pdserve-demo`` unless ``served_model_name`` says
    otherwise); a folder named ``demo`` is ``./demo``.

    ``base`` is the command line's engine configuration, each entry's starting point.

    Raises:
        ValueError: the file does not parse; an entry that is not a mapping, lacks
            ``model``, has an unknown key or a bad value; two entries with one name.
    """
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"--models-config {path}: {exc}") from None
    entries = data.get("models") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"--models-config {path}: needs 'models:', a non-empty list")
    specs = []
    for i, entry in enumerate(entries):
        where = f"--models-config models[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("model"), str):
            raise ValueError(f"{where}: needs 'model', a checkpoint folder or demo")  # noqa: TRY004
        unknown = sorted(set(entry) - set(MODEL_ENTRY_KEYS))
        if unknown:
            raise ValueError(f"{where}: unknown key '{unknown[0]}' (keys: "
                             f"{', '.join(MODEL_ENTRY_KEYS)})")
        demo = entry["model"] == DEMO_MODEL
        model = _demo_model_path() if demo else entry["model"]
        name = entry.get("served_model_name") or (DEMO_MODEL_NAME if demo else Path(model).name)
        engine = dataclasses.replace(base, model=model, served_model_name=str(name))
        engine = apply_engine_flags(engine, str(entry.get("engine_args") or ""),
                                    f"{where}.engine_args", ("model", "served_model_name"),
                                    "is the entry's own key")
        counts = {}
        for role in ("prefill", "decode"):
            count = entry.get(f"{role}_workers", getattr(args, f"{role}_workers"))
            if not isinstance(count, int) or isinstance(count, bool) or \
                    not (0 if role == "prefill" else 1) <= count <= 64:
                raise ValueError(f"{where}.{role}_workers: {count!r} is not a worker count "
                                 f"({0 if role == 'prefill' else 1}-64)")
            counts[role] = count
        specs.append(ModelSpec(engine, counts["prefill"], counts["decode"], demo=demo))
    names = [spec.name for spec in specs]
    twice = next((n for n in names if names.count(n) > 1), None)
    if twice is not None:
        raise ValueError(f"--models-config {path}: two models are served as {twice!r}")
    return specs




def _demo_model_path() -> str:
    """The demo model's folder, written first if missing (as ``--model`` left out)."""
    from pdserve.engine.demo_model import ensure_demo_model

    return str(ensure_demo_model())
