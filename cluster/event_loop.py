"""The event loops pdserve's processes run on: uvloop's where it is installed, asyncio's
own otherwise (Windows, where uvloop does not build).

The router streams every token of every request through its loop, and each worker's loop
carries its gRPC server and KV transfers, all beside CPU engines whose threads lose what
the loops spend. uvloop (libuv under asyncio's API; what uvicorn picks by default and what
vLLM's API server runs on) costs less per wake-up and per socket write than the pure-Python
selector loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

try:
    import uvloop
except ImportError:  # NOTE: an optional dependency (pyproject: not on Windows)
    uvloop = None

T = TypeVar("T")


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new event loop (not set as the thread's current one): uvloop's where installed."""
    return asyncio.new_event_loop() if uvloop is None else uvloop.new_event_loop()


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to its end on a new event loop, as ``asyncio.run`` does (the loop's
    async generators and default executor are shut down, then it is closed): uvloop's
    where installed. Returns ``main``'s result and raises what it raises."""
    return asyncio.run(main) if uvloop is None else uvloop.run(main)
