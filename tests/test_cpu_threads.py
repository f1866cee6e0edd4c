"""Binding the engine's intra-op threads to CPUs (``--cpu-omp-threads-bind``, vLLM's
``VLLM_CPU_OMP_THREADS_BIND``): the CPU list parser, and real engines in fresh
processes whose threads' affinities are read back from ``/proc``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pdserve.engine.cpu_threads import parse_cpu_list
from pdserve.engine.engine_config import EngineConfig
from pdserve.kernels import cpu_ext

CPUS = sorted(os.sched_getaffinity(0))
needs_two_cpus = pytest.mark.skipif(len(CPUS) < 2, reason="needs two CPUs")
needs_kernels = pytest.mark.skipif(not cpu_ext.load(), reason="C++ CPU kernels unavailable")


def test_cpu_lists_parse_as_linux_writes_them():
    assert parse_cpu_list("0-3,6") == [0, 1, 2, 3, 6]
    assert parse_cpu_list("5") == [5]
    assert parse_cpu_list("4-5, 1") == [4, 5, 1]  # the order given: thread i -> i-th CPU


@pytest.mark.parametrize("text", ["", "a", "3-1", "-1", "0-", "0,0", "0-2,1", "all"])
def test_bad_cpu_lists_are_refused_naming_the_setting(text):
    with pytest.raises(ValueError, match="cpu_omp_threads_bind"):
        EngineConfig(model="m", cpu_omp_threads_bind=text)


# Runs an engine in a fresh process, on an AsyncEngine's own thread (as the workers do)
# or through LLM on the main thread, then reads every thread's CPU affinity and CPU ticks
# while they all still run; "stepper" is the thread that ran the model.
ENGINE_SCRIPT = r"""
import asyncio, json, os, sys, threading
import torch
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.async_engine import AsyncEngine
model, threads, bind, how = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
llm = LLM(model, max_model_len=256, num_threads=threads, cpu_omp_threads_bind=bind,
          device="cpu", load_progress=False)
params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)

def read_tasks():
    tasks = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            status = open(f"/proc/self/task/{tid}/status").read()
            stat = open(f"/proc/self/task/{tid}/stat").read()
        except (FileNotFoundError, ProcessLookupError):  # ended meanwhile (ESRCH on read)
            continue
        allowed = status.split("Cpus_allowed_list:")[1].split()[0]
        tasks[tid] = (allowed, sum(int(x) for x in stat.rsplit(")", 1)[1].split()[11:13]))
    return tasks

if how == "llm":
    out = llm.generate([{"prompt_token_ids": list(range(1, 150))}] * 4, params)
    assert all(len(o.outputs[0].token_ids) == 64 for o in out)
    stepper = threading.get_native_id()
    tasks = read_tasks()
else:
    engine = AsyncEngine(llm.engine)
    engine.start()
    async def main():
        async def one(i):
            return [o async for o in engine.generate(f"r{i}", list(range(1, 150)), params)]
        runs = await asyncio.gather(*(one(i) for i in range(4)))
        assert all(run[-1].finish_reason == "length" for run in runs), runs
        return await engine.call(lambda e: threading.get_native_id())
    stepper = asyncio.run(main())
    tasks = read_tasks()  # while the engine thread lives: shutdown joins it
    engine.shutdown()
print("RESULT " + json.dumps({"stepper": str(stepper), "main": str(os.getpid()), "tasks": tasks}))
"""


def run_engine(model, threads: int, bind: str, how: str, ok: bool = True):
    done = subprocess.run([sys.executable, "-c", ENGINE_SCRIPT, str(model), str(threads), bind,
                           how], capture_output=True, text=True, timeout=300, check=False)
    if not ok:
        return done
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def all_cpus() -> str:
    with open("/proc/self/status") as status:
        return status.read().split("Cpus_allowed_list:")[1].split()[0]


@needs_two_cpus
@needs_kernels
def test_auto_binds_an_engine_threads_team_that_has_every_cpu(tiny_checkpoints):
    result = run_engine(tiny_checkpoints["llama"], len(CPUS), "auto", "async")
    tasks = result["tasks"]
    # the engine thread holds the first CPU, a thread of its team each other one
    assert tasks[result["stepper"]][0] == str(CPUS[0]), tasks
    bound = [allowed for allowed, _ in tasks.values() if allowed != all_cpus()]
    assert sorted(bound) == sorted(str(c) for c in CPUS), tasks
    assert tasks[result["main"]][0] == all_cpus()  # the rest of the process is not bound


@needs_two_cpus
@needs_kernels
@pytest.mark.parametrize("how", ["async", "llm"])
def test_a_cpu_list_binds_thread_i_to_its_ith_cpu(tiny_checkpoints, how):
    result = run_engine(tiny_checkpoints["llama"], 2, f"{CPUS[1]},{CPUS[0]}", how)
    tasks = result["tasks"]
    assert tasks[result["stepper"]][0] == str(CPUS[1]), tasks
    assert any(allowed == str(CPUS[0]) for allowed, _ in tasks.values()), tasks


@needs_two_cpus
@pytest.mark.parametrize("threads,bind,how", [(1, "auto", "async"), (2, "nobind", "async"),
                                              (len(CPUS), "auto", "llm")])
def test_nothing_is_bound_otherwise(tiny_checkpoints, threads, bind, how):
    """auto leaves a 1-thread engine unbound on a 2-CPU machine (another engine may share
    it, and both would land on its first CPU), and LLM does not pin its caller's thread
    (nor what that thread starts later) unless given a CPU list."""
    result = run_engine(tiny_checkpoints["llama"], threads, bind, how)
    assert {allowed for allowed, _ in result["tasks"].values()} == {all_cpus()}


@needs_two_cpus
@needs_kernels
def test_a_list_shorter_than_the_team_is_refused(tiny_checkpoints):
    done = run_engine(tiny_checkpoints["llama"], 2, str(CPUS[0]), "llm", ok=False)
    assert done.returncode != 0
    assert "cpu_omp_threads_bind" in done.stderr and "2 intra-op threads" in done.stderr


@needs_two_cpus
@needs_kernels
def test_a_cpu_the_machine_cannot_have_stays_unbound():
    script = ("import threading, torch\nfrom pdserve.kernels import cpu_ext\n"
              "torch.set_num_threads(2)\n"
              f"print('BOUND', cpu_ext.bind_intra_op_threads([{CPUS[0]}, 1 << 20]))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "BOUND 1" in done.stdout


# Builds an engine off the event loop as the workers do (asyncio.to_thread), either on the
# engine thread (AsyncEngine.build) or on the pool thread ("pool": the model loads, and
# packs its weights, on a thread that lives on), then counts how often the engine thread
# blocked while 4 requests decoded 64 tokens.
BUILD_SCRIPT = r"""
import asyncio, sys, threading
from pdserve.engine import EngineConfig, LLMEngine, SamplingParams
from pdserve.engine.async_engine import AsyncEngine
model, how = sys.argv[1], sys.argv[2]
config = EngineConfig(model, dtype="float32", max_model_len=256, num_threads=2,
                      cpu_omp_threads_bind="nobind", load_progress=False)
params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)

def blocked(tid):
    status = open(f"/proc/self/task/{tid}/status").read()
    return int(status.split("voluntary_ctxt_switches:")[1].split()[0])

async def main():
    if how == "build":
        engine = await asyncio.to_thread(AsyncEngine.build, lambda: LLMEngine(config))
    else:
        engine = AsyncEngine(await asyncio.to_thread(LLMEngine, config))
        engine.start()
    tid = await engine.call(lambda e: threading.get_native_id())

    async def run(first):
        await asyncio.gather(*(_one(engine, first + i) for i in range(4)))
    await run(0)  # warm-up
    before = blocked(tid)
    await run(10)
    print("RESULT", blocked(tid) - before)
    engine.shutdown()

async def _one(engine, i):
    return [o async for o in engine.generate(f"r{i}", list(range(1 + i, 60 + i)), params)]

asyncio.run(main())
"""


def blocked_while_decoding(model, how: str) -> int:
    done = subprocess.run([sys.executable, "-c", BUILD_SCRIPT, str(model), how],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return int(next(x for x in done.stdout.splitlines() if x.startswith("RESULT ")).split()[1])


@needs_two_cpus
@needs_kernels
def test_an_engine_built_on_its_own_thread_keeps_its_team_spinning(tiny_checkpoints):
    """A model loaded on another thread that lives on leaves that thread's OpenMP team
    behind; libgomp then counts more threads than CPUs and stops spinning at barriers,
    and the engine thread blocks at nearly every parallel region (hundreds of times over
    these 64 decode steps). AsyncEngine.build loads it on the engine thread: the engine
    thread blocks a few times per step at most (handing the GIL to the event loop that
    takes each step's outputs; once per step on a quiet machine, 2.8 in one CI run), a
    small fraction of the other way's count."""
    pool = blocked_while_decoding(tiny_checkpoints["llama"], "pool")
    if pool <= 2 * 64:
        pytest.skip(f"this OpenMP runtime keeps spinning beside a second team ({pool} "
                    "waits): nothing to guard")
    built = blocked_while_decoding(tiny_checkpoints["llama"], "build")
    assert built <= 4 * 64 and 3 * built < pool, (built, pool)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs affinity masks and two CPUs")
def test_default_threads_split_the_cpus_this_process_may_use_not_the_machines():
    """A worker started under ``taskset`` (one CPU of this machine's) gets one thread,
    not the machine's count split between the workers."""
    cpu = min(os.sched_getaffinity(0))
    code = (f"import os; os.sched_setaffinity(0, {{{cpu}}}); "
            "from pdserve.cluster.worker_config import available_cpus, default_num_threads; "
            "print(available_cpus(), default_num_threads(1), default_num_threads(4))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    assert done.stdout.split() == ["1", "1", "1"]
