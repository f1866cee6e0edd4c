"""The router's HTTP and gRPC APIs on one event loop, as ``pdserve serve`` and ``python -m
pdserve.router`` both run them: their ports held from the start (``bind_listener``), then
served until SIGINT or SIGTERM (``run_router``)."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable


class StartupError(RuntimeError):
    """Start-up cannot begin (a port is taken); ``pdserve`` prints it and exits with 2."""


def bind_listener(host: str, port: int, what: str) -> socket.socket:
    """A TCP socket bound to ``host:port`` and listening (SO_REUSEADDR; not inherited by
    children), so no other process can take the port while pdserve starts.

    Raises:
        StartupError: the address is taken or not this machine's; the message names it.
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise StartupError(f"cannot listen on {_address(host, port)} ({what}): "
                           f"{exc.strerror or exc}") from None
    return sock


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def run_router(router, app, host: str, http_sock: socket.socket,
                     grpc_sock: socket.socket | None, note: str = "",
                     on_serving: Callable[[], None] | None = None, *,
                     grpc_limits=None, log_level: str = "warning") -> None:
    """Serve ``app`` (HTTP) on the listening ``http_sock`` and, with a ``grpc_sock``, the
    gRPC API of ``router`` (a ``ModelService``, or ``ServedModels`` for several models) on its port,
    on one event loop until SIGINT/SIGTERM.

    Prints ``pdserve serving ...`` and calls ``on_serving()`` once both accept
    connections. ``grpc_sock`` only holds the port: it is closed right before the gRPC
    server binds the same port (grpc cannot take a bound socket). The gRPC API accepts
    the HTTP app's API keys (``app.state.api_auth``, from ``build_app``), is bounded by
    ``grpc_limits`` (a ``GRPCLimits``; its defaults when None), and counts its expired
    deadlines in ``app.state.grpc_metrics`` (on ``/metrics``). ``log_level``: uvicorn's.
    """
    import uvicorn

    from pdserve.router.grpc_server import start_grpc_server
    from pdserve.router.http_server import uvicorn_config
    from pdserve.router.served_models import ServedModels

    routers = router if isinstance(router, ServedModels) else ServedModels([router])

    class AnnouncingServer(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if self.started and not self.should_exit:
                print(line, flush=True)
                if on_serving is not None:
                    on_serving()

    grpc_server = None
    grpc_note = ""
    try:
        if grpc_sock is not None:
            grpc_port = grpc_sock.getsockname()[1]
            grpc_sock.close()
            grpc_server, grpc_port = await start_grpc_server(
                routers, host, grpc_port, api_auth=getattr(app.state, "api_auth", None),
                admin_auth=getattr(app.state, "admin_auth", None),
                limits=grpc_limits,
                metrics=app.state.grpc_metrics)
            grpc_note = f", gRPC {_address(host, grpc_port)}"
        names = ", ".join(r.served_model_name for r in routers)
        line = (f"pdserve serving {names} on "
                f"http://{_address(host, http_sock.getsockname()[1])}/v1{grpc_note} {note}")
        server = AnnouncingServer(uvicorn_config(app, log_level=log_level))
        with contextlib.suppress(KeyboardInterrupt):
            # NOTE: uvicorn stops on SIGINT/SIGTERM, then raises that signal again
            await server.serve(sockets=[http_sock])
    finally:
        if grpc_server is not None:
            await grpc_server.stop(2)
