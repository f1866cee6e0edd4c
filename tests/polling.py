"""Waiting for a condition in tests: a bounded poll, never an unbounded loop."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(predicate: Callable[[], object], timeout_s: float = 5.0,
               ignore: tuple[type[BaseException], ...] = (), interval_s: float = 0.02) -> bool:
    """Poll ``predicate`` every ``interval_s`` seconds until it is true (True) or
    ``timeout_s`` seconds have passed (False, after one last try). Exceptions of the
    types in ``ignore`` count as not yet."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if predicate():
                return True
        except ignore:
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(interval_s)
