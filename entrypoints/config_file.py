"""``pdserve serve --config FILE.yaml``: the command's flags from a YAML mapping, as vLLM's
``--config`` takes them::

    port: 8001
    grpc-port: 50051            # dashes or underscores: grpc_port is the same key
    max_waiting_requests: 64
    disaggregation: always
    enable-auto-tool-choice: true   # a switch: true or false
    served-model-name: [llama, default]
    api-key-file: /etc/pdserve/keys.txt

Each key is a long flag of the command without its ``--``; a value is checked as the
command line's would be. The file's values become the flags' defaults, so a flag given
on the command line overrides the file's (a repeatable flag such as ``--api-key``
replaces the file's list).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def config_defaults(parser: argparse.ArgumentParser, path: str) -> dict[str, Any]:
    """The ``dest -> value`` defaults that the YAML file ``path`` sets for ``parser``'s
    flags, each value converted and checked as its flag's.

    Raises:
        ValueError: the file cannot be read or is not a YAML mapping; a key that is no
            flag of ``parser``; a value the flag refuses (the message names the key).
    """
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"--config {path}: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: needs a mapping of flag names to "  # noqa: TRY004
                         "values")
    actions = {opt: a for a in parser._actions for opt in a.option_strings
               if opt.startswith("--")}
    defaults = {}
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        action = actions.get(flag)
        if action is None or flag in ("--config", "--help"):
            raise ValueError(f"--config {path}: unknown key '{key}' (not a flag of this "
                             "command)")
        try:
            defaults[action.dest] = _value(action, value)
        except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
            raise ValueError(f"--config {path}: key '{key}': {exc}") from None
    return defaults


def _value(action: argparse.Action, value: Any) -> Any:
    """``value`` (from YAML) as ``action``'s flag would store it."""
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if not isinstance(value, bool):
            raise ValueError(f"{value!r} is not true or false")  # noqa: TRY004
        return value if isinstance(action, argparse._StoreTrueAction) else not value
    if value is None:
        return None
    many = isinstance(action, argparse._AppendAction) or action.nargs in ("+", "*")
    if many:
        items = value if isinstance(value, list) else [value]
        return [_one(action, item) for item in items]
    return _one(action, value)


def _one(action: argparse.Action, value: Any) -> Any:
    if isinstance(value, (dict, list, bool)):
        raise ValueError(f"{value!r} is not a valid value")  # noqa: TRY004
    text = str(value)
    converted = action.type(text) if action.type is not None else text
    if action.choices is not None and converted not in action.choices:
        raise ValueError(f"{value!r} is not one of {', '.join(map(str, action.choices))}")
    return converted


def parse_with_config(parser: argparse.ArgumentParser, sub: argparse.ArgumentParser,
                      argv: list[str]) -> argparse.Namespace:
    """``parser.parse_args(argv)``, and when its ``sub``-command was given ``--config
    FILE``, again with ``FILE``'s values as ``sub``'s defaults (the command line's flags
    win; a repeatable flag given there replaces the file's list).

    Raises:
        ValueError: as ``config_defaults``.
    """
    args = parser.parse_args(argv)
    path = getattr(args, "config", None)
    if path is None:
        return args
    defaults = config_defaults(sub, path)
    appended = {d for d, v in defaults.items() if isinstance(v, list) and any(
        a.dest == d and isinstance(a, argparse._AppendAction) for a in sub._actions)}
    sub.set_defaults(**{d: v for d, v in defaults.items() if d not in appended})
    args = parser.parse_args(argv)
    for dest in appended:
        if getattr(args, dest) is None:
            setattr(args, dest, defaults[dest])
    return args
