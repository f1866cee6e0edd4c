"""The router's decode session: one ``DecodeSession`` stream to a decode worker that
carries all of this router's requests on it (decode.proto).

Streamed one request per RPC, every token of every request was a gRPC message of its own:
at 32 sequences a step, 32 messages to write in the worker and 32 to read in the router,
each a few tens of microseconds of Python on CPUs that the engine needs. On a session the
worker sends one message per engine step with every request's new tokens.

A request on a session behaves as a ``Decode`` call does for ``WorkerCalls.decode``: it is
iterated for ``DecodeResponse``s, fails with ``grpc.aio.AioRpcError`` (the worker's error
for it, or the session's own error when the stream breaks, e.g. ``UNAVAILABLE`` when the
worker dies: every request on it fails then, and each migrates), and ``cancel()`` aborts
it on the worker. A broken session is replaced by a new stream on the next request.

A request has no deadline: a stream that is merely long or slow is never taken for a
failed worker. When a request has heard nothing for ``stall_s`` seconds, the session asks
whether the worker is alive (``WorkerPool.is_alive``: its Health, with a timeout, a few
tries); one that is not is dead: the stream is dropped and every request on it fails with
``UNAVAILABLE`` (and migrates). One that is keeps its stream, and is asked again after
each further ``stall_s`` of silence.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import grpc

from pdserve.proto import decode_pb2

logger = logging.getLogger(__name__)
_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """An ``AioRpcError`` as a failed call raises it."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class DecodeSession:
    """This router's stream of requests to one decode worker.

    Args:
        stub: the worker's ``DecodeWorkerStub``.
        metadata: returns the call's metadata (the cluster credentials) or None; called
            each time a stream is opened.
        name: the worker's id, for errors and logs.
        stall_s: seconds a request may hear nothing before ``alive`` is asked.
        alive: returns whether the worker is alive (answers Health, within a bounded
            time); False fails every request on the stream with ``UNAVAILABLE``.
    """

    def __init__(self, stub, metadata: Callable[[], object], name: str, stall_s: float,
                 alive: Callable[[], Awaitable[bool]]) -> None:
        self.stub = stub
        self.metadata = metadata
        self.name = name
        self.stall_s = stall_s
        self.alive = alive
        self._call = None
        self._requests: dict[str, SessionRequest] = {}
        self._outbox: asyncio.Queue | None = None
        self._tasks: list[asyncio.Task] = []

    @property
    def num_requests(self) -> int:
        """Requests of this router running on the stream now."""
        return len(self._requests)

    def start(self, message: decode_pb2.DecodeRequest) -> SessionRequest:
        """Send ``message`` on the stream (opening one if there is none); the request's
        responses come from the returned ``SessionRequest`` (module docstring: no
        deadline while the worker is alive).

        Raises:
            ValueError: a request with this id is already on the stream.
        """
        request_id = message.request_id
        if request_id in self._requests:
            raise ValueError(f"request {request_id} is already on the decode session of "
                             f"{self.name}")
        if self._call is None:
            self._open()
        request = SessionRequest(self, request_id)
        self._requests[request_id] = request
        self._outbox.put_nowait(decode_pb2.DecodeSessionRequest(decode=message))
        return request

    def cancel(self, request_id: str) -> None:
        """Abort ``request_id`` on the worker (once); its updates are dropped from now on."""
        if self._requests.pop(request_id, None) is not None and self._call is not None:
            self._outbox.put_nowait(decode_pb2.DecodeSessionRequest(
                cancel_request_id=request_id))

    def finished(self, request_id: str) -> None:
        """The worker ended ``request_id`` itself (finished or failed): forget it."""
        self._requests.pop(request_id, None)

    def close(self) -> None:
        """End the stream; requests still on it fail with ``CANCELLED``."""
        self._break(rpc_error(grpc.StatusCode.CANCELLED, "the router closed the session"))

    def fail(self, error: grpc.aio.AioRpcError) -> None:
        """The worker is dead: drop the stream (a worker that comes back cancels every
        request of it) and fail every request on it with ``error``."""
        self._break(error)

    def _open(self) -> None:
        self._call = self.stub.DecodeSession(metadata=self.metadata())
        self._outbox = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._write(self._call, self._outbox)),
                       loop.create_task(self._read(self._call))]

    async def _write(self, call, outbox: asyncio.Queue) -> None:
        try:
            while True:
                await call.write(await outbox.get())
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            # NOTE: the reader sees the same failure and fails the requests
            logger.debug("decode session to %s: write failed: %s", self.name, exc)

    async def _read(self, call) -> None:
        error = rpc_error(grpc.StatusCode.UNAVAILABLE,
                          f"the decode session to {self.name} ended")
        loop = asyncio.get_running_loop()
        try:
            async for response in call:
                now = loop.time()
                for update in response.updates:
                    request = self._requests.get(update.request_id)
                    if request is not None:
                        request.heard_at = now
                        request.queue.put_nowait(update)
        except grpc.aio.AioRpcError as exc:
            error = exc
        finally:
            if call is self._call:
                self._break(error)

    def _break(self, error: grpc.aio.AioRpcError) -> None:
        """Fail every request on the stream with ``error`` and drop the stream."""
        call, self._call = self._call, None
        requests, self._requests = self._requests, {}
        for request in requests.values():
            request.queue.put_nowait(error)
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        self._tasks = []
        if call is not None:
            call.cancel()


class SessionRequest:
    """One request on a ``DecodeSession``: an async iterator of ``DecodeResponse``s that
    raises ``grpc.aio.AioRpcError`` as a failed ``Decode`` call would. ``heard_at``: the
    loop time of its last message from the worker (the stall watch's start)."""

    __slots__ = ("_probe", "_timer", "done", "heard_at", "queue", "request_id", "session")

    def __init__(self, session: DecodeSession, request_id: str) -> None:
        self.session = session
        self.request_id = request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.done = False
        loop = asyncio.get_running_loop()
        self.heard_at = loop.time()
        self._probe: asyncio.Task | None = None
        # NOTE: one timer per stall interval, not a timeout per message: a message costs
        # the reader one clock read
        self._timer = loop.call_later(session.stall_s, self._check_stall)

    def _check_stall(self) -> None:
        """Past ``stall_s`` of silence, ask whether the worker is alive; else wait on."""
        if self.done:
            return
        loop = asyncio.get_running_loop()
        silent_s = loop.time() - self.heard_at
        if silent_s < self.session.stall_s:
            self._timer = loop.call_later(self.session.stall_s - silent_s, self._check_stall)
        else:
            self._probe = loop.create_task(self._probe_worker())

    async def _probe_worker(self) -> None:
        alive = await self.session.alive()
        if self.done:
            return
        silent_s = asyncio.get_running_loop().time() - self.heard_at
        if alive:  # merely slow: ask again after another stall interval of silence
            self._timer = asyncio.get_running_loop().call_later(self.session.stall_s,
                                                                self._check_stall)
            return
        logger.warning("decode worker %s is dead: request %s heard nothing for %.1f s and "
                       "the worker does not answer Health", self.session.name,
                       self.request_id, silent_s)
        self.session.fail(rpc_error(
            grpc.StatusCode.UNAVAILABLE,
            f"decode worker {self.session.name} sent nothing for {silent_s:.1f} s and did "
            "not answer Health"))

    def __aiter__(self) -> SessionRequest:
        return self

    async def __anext__(self) -> decode_pb2.DecodeResponse:
        if self.done:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, grpc.aio.AioRpcError):
            self._end(cancel=True)  # NOTE: a no-op once the stream broke
            raise item
        if item.error_code:
            self._end(cancel=False)
            raise rpc_error(_STATUS_CODES.get(item.error_code, grpc.StatusCode.UNKNOWN),
                            item.error_details)
        if item.response.finish_reason:
            self._end(cancel=False)
        return item.response

    def cancel(self) -> None:
        """Abort the request on the worker unless it already ended."""
        if not self.done:
            self._end(cancel=True)

    def _end(self, cancel: bool) -> None:
        self.done = True
        self._timer.cancel()
        if self._probe is not None and self._probe is not asyncio.current_task():
            self._probe.cancel()
        if cancel:
            self.session.cancel(self.request_id)
        else:
            self.session.finished(self.request_id)


__all__ = ["DecodeSession", "SessionRequest", "rpc_error"]
