"""API keys sent as ``Authorization: Bearer <key>``: checking one, reading a key file,
loading the keys of one role from its flags, file and environment, and comparing a
presented key with the accepted ones. The router's client and admin keys
(``router/api_keys.py``) and the workers' metrics keys (``cluster/metrics_auth.py``)
share these rules.

Keys are kept and compared as SHA-256 digests, each comparison with
``hmac.compare_digest`` and against every accepted digest (``matches``): how long a check
takes says nothing of how close a guess was, nor which key matched.

Imports nothing heavy: ``pdserve --help`` reads flags that use it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Callable, Iterable, Mapping
from typing import TypeVar

T = TypeVar("T")


def check_key(key: str) -> str:
    """``key`` itself, when it can be sent in an HTTP header and in gRPC metadata: not
    empty, printable ASCII without spaces (as a bearer token is).

    Raises:
        ValueError: saying what is wrong, never showing the key.
    """
    if not key:
        raise ValueError("the API key is empty")
    if not all("!" <= ch <= "~" for ch in key):
        raise ValueError("an API key must be printable ASCII without spaces (as sent in "
                         "'Authorization: Bearer <key>')")
    return key


def read_key_file(path: str) -> list[str]:
    """The keys in the file ``path``: one per non-empty line, surrounding whitespace
    removed.

    Raises:
        ValueError: the file cannot be read, is not UTF-8, holds no key, or a line is not a
            valid key (``check_key``); the message names the path and the line.
    """
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text") from None
    keys = [named(f"{path}, line {number}", check_key, line.strip())
            for number, line in enumerate(lines, 1) if line.strip()]
    if not keys:
        raise ValueError(f"{path} holds no API key (one key per non-empty line)")
    return keys


def load_keys(cli_keys: Iterable[str], key_file: str | None,
              environ: Mapping[str, str] | None, flag: str,
              env_vars: tuple[str, ...]) -> tuple[list[str], str | None]:
    """One role's keys and where they came from (for the log), e.g. ``(["k1", "k2"],
    "--api-key, --api-key-file")``, or ``([], None)`` when nothing gives one: every
    ``cli_keys`` (the flag ``flag``) and every line of ``key_file`` (``<flag>-file``)
    together; without them the first of ``env_vars`` set in ``environ`` (default
    ``os.environ``), taken as it is (a space around it is refused; a file's lines are
    stripped). A variable that is set but empty is an error, not "no key": an unset variable in
    a launch script must not open what the key guards.

    Raises:
        ValueError: a key is empty or invalid, or the file is unusable; the message starts
            with the flag or variable (``PDSERVE_API_KEY: the API key is empty``) and names
            the file and line where there is one.
    """
    environ = os.environ if environ is None else environ
    keys = [named(flag, check_key, key) for key in cli_keys]
    sources = [flag] if keys else []
    if key_file is not None:
        keys += named(f"{flag}-file", read_key_file, key_file)
        sources.append(f"{flag}-file")
    if keys:
        return keys, ", ".join(sources)
    for name in env_vars:
        if name in environ:
            return [named(name, check_key, environ[name])], name
    return [], None


def named(source: str, check: Callable[[str], T], value: str) -> T:
    """``check(value)``, its ValueError prefixed with ``source`` (a flag, variable or file
    and line).

    Raises:
        ValueError: ``check``'s, as ``"<source>: <its message>"``.
    """
    try:
        return check(value)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None


def digest(key: bytes) -> bytes:
    """A key's SHA-256 digest (32 bytes), the form keys are kept and compared in."""
    return hashlib.sha256(key).digest()


def matches(key_digest: bytes, digests: Iterable[bytes]) -> bool:
    """Whether ``key_digest`` is one of ``digests``, compared with every one of them in
    constant time (no early exit)."""
    matched = False
    for accepted in digests:
        matched |= hmac.compare_digest(key_digest, accepted)
    return matched
