"""A private ``redis-server`` does not outlive its owner (entrypoints/redis_server.py): an
owner killed with SIGKILL takes its server, its watchdog and its working directory (the
config file holding the password) along; one that stops or restarts the server on purpose
leaves no watchdog behind and keeps the restarted server up."""

from __future__ import annotations

import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import redis
from polling import wait_until

from pdserve.entrypoints.redis_server import RedisServer

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(),
                                reason="tells live processes from /proc/PID/stat")
START_TIMEOUT_S = 60.0  # the owner's imports and RedisServer's own 10 s start bound

OWNER = textwrap.dedent("""\
    import sys, time
    from pdserve.entrypoints.redis_server import RedisServer
    server = RedisServer()
    print(server.pid, server._watchdog.pid, server._dir.name, flush=True)
    time.sleep(120)
""")


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (not gone, not a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat.rsplit(b")", 1)[1].split()[0] != b"Z"


def test_a_killed_owner_takes_its_server_and_directory_along():
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([owner.stdout], [], [], START_TIMEOUT_S)
        line = owner.stdout.readline() if ready else ""  # NOTE: "" too when the owner failed
        assert line, f"the owner did not start a server (exit status {owner.poll()})"
        pids = [int(p) for p in line.split()[:2]]  # the server's, its watchdog's
        workdir = line.split()[2]
        assert all(map(running, pids)) and Path(workdir, "redis.conf").is_file()
        owner.send_signal(signal.SIGKILL)
        owner.wait(10)
        assert wait_until(lambda: not any(map(running, pids)), 15.0), \
            f"still running after the owner died: {[p for p in pids if running(p)]}"
        assert wait_until(lambda: not Path(workdir).exists(), 5.0)
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(10)


def test_stop_and_restart_leave_no_watchdog_and_keep_the_server():
    server = RedisServer()
    try:
        workdir = server._dir.name
        first_watchdog = server._watchdog
        server.restart()
        assert first_watchdog.poll() is not None  # told, and gone
        assert server._watchdog is not None and server._watchdog.poll() is None
        client = redis.Redis.from_url(server.url, socket_timeout=2.0)
        try:
            time.sleep(0.5)  # NOTE: time for a watchdog that misread its release to strike
            assert client.ping()
        finally:
            client.close()
        server_pid, last_watchdog = server.pid, server._watchdog
    finally:
        server.close()
    assert last_watchdog.poll() is not None and not running(server_pid)
    assert not Path(workdir).exists()
