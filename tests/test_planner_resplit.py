"""Issue 32: on one CPU node every computing worker gets CPUs of its own, re-split when
the pool changes (``PoolScaler.plan``, ``RayLauncher.resplit``), so no core runs two
workers' OpenMP teams; the planner grows a computing pool only onto a free core (one no
running worker's threads hold) and otherwise refuses ``no_free_cores``: a re-split adds no
compute. And ``PoolScaler.scale`` is cancel-safe: no worker it was starting is
left behind.

- the split itself (``split_cpus``, ``split_roles``);
- a scaler over a launcher that records what it is asked: running workers narrow before
  new ones start, and widen after others leave;
- the planner over that scaler and a real router;
- a real decode worker in a fresh process (Redis, the demo model): ``WorkerRuntime.resplit``
  moves every thread of it to the CPU given, resizes its intra-op team on the engine
  thread, rewrites its registry record's ``compute``, and it still serves;
- a resize cancelled while its workers (real processes) start leaves none running.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
from disagg_client import TEST_SECRET

from pdserve.cluster.auth import SECRET_ENV
from pdserve.engine.demo_model import ensure_demo_model, make_demo_model
from pdserve.entrypoints.launcher import Placement
from pdserve.entrypoints.planner import AT_BOUND_REPEAT_S, PlannerConfig, SLOPlanner
from pdserve.entrypoints.redis_server import RedisServer
from pdserve.entrypoints.scaling import PoolScaler, ScaleError, split_cpus, split_roles
from pdserve.router.config import RouterConfig
from pdserve.router.model_service import ModelService

CPUS = sorted(os.sched_getaffinity(0))
ROLES = {"prefill": "prefill", "decode": "decode"}


@pytest.mark.parametrize(("cpus", "count", "runs"), [
    ([0, 1], 1, [{0, 1}]),
    ([0, 1], 2, [{0}, {1}]),
    ([0, 1, 2], 2, [{0, 1}, {2}]),
    ([4, 6, 8, 10], 3, [{4, 6}, {8}, {10}]),
    ([0, 1], 0, []),
])
def test_split_cpus_gives_each_worker_a_disjoint_run(cpus, count, runs):
    assert split_cpus(cpus, count) == [frozenset(run) for run in runs]


def test_split_cpus_refuses_less_than_one_core_each():
    with pytest.raises(ScaleError, match="3 workers would get less than one core each of "
                                         "the 2 CPUs 0,1") as caught:
        split_cpus([0, 1], 3)
    assert caught.value.param == "no_free_cores"


def test_the_computing_roles_are_split_on_one_cpu_node_serving_one_model():
    assert split_roles("auto", False, 1) == ("decode",)
    assert split_roles("always", False, 1) == ("prefill", "decode")
    assert split_roles("auto", True, 1) == ()
    assert split_roles("auto", False, 2) == ()


class SplittingLauncher:
    """A one-CPU-node launcher that starts nothing and keeps, in order, what it was asked
    (``events``)."""

    def __init__(self, cpus: list[int]) -> None:
        self.cpus = frozenset(cpus)
        self.events: list[tuple] = []
        self.started = 0

    def node_cpus(self):
        return "host", self.cpus

    def placement(self, role: str, workers_on_node: int) -> Placement:
        return Placement("host", self.cpus, len(self.cpus))

    def start(self, role: str, count: int, workers_on_node: int, placements=None) -> list:
        names = [f"{role}-{self.started + i}" for i in range(count)]
        self.started += count
        self.events.append(("start", names, placements))
        return names

    def wait_ready(self, actors: list) -> list:
        return [SimpleNamespace(worker_id=a, grpc_address="-") for a in actors]

    def resplit(self, actor, placement: Placement) -> str:
        self.events.append(("resplit", actor, placement))
        return placement.compute

    def remove(self, actor) -> None:
        self.events.append(("remove", actor))


def at(*cpus: int) -> Placement:
    return Placement("host", frozenset(cpus), len(cpus))


def test_running_workers_narrow_before_new_ones_start_and_widen_after_others_leave():
    launcher = SplittingLauncher([0, 1])
    scaler = PoolScaler(launcher, ROLES, 1, 0.1, split=("decode",))
    scaler.adopt("decode", "first", "first")
    assert scaler.resplits() and scaler.placement("decode") == at(1)
    assert scaler.placement("prefill") == at(0, 1)  # not split: it shares the node

    assert asyncio.run(scaler.scale({"decode": 2})) == {"prefill": 0, "decode": 2}
    assert launcher.events == [("resplit", "first", at(0)), ("start", ["decode-0"], [at(1)])]
    assert scaler.placements()["decode"] == [at(0), at(1)]
    assert scaler.placement("decode") is None  # a third would get less than one core
    with pytest.raises(ScaleError, match="less than one core"):
        scaler.plan({"decode": 3})

    launcher.events.clear()
    assert asyncio.run(scaler.scale({"decode": 1})) == {"prefill": 0, "decode": 1}
    assert launcher.events == [("remove", "decode-0"), ("resplit", "first", at(0, 1))]
    assert scaler.placements()["decode"] == [at(0, 1)]


def test_an_operator_may_ask_for_more_workers_than_cores_one_thread_each():
    launcher = SplittingLauncher([0, 1])
    scaler = PoolScaler(launcher, ROLES, 1, 0.1, split=("prefill", "decode"))
    scaler.adopt("decode", "first", "first")
    assert asyncio.run(scaler.scale({"prefill": 1, "decode": 2})) == \
        {"prefill": 1, "decode": 2}
    assert scaler.placements() == {"prefill": [at(0)], "decode": [at(1), at(0)]}


def test_a_launcher_that_cannot_resplit_keeps_the_old_placements():
    launcher = SplittingLauncher([0, 1])
    launcher.node_cpus = lambda: None  # as on GPUs, or several nodes
    scaler = PoolScaler(launcher, ROLES, 1, 0.1, split=("decode",))
    scaler.adopt("decode", "first", "first")
    assert not scaler.resplits()
    asyncio.run(scaler.scale({"decode": 2}))
    assert [e[0] for e in launcher.events] == ["start"]
    assert scaler.placements()["decode"] == [at(0, 1), at(0, 1)]


def resplit_planner(scaler: PoolScaler, **config) -> SLOPlanner:
    """An SLO planner of a real router (the demo model, no worker) over ``scaler``: a
    decision every 1 s, at once, no cooldown, TPOT target 0.1 s."""
    router = ModelService(RouterConfig(model=str(ensure_demo_model()),
                                       redis_url="redis://127.0.0.1:1",
                                       served_model_name="demo"))
    config = {"interval_s": 1.0, "cooldown_s": 0.0, "up_after": 1, "tpot_target_s": 0.1,
              **config}
    return SLOPlanner(PlannerConfig(**config), router, scaler)


def no_free_cores_refused(planner: SLOPlanner) -> float | None:
    return planner.router.metrics.registry.get_sample_value(
        "pdserve:planner_decisions_total",
        {"model_name": planner.router.metrics.model_name, "pool": "decode",
         "direction": "none", "reason": "no_free_cores"})


def test_the_planner_refuses_a_worker_that_would_only_split_the_running_ones_cores():
    """The one decode worker runs two threads on the node's two cores: another would only
    take one of them from it (a re-split adds no compute), so the planner refuses it; an
    operator's explicit resize still re-splits, and then a third is refused too."""
    launcher = SplittingLauncher([0, 1])
    scaler = PoolScaler(launcher, ROLES, 1, 0.1, split=("decode",))
    scaler.adopt("decode", "first", "first")
    planner = resplit_planner(scaler)
    assert scaler.free_cpus() == []
    assert planner.admit_scale_up({"decode": 2}, scaler.sizes()) == {}
    assert planner.last_refusals == {"decode": "no_free_cores"}
    asyncio.run(scaler.scale({"decode": 2}))  # pdserve scale: re-split, one core each
    assert scaler.placements()["decode"] == [at(0), at(1)]
    assert planner.admit_scale_up({"decode": 3}, scaler.sizes()) == {}
    assert planner.last_refusals == {"decode": "no_free_cores"}
    assert no_free_cores_refused(planner) == 2  # once each: the second says 2 workers


def test_the_planner_grows_onto_free_cores_and_refuses_with_none_left(caplog):
    """The decode worker started with one thread on the node's two cores: TPOT broken,
    the planner adds a worker on the free core (the running one keeps its thread, pinned
    to the core it holds); TPOT still broken, no core is free: it refuses, with a line
    naming the model, pool, condition, value and target and why, and the metric counts
    it; a minute later the at-bound line says it again."""
    caplog.set_level(logging.INFO, logger="pdserve.entrypoints.planner")
    launcher = SplittingLauncher([0, 1])
    scaler = PoolScaler(launcher, ROLES, 1, 0.1, split=("decode",))
    scaler.adopt("decode", "first", "first", Placement("host", frozenset({0, 1}), 1))
    planner = resplit_planner(scaler)
    assert scaler.free_cpus() == [1]

    def step(now: float) -> dict[str, int]:
        for _ in range(10):
            planner.router.metrics.time_per_output_token.observe(0.3)
        return asyncio.run(planner.step(now))

    began = time.monotonic()  # NOTE: a resize's cooldown runs from its end, in this clock
    assert step(began) == {"prefill": 0, "decode": 2}
    assert planner.last_refusals == {}
    assert launcher.events == [("resplit", "first", at(0)), ("start", ["decode-0"], [at(1)])]
    assert scaler.free_cpus() == []
    for now in (began + 10.0, began + 11.0):
        assert step(now) == {"prefill": 0, "decode": 2}
        assert planner.last_refusals == {"decode": "no_free_cores"}
    [record] = [r for r in caplog.records if getattr(r, "planner", {}).get("event")
                == "refused"]
    fired = record.planner
    assert (fired["model_name"], fired["pool"], fired["reason"], fired["condition"],
            fired["target"]) == ("demo", "decode", "no_free_cores", "tpot_p90", 0.1)
    assert record.getMessage() == (
        f"SLO planner: model demo: not scaling up the decode pool (no_free_cores): tpot_p90 "
        f"{fired['value']:.3f} s (target 0.1 s) is broken, but all 2 cores of this node "
        "already run a worker's threads (2 computing worker(s), 2 thread(s)); another "
        "worker would only split them")
    assert no_free_cores_refused(planner) == 1
    assert not [r for r in caplog.records if "stays at" in r.getMessage()]
    assert step(began + 10.0 + AT_BOUND_REPEAT_S) == {"prefill": 0, "decode": 2}
    [warning] = [r for r in caplog.records if "stays at" in r.getMessage()]
    assert warning.levelno == logging.WARNING
    assert warning.planner["reason"] == "no_free_cores"
    assert warning.getMessage().startswith(
        "SLO planner: model demo: decode pool stays at 2 workers while tpot_p90 is broken: "
        "tpot_p90 ")
    assert warning.getMessage().endswith(
        "(no_free_cores: all 2 cores of this node already run a worker's threads (2 "
        "computing worker(s), 2 thread(s)); another worker would only split them)")


# A decode worker in this fresh process: serve, re-split onto one CPU, serve again.
WORKER_SCRIPT = r"""
import argparse, asyncio, json, os, sys
import torch
from pdserve.cluster.registry import WorkerRegistry
from pdserve.cluster.worker_config import add_worker_args, worker_config_from_args
from pdserve.engine import SamplingParams
from pdserve.engine.args import add_engine_args
from pdserve.entrypoints.worker_main import make_worker
cpu = int(sys.argv[1])
parser = argparse.ArgumentParser()
add_engine_args(parser)
add_worker_args(parser)
config = worker_config_from_args("decode", parser.parse_args(sys.argv[2:]))
params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

def affinities():
    found = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            status = open(f"/proc/self/task/{tid}/status").read()
        except (FileNotFoundError, ProcessLookupError):
            continue
        found.add(status.split("Cpus_allowed_list:")[1].split()[0])
    return sorted(found)

async def main():
    worker = make_worker(config)
    await worker.start()
    runtime = worker.runtime
    async def serve(name):
        outputs = [o async for o in runtime.engine.generate(name, list(range(1, 40)), params)]
        return outputs[-1].finish_reason
    registry = WorkerRegistry(config.redis_url, auth=config.auth)
    result = {"before": await serve("a"), "threads_before": await runtime.engine.call(
        lambda e: torch.get_num_threads())}
    result["compute"] = await runtime.resplit([cpu], 1)
    result["threads"] = await runtime.engine.call(lambda e: torch.get_num_threads())
    result["after"] = await serve("b")
    result["affinities"] = affinities()
    result["listed"] = [r.compute for r in registry.list_live("decode")]
    await worker.stop()
    print("RESULT " + json.dumps(result), flush=True)

asyncio.run(main())
"""


@pytest.mark.skipif(len(CPUS) < 2, reason="moves a worker onto one of two CPUs")
def test_a_running_worker_moves_onto_its_new_cpus_and_its_record_follows(tmp_path):
    model = make_demo_model(tmp_path / "demo")
    with RedisServer() as redis:
        done = subprocess.run(
            [sys.executable, "-c", WORKER_SCRIPT, str(CPUS[1]), "--model", str(model),
             "--dtype", "float32", "--max-model-len", "256", "--num-gpu-blocks-override",
             "64", "--num-threads", "2", "--redis-url", redis.url],
            capture_output=True, text=True, timeout=300, check=False,
            env={**os.environ, SECRET_ENV: TEST_SECRET})
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    result = json.loads(line.removeprefix("RESULT "))
    host = os.uname().nodename
    assert result["before"] == result["after"] == "length"
    assert (result["threads_before"], result["threads"]) == (2, 1)
    assert result["affinities"] == [str(CPUS[1])]  # every thread of the process
    assert result["compute"] == f"cpu@{host}:{CPUS[1]}"
    assert result["listed"] == [result["compute"]]


class SleepingLauncher:
    """Starts real processes that never become ready; ``remove`` kills one."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, role: str, count: int, workers_on_node: int) -> list:
        procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
                 for _ in range(count)]
        self.procs += procs
        return procs

    def wait_ready(self, actors: list) -> list:
        while all(proc.poll() is None for proc in actors):
            time.sleep(0.05)
        raise RuntimeError("a worker exited before it served")

    def remove(self, actor) -> None:
        actor.kill()
        actor.wait(10)


def test_a_resize_cancelled_mid_start_leaves_no_worker_running():
    launcher = SleepingLauncher()
    scaler = PoolScaler(launcher, ROLES, 1, 0.1)

    async def main():
        task = asyncio.create_task(scaler.scale({"prefill": 2, "decode": 3}))
        while len(launcher.procs) < 4:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    try:
        asyncio.run(main())
        assert len(launcher.procs) == 5
        assert all(proc.poll() is not None for proc in launcher.procs)
        assert scaler.sizes() == {"prefill": 0, "decode": 0}
    finally:
        for proc in launcher.procs:
            if proc.poll() is None:
                proc.kill()
