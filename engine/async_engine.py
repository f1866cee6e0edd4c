"""An ``LLMEngine`` stepped in its own thread, driven from asyncio (the shape of vLLM's
``AsyncLLM``, minus the extra process).

All engine calls run on the engine thread, between steps, so the engine needs no locks:
``call(fn)`` queues ``fn(engine)`` and awaits its result. ``generate`` streams one
request's ``EngineOutput``s. A step that raises fails the requests in flight (their
streams raise ``EngineError``) and the loop goes on serving.

A queued command carries its caller's cancellation (STYLE.md, ownership): if the caller
is gone (cancelled, or timed out) before the engine thread takes the command, it is
dropped; if the command already ran, its ``undo`` runs on the engine thread with the
result, so whatever it allocated is freed. Between steps the engine thread also expires
KV leases (``LLMEngine.expire_leases``) and audits block ownership (``ownership``).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from pdserve.engine.engine_outputs import BlockOwnership, EngineOutput
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.tp_executor import RankFailedError

logger = logging.getLogger(__name__)
T = TypeVar("T")
_LEASE_CHECK_INTERVAL_S = 0.1
_AUDIT_INTERVAL_S = 0.5  # O(blocks in use) on the engine thread


class EngineError(RuntimeError):
    """The engine failed while running a request; the request has been aborted."""


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; no request can be served."""


class AsyncEngine:
    """Owns ``engine`` and the thread that steps it.

    Args:
        engine: the engine; only the engine thread touches it once ``start`` is called.
        name: the thread's name (for logs).
    """

    def __init__(self, engine: LLMEngine | None, name: str = "engine") -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()  # a command's taken / dropped flags
        self._next_lease_check = self._next_audit = 0.0
        self._ownership = BlockOwnership(0, 0, 0, 0)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    @classmethod
    def build(cls, factory: Callable[[], LLMEngine], name: str = "engine",
              timeout_s: float = 3600.0) -> AsyncEngine:
        """Build the engine with ``factory()`` on the engine thread itself, then step it
        there; returns once it is built (a blocking call: run it off an event loop).

        An OpenMP parallel region runs on a team that belongs to the thread starting it,
        and libgomp stops spinning at barriers once the threads of all teams outnumber the
        CPUs. A model loaded (weights packed, KV cache zeroed) on any other thread that
        lives on leaves that thread's team behind, and the engine's team then sleeps and
        wakes at nearly every barrier of every step: on a 2-core CPU, 167 futex waits per
        decode step and 41 -> 48 ms per step of W1's model. Built here, the engine's own
        team does that work too, and the weights are first touched by the threads that
        will read them.

        Raises:
            TimeoutError: not built within ``timeout_s`` seconds (the thread stops once
                ``factory`` returns).
            Exception: whatever ``factory`` raised.
        """
        engine = cls(None, name)
        built = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            try:
                engine.engine = factory()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                failure.append(exc)
            finally:
                built.set()
            if not failure and not engine._stop.is_set():
                engine._run()

        engine._thread = threading.Thread(target=run, name=name, daemon=True)
        engine._thread.start()
        if not built.wait(timeout_s):
            engine._stop.set()
            raise TimeoutError(f"the engine was not built within {timeout_s} s")
        if failure:
            engine._thread.join()
            raise failure[0]
        return engine

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the thread (requests in flight are aborted); waits at most ``timeout_s``."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    @property
    def ownership(self) -> BlockOwnership:
        """The KV ownership audit, taken on the engine thread between steps at most
        ``_AUDIT_INTERVAL_S`` seconds ago (readable from any thread)."""
        return self._ownership

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    async def call(self, fn: Callable[[LLMEngine], T], timeout_s: float = 30.0,
                   undo: Callable[[LLMEngine, T], Any] | None = None) -> T:
        """Run ``fn(engine)`` on the engine thread between steps and return its result.

        If this call is cancelled or times out, ``fn`` is dropped when it has not started;
        when it has, ``undo(engine, result)`` runs on the engine thread instead of the
        result reaching anyone (if ``fn`` raised, nothing is undone). Wrap a clean-up call
        in ``asyncio.shield`` so that it runs even if its caller is cancelled.

        Raises:
            EngineDeadError: the engine thread is not running.
            TimeoutError: no result within ``timeout_s`` seconds.
            Exception: whatever ``fn`` raised.
        """
        if not self.alive:
            raise EngineDeadError("the engine thread is not running")
        loop = asyncio.get_running_loop()
        command = _Command(fn, undo, loop, loop.create_future())
        self._commands.put(command)
        self._wake.set()
        try:
            done, _ = await asyncio.wait({command.future}, timeout=timeout_s)
        except BaseException:
            self._give_up(command)
            raise
        if not done:
            self._give_up(command)
            raise TimeoutError(f"the engine did not answer within {timeout_s} s")
        return command.future.result()

    def post(self, fn: Callable[[LLMEngine], Any]) -> None:
        """Queue ``fn(engine)`` with no one waiting for it (thread-safe, never blocks):
        clean-up from places that cannot await, such as a generator being closed."""
        self._commands.put(_Command(fn, None, None, None))
        self._wake.set()

    def _give_up(self, command: _Command) -> None:
        """The caller of ``command`` is gone (runs on its event loop)."""
        with self._lock:
            command.dropped = True
            taken = command.taken
        if not taken:
            return  # the engine thread will skip it
        future = command.future
        if future.done():
            if not future.cancelled() and future.exception() is None:
                self._undo(command, future.result())  # delivered, but nobody took it
            return
        future.cancel()  # _deliver_result sees it and undoes

    def _undo(self, command: _Command, result: Any) -> None:
        if command.undo is not None:
            undo = command.undo
            self.post(lambda e: undo(e, result))

    def _deliver_result(self, command: _Command, result: Any) -> None:
        """On the caller's loop: hand ``result`` over, or undo it if the caller left."""
        if command.future.done():
            self._undo(command, result)
        else:
            command.future.set_result(result)

    def open_stream(self, request_id: str) -> asyncio.Queue:
        """Register the queue that receives ``request_id``'s outputs (call in the loop)."""
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        return stream

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    async def stream_outputs(self, request_id: str, stream: asyncio.Queue,
                             timeout_s: float | None = None) -> AsyncIterator[EngineOutput]:
        """Yield outputs from ``stream`` until one is finished; aborts the request in the
        engine if the consumer stops early (a cancelled RPC, a closed connection).

        Raises:
            EngineError: the engine failed this request.
            TimeoutError: no output for ``timeout_s`` seconds (then the request is aborted).
        """
        finished = False
        try:
            while True:
                item = await asyncio.wait_for(stream.get(), timeout_s)
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self.close_stream(request_id)
            if not finished and self.alive:
                self.post(lambda e: e.abort_request(request_id))

    async def generate(self, request_id: str, prompt_token_ids: list[int], sampling_params,
                       cache_salt: str | None = None, remote_decode: bool = False,
                       timeout_s: float | None = None, resume_token_ids: Sequence[int] = (),
                       kv_consumer: str | None = None, priority: int = 0
                       ) -> AsyncIterator[EngineOutput]:
        """Add a request and stream its outputs (see ``LLMEngine.add_request``). Leaving
        at any point, even while the request is being added, aborts it."""
        await self.compile_grammar(sampling_params)
        stream = self.open_stream(request_id)
        try:
            await self.call(lambda e: e.add_request(request_id, prompt_token_ids,
                                                    sampling_params, cache_salt, remote_decode,
                                                    resume_token_ids, kv_consumer,
                                                    priority),
                            undo=lambda e, _: e.abort_request(request_id))
        except BaseException:
            self.close_stream(request_id)
            raise
        outputs = self.stream_outputs(request_id, stream, timeout_s)
        try:
            async for output in outputs:
                yield output
        finally:
            await outputs.aclose()  # runs its clean-up now, not at garbage collection

    async def compile_grammar(self, sampling_params) -> None:
        """Compile ``sampling_params.structured_output`` (if any) in a worker thread, so
        that adding the request finds it in the compiler's cache and the engine thread
        never waits for a compilation.

        Raises:
            ValueError: it does not compile (``LLMEngine.compile_grammar``).
        """
        if sampling_params.structured_output is not None:
            await asyncio.to_thread(self.engine.compile_grammar,
                                    sampling_params.structured_output)

    async def abort(self, request_id: str) -> bool:
        """Abort a request wherever it is; its stream ends with ``finish_reason="abort"``."""
        aborted = await self.call(lambda e: e.abort_request(request_id))
        entry = self._streams.get(request_id)
        if aborted and entry is not None:
            _, stream = entry
            stream.put_nowait(_aborted_output(request_id))
        return aborted

    # The engine thread.

    def _run(self) -> None:
        try:
            self.engine.bind_threads()
        except Exception as exc:  # NOTE: a bad CPU list fails every request, loudly
            logger.exception("binding the engine's CPU threads failed")
            self._stop.set()
            self._fail_all(exc)
            return
        while not self._stop.is_set():
            self._run_commands()
            self._housekeeping()
            # NOTE: requests that only wait for their KV (a decode worker's pulls) give a
            # step nothing to do: stepping anyway spun this thread, holding the GIL that
            # the event loop and the pulls' threads need (seconds of lag with dozens)
            if not self.engine.has_schedulable_requests():
                self._wake.wait(self._idle_wait_s())
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except RankFailedError as exc:  # NOTE: the whole worker is dead (tp_executor)
                logger.critical("engine stopped: %s", exc)
                self._stop.set()
                self._fail_all(EngineDeadError(f"the engine stopped: {exc}"))
                break
            except Exception as exc:
                logger.exception("engine step failed")
                self._fail_all(exc)
                continue
            self._deliver_step(outputs)
        self._run_commands()  # clean-ups queued before the stop
        self._fail_all(EngineDeadError("the engine is shutting down"))
        self.engine.shutdown()

    def _idle_wait_s(self) -> float:
        """How long the idle engine thread sleeps: until its next lease check while it
        holds leases, else until its next audit. A command or a request wakes it at once;
        an idle worker wakes twice a second, not twenty times, beside the engines on its
        cores."""
        deadline = self._next_audit
        if self.engine.kv_cache_manager.held:
            deadline = min(deadline, self._next_lease_check)
        return min(max(0.0, deadline - time.monotonic()), _AUDIT_INTERVAL_S)

    def _housekeeping(self) -> None:
        """Every ``_LEASE_CHECK_INTERVAL_S``, unpin expired leases; every
        ``_AUDIT_INTERVAL_S``, take the ownership audit that ``ownership`` reports."""
        now = time.monotonic()
        if now >= self._next_lease_check:
            self._next_lease_check = now + _LEASE_CHECK_INTERVAL_S
            for request_id in self.engine.expire_leases(now):
                logger.info("KV lease of %s expired; its blocks are unpinned", request_id)
        if now >= self._next_audit:
            self._next_audit = now + _AUDIT_INTERVAL_S
            self._ownership = self.engine.ownership()

    def _run_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            with self._lock:
                if command.dropped:
                    continue
                command.taken = True
            try:
                result: Any = command.fn(self.engine)
            except Exception as exc:  # handed to the caller
                if command.future is None:
                    logger.exception("engine clean-up command failed")
                else:
                    _call_soon(command.loop, _set_exception, command.future, exc)
            else:
                if command.future is not None:
                    _call_soon(command.loop, self._deliver_result, command, result)

    def _deliver(self, request_id: str, item: Any) -> None:
        entry = self._streams.get(request_id)
        if entry is not None:
            loop, stream = entry
            _call_soon(loop, stream.put_nowait, item)

    def _deliver_step(self, outputs: Sequence[EngineOutput]) -> None:
        """Hand a step's outputs to their streams with one wake-up per event loop, not
        one per request (each ``call_soon_threadsafe`` writes the loop's self-pipe)."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, EngineOutput]]] = {}
        for output in outputs:
            entry = self._streams.get(output.request_id)
            if entry is not None:
                loop, stream = entry
                batches.setdefault(loop, []).append((stream, output))
        for loop, batch in batches.items():
            _call_soon(loop, _put_all, batch)

    def _fail_all(self, exc: Exception) -> None:
        for request_id in list(self.engine.scheduler.requests):
            self.engine.abort_request(request_id)
            # NOTE: a dead engine's requests fail as UNAVAILABLE, so the router moves them
            error = EngineDeadError if isinstance(exc, EngineDeadError) else EngineError
            self._deliver(request_id, error(f"request {request_id} failed: {exc}"))


@dataclass(slots=True, eq=False)
class _Command:
    """``fn(engine)`` queued for the engine thread, and the caller's future (None for
    ``post``). ``taken``: the engine thread started it; ``dropped``: the caller left."""

    fn: Callable[[LLMEngine], Any]
    undo: Callable[[LLMEngine, Any], Any] | None
    loop: asyncio.AbstractEventLoop | None
    future: asyncio.Future | None
    taken: bool = False
    dropped: bool = False


def _aborted_output(request_id: str) -> EngineOutput:
    return EngineOutput(request_id, [], [], True, "abort", None, 0, 0)


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    """``loop.call_soon_threadsafe`` that drops the call if the caller's loop has closed
    (its caller is gone; the engine thread must not die of it)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        logger.debug("dropped a result for a closed event loop")


def _put_all(batch: list[tuple[asyncio.Queue, Any]]) -> None:
    for stream, item in batch:
        stream.put_nowait(item)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
