"""deploy/slurm: both scripts parse, always; the end-to-end run on a one-node Slurm cluster
of its own (``deploy/slurm/run-local.sh``) only when asked for with ``PDSERVE_TEST_SLURM=1``,
as root, with slurm-wlm and munge installed: it starts root daemons (munged, slurmctld,
slurmd) and takes minutes, which the default test run must not."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

SLURM_DIR = Path(__file__).resolve().parents[1] / "deploy" / "slurm"
DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "sbcast", "scancel", "squeue",
           "sinfo")


@pytest.mark.parametrize("script", ["pdserve.sbatch", "run-local.sh"])
def test_script_parses(script):
    result = subprocess.run(["bash", "-n", str(SLURM_DIR / script)], capture_output=True,
                            text=True, timeout=30, check=False)
    assert result.returncode == 0, result.stderr


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("PDSERVE_TEST_SLURM") != "1",
                    reason="starts root Slurm daemons and takes minutes: PDSERVE_TEST_SLURM=1")
def test_run_local_serves_and_cancels_cleanly():
    missing = [tool for tool in DAEMONS if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"not installed: {', '.join(missing)} (apt-get install slurm-wlm munge)")
    if os.geteuid() != 0:
        pytest.skip("run-local.sh runs munged, slurmctld and slurmd as root")
    result = subprocess.run([str(SLURM_DIR / "run-local.sh")], capture_output=True, text=True,
                            timeout=1800, check=False)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    assert "run-local: PASSED" in result.stdout


# The batch script on a fake allocation (tests/fake_slurm/): three nodes, each a mount
# namespace whose node-local storage the others do not see; real Redis and bash, stand-ins
# for Slurm's commands, Ray and pdserve serve.

FAKE = Path(__file__).resolve().parent / "fake_slurm"
NODES = ("head", "n1", "n2")
JOB_ID = "4242"
RAY_STOP_S = 2.0  # each fake Ray node's stop time


def _can_unshare() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "true"],
                           capture_output=True, timeout=30, check=False)
    return probe.returncode == 0


fake_allocation = pytest.mark.skipif(not _can_unshare(),
                                     reason="needs mount namespaces (unshare -m, as root)")


class FakeJob:
    """``pdserve.sbatch`` running as job ``JOB_ID`` on ``NODES``; ``node(name)`` is that
    node's local storage (``PDSERVE_LOCAL_DIR`` there)."""

    def __init__(self, tmp_path: Path, env: dict[str, str] | None = None,
                 squat: str | None = None) -> None:
        from pdserve.entrypoints.redis_server import free_port

        self.state = tmp_path / "slurm"
        for sub in ("steps", *(f"nodes/{n}" for n in NODES)):
            (self.state / sub).mkdir(parents=True)
        if squat is not None:  # the job's folder on that node, made by nobody (65534)
            self.folder(squat).mkdir(mode=0o777)
            os.chown(self.folder(squat), 65534, 65534)
        (self.state / "state").write_text("RUNNING\n")
        (self.state / "ray-nodes").write_text("")
        self.local = tmp_path / "local"  # the mount point every node has its own of
        self.local.mkdir()
        shared = tmp_path / "shared"
        shared.mkdir()
        (shared / "keys").write_text("sk-client-key-0123\n")
        (shared / "admin-keys").write_text("sk-admin-key-4567\n")
        self.out = tmp_path / "job.out"
        pythonpath = [str(FAKE / "python"), *filter(None, [os.environ.get("PYTHONPATH")])]
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PDSERVE_"))},
            "PATH": f"{FAKE / 'bin'}:{os.environ['PATH']}",
            "PYTHONPATH": os.pathsep.join(pythonpath),
            "FAKE_SLURM": str(self.state), "FAKE_NODES": ",".join(NODES),
            "FAKE_RAY_STOP_S": str(RAY_STOP_S),
            "SLURM_JOB_ID": JOB_ID, "SLURM_JOB_NODELIST": ",".join(NODES),
            "PDSERVE_LOCAL_DIR": str(self.local),
            "PDSERVE_API_KEY_FILE": str(shared / "keys"),
            "PDSERVE_ADMIN_API_KEY_FILE": str(shared / "admin-keys"),
            "PDSERVE_PORT": str(free_port()), "PDSERVE_GRPC_PORT": str(free_port()),
            "PDSERVE_REDIS_PORT": str(free_port()), "PDSERVE_RAY_PORT": str(free_port()),
            "PDSERVE_RAY_TIMEOUT_S": "60", "PDSERVE_START_TIMEOUT_S": "60",
            "PDSERVE_STOP_TIMEOUT_S": "20", **(env or {})}
        with open(self.out, "w") as out:
            self.proc = subprocess.Popen(
                ["unshare", "-m", "--propagation", "private", "bash", "-c",
                 'mount --bind "$1" "$2" && shift 2 && exec "$@"', "fake-batch",
                 str(self.state / "nodes" / NODES[0]), str(self.local),
                 "bash", str(SLURM_DIR / "pdserve.sbatch"), "/models/demo", "--dtype",
                 "float32"], stdout=out, stderr=subprocess.STDOUT, env=self.env)
        (self.state / "batch.pid").write_text(str(self.proc.pid))

    def node(self, name: str) -> Path:
        return self.state / "nodes" / name

    def folder(self, name: str) -> Path:
        return self.node(name) / f"pdserve-{JOB_ID}"

    def output(self) -> str:
        return self.out.read_text()

    def wait_ready(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while "pdserve ready at" not in self.output():
            assert self.proc.poll() is None, f"the job ended:\n{self.output()}"
            assert time.monotonic() < deadline, f"not ready:\n{self.output()}"
            time.sleep(0.2)

    def wait_end(self, timeout_s: float = 120) -> int:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"the job did not end:\n{self.output()}") from None

    def step_pids(self) -> list[int]:
        return [int(pid) for info in (self.state / "steps").glob("*/info")
                for pid in info.read_text().split()[1:]]

    def assert_nothing_left(self) -> None:
        """No step's task alive, and every node's local storage empty."""
        deadline = time.monotonic() + 30
        while alive := [p for p in self.step_pids() if _alive(p)]:
            assert time.monotonic() < deadline, f"still running: {alive}\n{self.output()}"
            time.sleep(0.2)
        for name in NODES:
            assert list(self.node(name).iterdir()) == [], (name, self.output())
        assert list(self.local.iterdir()) == []

    def kill_all(self) -> None:
        for pid in [self.proc.pid, *self.step_pids()]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):  # a zombie whose parent has not reaped it yet
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    return False


@pytest.fixture
def fake_job(tmp_path):
    jobs: list[FakeJob] = []

    def start(env: dict[str, str] | None = None, squat: str | None = None) -> FakeJob:
        jobs.append(FakeJob(tmp_path, env, squat))
        return jobs[-1]

    yield start
    for job in jobs:
        job.kill_all()


def _mode(path: Path) -> str:
    return oct(path.stat().st_mode & 0o777)


def secrets_on_command_lines(values: list[str]) -> list[str]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            text = cmdline.read_bytes().decode(errors="replace")
            found += [cmdline.parent.name for v in values if v in text]
    return found


@fake_allocation
@pytest.mark.parametrize("signum, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)],
                         ids=["time-limit-sigterm", "sigint"])
def test_secrets_stay_node_local_and_every_stop_removes_them(fake_job, signum, status):
    job = fake_job()
    job.wait_ready()
    # every node: a 0700 folder of its own holding the Ray token (0600) and Ray's temp
    # folder; the head alone also the Redis password, its config and the API keys
    token = None
    for name in NODES:
        folder = job.folder(name)
        assert _mode(folder) == "0o700", name
        assert _mode(folder / "ray-token") == "0o600", name
        token = token or (folder / "ray-token").read_text()
        assert (folder / "ray-token").read_text() == token and len(token) == 64
        assert (folder / "ray" / "session_fake").is_dir(), name
        expected = {"ray-token", "ray"}
        if name == "head":
            expected |= {"redis-password", "redis.conf", "api-keys", "admin-api-keys"}
        assert {p.name for p in folder.iterdir()} == expected, name
    head = job.folder("head")
    for secret in ("redis-password", "redis.conf", "api-keys", "admin-api-keys"):
        assert _mode(head / secret) == "0o600", secret
    served = json.loads((job.state / "pdserve.json").read_text())
    local = job.local / f"pdserve-{JOB_ID}"
    assert served["flags"]["--api-key-file"] == str(local / "api-keys")
    assert served["flags"]["--admin-api-key-file"] == str(local / "admin-api-keys")
    assert served["flags"]["--redis-password-file"] == str(local / "redis-password")
    assert set(served["file_modes"].values()) == {"0o600"}
    password = (head / "redis-password").read_text().strip()
    assert secrets_on_command_lines([token, password]) == []
    # the time limit's --signal=B:TERM (or a Ctrl-C) reaches the batch script alone
    job.proc.send_signal(signum)
    assert job.wait_end() == status
    out = job.output()
    assert "pdserve stopped" in out and "pdserve-slurm: node-local stopped" in out
    job.assert_nothing_left()
    # the Ray workers were stopped together: each had its SIGTERM before either ended
    events = [line.split() for line in (job.state / "ray-stops").read_text().splitlines()]
    workers = [e for e in events if e[0] in ("n1", "n2")]
    terms = [float(t) for node, what, t in workers if what == "term"]
    exits = [float(t) for node, what, t in workers if what == "exit"]
    assert len(terms) == len(exits) == 2 and max(terms) < min(exits), events
    # ... and the head after them
    head_term = next(float(t) for node, what, t in events if node == "head" and what == "term")
    assert head_term >= max(exits)


@fake_allocation
def test_a_cancelled_job_removes_the_secrets_on_every_node(fake_job):
    job = fake_job()
    job.wait_ready()
    assert all(job.folder(name).is_dir() for name in NODES)
    # scancel JOB: Slurm sends SIGTERM to every step and to the batch script at once
    subprocess.run([str(FAKE / "bin" / "scancel"), JOB_ID], env=job.env, check=True,
                   timeout=30)
    job.wait_end()
    assert "job state CANCELLED" in job.output()
    job.assert_nothing_left()


@fake_allocation
def test_a_failed_start_removes_the_secrets_on_every_node(fake_job):
    job = fake_job({"FAKE_PDSERVE_FAIL": "1"})
    assert job.wait_end() == 1
    assert "its step ended before it came up" in job.output()
    job.assert_nothing_left()


@fake_allocation
def test_a_folder_someone_else_made_stops_the_job_before_any_secret(fake_job):
    job = fake_job(squat="n1")  # another user's folder, made before the job, open to all
    assert job.wait_end() == 1
    assert "node-local storage" in job.output()
    squatted = job.folder("n1")
    assert squatted.is_dir() and list(squatted.iterdir()) == []  # nothing of ours in it
    squatted.rmdir()
    job.assert_nothing_left()  # the other nodes' folders: removed by the last sweep
