"""The router's HTTP server: uvicorn, with deadlines on a client's side of an exchange.

uvicorn bounds the idle time between two requests on a kept-alive connection
(``timeout_keep_alive``) but not the time a request takes to arrive: its keep-alive timer
stops at a request's first byte, and nothing bounds the rest. A client that sends a
request line and then one header byte a minute, or headers and then a trickle of body,
holds its connection, a file descriptor and (for the body) a handler for as long as it
likes; a few thousand such clients ("Slowloris", CVE-2007-6750) use up the router's
connections without ever passing the API key check, which runs once the request is in.
ASGI middleware cannot help: the app sees nothing before the headers are complete. The
other way round, a client that stops reading a stream leaves its tokens piling up in the
router (a request may ask for 256 sequences), with no end.

``TimedH11Protocol`` is uvicorn's h11 protocol with three deadlines, as nginx sets them
(``client_header_timeout``, ``client_body_timeout``, ``send_timeout``; uvicorn's own issue
#157 proposes the first two):

- **header**: a request's line and headers arrive within ``header_timeout_s`` of the
  connection's opening, or of the previous response's end on a kept-alive connection;
- **body**: its body arrives within ``body_timeout_s`` of its headers;
- **send**: a client takes the response's bytes: the connection's write buffer, once over
  its high-water mark (asyncio's flow control, which pauses the app's writes), drains
  below it within ``send_timeout_s``.

Nothing times the router's own side: a stream may last as long as its generation does,
and a long wait for a first token is no timeout. On a deadline the connection is closed
(aborted, for **send**: what the client did not take is dropped; the app sees the client
leave, and the request is cancelled on the workers as for any disconnect); a client
that had sent part of its headers first gets ``408 Request Timeout`` (an OpenAI error
body), one that had sent nothing gets a plain close (as uvicorn closes an idle kept-alive
connection, so that a client sending its next request just then sees a closed connection,
not an answer to a request it never sent). A body cut short reaches the app as a client
disconnect. Each expiry counts in ``pdserve:http_request_timeouts_total{phase}``.
"""

from __future__ import annotations

import asyncio
import logging
import time

import h11
import uvicorn
from prometheus_client import CollectorRegistry, Counter
from uvicorn.protocols.http.h11_impl import H11Protocol

from pdserve.router.config import HTTPLimits
from pdserve.router.protocol import error_response

logger = logging.getLogger(__name__)

# NOTE: TimedH11Protocol overrides these, and reads the instance's ``conn`` (h11) and
# ``cycle``; checked with uvicorn 0.29 and 0.54 (pyproject's bounds)
_OVERRIDDEN = ("connection_made", "data_received", "on_response_complete",
               "handle_websocket_upgrade", "connection_lost", "pause_writing",
               "resume_writing")
if _missing := [name for name in _OVERRIDDEN if not callable(getattr(H11Protocol, name, None))]:
    raise ImportError(f"uvicorn {uvicorn.__version__}'s H11Protocol has no {_missing}: "
                      "pdserve's router needs uvicorn >=0.29,<1")

TIMEOUT_PHASES = ("header", "body", "send")
_WARN_EVERY_S = 60.0  # at most one warning a minute about expired deadlines




class HTTPServerMetrics:
    """Metrics of the HTTP server itself, not of one model's router: its own
    ``CollectorRegistry``, merged into ``/metrics`` beside the routers'.

    ``pdserve:http_request_timeouts_total{phase}``: connections closed because a request's
    headers (``phase="header"``) or body (``"body"``) did not arrive in time, or because
    the client took no bytes of its response in time (``"send"``).
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._timeouts = Counter(
            "pdserve:http_request_timeouts", "Connections closed because a request's "
            "headers or body did not arrive, or its response was not taken, within its "
            "deadline", ["phase"],
            registry=self.registry)
        for phase in TIMEOUT_PHASES:
            self._timeouts.labels(phase=phase)
        self._warned_at = -_WARN_EVERY_S
        self._warned_counts = self.counts()

    def counts(self) -> dict[str, int]:
        """Expired deadlines so far, by phase (read from the counter)."""
        return {phase: int(self.registry.get_sample_value(
            "pdserve:http_request_timeouts_total", {"phase": phase}) or 0)
            for phase in TIMEOUT_PHASES}

    def request_timed_out(self, phase: str, limit_s: float) -> None:
        """Count one expired ``phase`` deadline of ``limit_s`` seconds; warn in the log
        at most once a minute with what expired since the last warning."""
        self._timeouts.labels(phase=phase).inc()
        now = time.monotonic()
        if now - self._warned_at >= _WARN_EVERY_S:
            counts = self.counts()
            new = {p: counts[p] - self._warned_counts[p] for p in TIMEOUT_PHASES}
            logger.warning("closed %d connection(s) whose request headers and %d whose "
                           "body did not arrive in time, and %d that took no bytes of "
                           "their response in time (latest: %s, %g s)",
                           new["header"], new["body"], new["send"], phase, limit_s)
            self._warned_at, self._warned_counts = now, counts


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the deadlines of ``timeouts``, counted in ``metrics``
    (module docstring); ``timed_h11_protocol`` makes a subclass that sets both."""

    timeouts: HTTPLimits
    metrics: HTTPServerMetrics
    _deadline: asyncio.TimerHandle | None = None
    _phase: str | None = None
    _send_deadline: asyncio.TimerHandle | None = None
    _partial_request = False  # bytes of the next request's headers have arrived

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm("header")

    def data_received(self, data: bytes) -> None:
        if self._phase == "header" and data:
            self._partial_request = True
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm("header")  # the next request on this kept-alive connection
            self._follow()  # unless a pipelined one is in already

    def handle_websocket_upgrade(self, event) -> None:
        self._disarm()  # another protocol takes the connection over
        super().handle_websocket_upgrade(event)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._disarm_send()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_deadline is None:
            self._send_deadline = self.loop.call_later(
                self.timeouts.send_timeout_s, self._send_expired)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._disarm_send()

    def _disarm_send(self) -> None:
        if self._send_deadline is not None:
            self._send_deadline.cancel()
            self._send_deadline = None

    def _send_expired(self) -> None:
        self._send_deadline = None
        if self.transport.is_closing():
            return
        self.metrics.request_timed_out("send", self.timeouts.send_timeout_s)
        self.transport.abort()  # close() would wait for the client to take the rest

    def _follow(self) -> None:
        """Move the deadline along with the client's side of the exchange."""
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            if self._phase != "body":
                self._arm("body")
        elif state is not h11.IDLE and self.cycle is not None \
                and not self.cycle.response_complete:
            self._disarm()  # the request is in; the answer takes what it takes

    def _arm(self, phase: str) -> None:
        self._disarm()
        limits = self.timeouts
        limit = limits.header_timeout_s if phase == "header" else limits.body_timeout_s
        self._phase = phase
        self._partial_request = False
        self._deadline = self.loop.call_later(limit, self._expired, phase, limit)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline, self._phase = None, None

    def _expired(self, phase: str, limit_s: float) -> None:
        self._deadline, self._phase = None, None
        if self.transport.is_closing():
            return
        self.metrics.request_timed_out(phase, limit_s)
        if phase == "header" and self._partial_request and \
                self.conn.our_state is h11.IDLE:
            self.transport.write(_request_timeout_response(limit_s))
        self.transport.close()


def timed_h11_protocol(timeouts: HTTPLimits,
                       metrics: HTTPServerMetrics) -> type[H11Protocol]:
    """uvicorn's h11 ``asyncio.Protocol`` with ``timeouts`` (module docstring), counting
    expiries in ``metrics``; pass it as ``uvicorn.Config(http=...)``."""
    return type("TimedH11Protocol", (TimedH11Protocol,),
                {"timeouts": timeouts, "metrics": metrics})


def _request_timeout_response(limit_s: float) -> bytes:
    """A whole ``408 Request Timeout`` HTTP/1.1 response, written past h11 (its state
    machine answers only a request it has received) right before the connection closes."""
    body = error_response(
        408, f"the request's headers did not arrive within {limit_s:g} s").model_dump_json()
    head = ("HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode("ascii") + body.encode()


def uvicorn_config(app, **kwargs):
    """A ``uvicorn.Config`` serving ``app`` (from ``build_app``) with its request deadlines
    (``app.state.http_timeouts``) counted in its ``app.state.http_metrics``; ``kwargs``
    go to ``uvicorn.Config`` (host, port, log_level...)."""
    return uvicorn.Config(app, http=timed_h11_protocol(app.state.http_timeouts,
                                                       app.state.http_metrics), **kwargs)


def serve_app(app, **kwargs) -> None:
    """Serve ``app`` until SIGINT or SIGTERM, as ``uvicorn.run`` does, with
    ``uvicorn_config(app, **kwargs)``."""
    uvicorn.Server(uvicorn_config(app, **kwargs)).run()
