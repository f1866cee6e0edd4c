"""Bounds on request fields, shared by the router's HTTP and gRPC APIs (issue 12: a value
out of these bounds must get a 400 / INVALID_ARGUMENT naming the field, never a 5xx from
protobuf, the tokenizer or block hashing further on).

The ``check_*`` functions raise ``ValueError`` with a message that names the limit; the
callers add the field's name (pydantic's ``loc`` in ``router/protocol/``, or
``check_field`` in ``router/protocol/validation.py``, which the gRPC API calls).
"""

from __future__ import annotations

import re

MAX_N = 128  # OpenAI's limit on n
MAX_NUM_SEQUENCES = 256  # prompts x n in one request
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024  # the engine scans them for every generated token
INT32_MAX = 2**31 - 1  # token ids, top_k, max_tokens and min_tokens are int32 on the wire
SEED_LIMIT = 2**63  # seeds are int64 on the wire: [0, 2**63)
# a client's own request id (gRPC ``GenerateRequest.request_id``): printable in logs and
# metrics as is, and short enough for a log line
MAX_REQUEST_ID_CHARS = 128
REQUEST_ID_CHARS = "A-Za-z0-9._:-"
_REQUEST_ID = re.compile(f"[{REQUEST_ID_CHARS}]+")


def check_text(value: str) -> str:
    """Return ``value`` if it has a UTF-8 form.

    Raises:
        ValueError: ``value`` holds a lone surrogate (``"\\ud800"`` in JSON), naming its index.
    """
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"must be valid Unicode: lone surrogate "
                             f"{value[exc.start]!r} at index {exc.start}") from None
    return value


def check_request_id(value: str) -> str:
    """Return ``value`` if it is a valid client request id: 1 to ``MAX_REQUEST_ID_CHARS``
    characters, each one of ``[A-Za-z0-9._:-]``.

    Raises:
        ValueError: empty, too long (naming its length and the limit), or with a character
            outside that set (naming the first one and its index).
    """
    if not 1 <= len(value) <= MAX_REQUEST_ID_CHARS:
        raise ValueError(f"must be 1 to {MAX_REQUEST_ID_CHARS} characters, got "
                         f"{len(value)}")
    if _REQUEST_ID.fullmatch(value) is None:
        index = next(i for i, c in enumerate(value) if _REQUEST_ID.fullmatch(c) is None)
        raise ValueError(f"may hold only the characters [{REQUEST_ID_CHARS}], got "
                         f"{value[index]!r} at index {index}")
    return value


def check_stop_strings(strings: list[str]) -> list[str]:
    """Return ``strings`` if they are valid stop strings.

    Raises:
        ValueError: more than ``MAX_STOP_STRINGS``, an empty one, one longer than
            ``MAX_STOP_STRING_CHARS`` characters, or one with a lone surrogate.
    """
    if len(strings) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(strings)}")
    for s in strings:
        if not s:
            raise ValueError("stop strings must not be empty")
        if len(s) > MAX_STOP_STRING_CHARS:
            raise ValueError(f"stop strings must be at most {MAX_STOP_STRING_CHARS} "
                             f"characters, got one of {len(s)}")
        check_text(s)
    return strings


def check_token_id(value: int, vocab_size: int | None) -> int:
    """Return ``value`` if it is a token id: in ``[0, vocab_size)``, or in ``[0, INT32_MAX]``
    when ``vocab_size`` is None.

    Raises:
        ValueError: out of that range, naming the id and the vocabulary size.
    """
    if vocab_size is not None and not 0 <= value < vocab_size:
        raise ValueError(f"token id {value} is out of the vocabulary (size {vocab_size})")
    if not 0 <= value <= INT32_MAX:
        raise ValueError(f"token id {value} is out of range [0, {INT32_MAX}]")
    return value


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice ``index`` of a request seeded with ``seed``: ``seed + index``
    (vLLM's rule for ``n > 1``), wrapped modulo ``2**63`` so that every seed the API takes,
    ``[0, 2**63)``, gives seeds that fit the wire's int64 (near ``2**63`` they wrap to 0,
    1, ...). None stays None (unseeded)."""
    return None if seed is None else (seed + index) % SEED_LIMIT
