"""The router's settings (``router/config.py``) and their flags: every field that is a flag
is one of ``pdserve serve`` and of ``python -m pdserve.router``, with the field's default;
no router flag lacks its field; the engine's and the workers' flags are ``EngineConfig``'s
and ``WorkerConfig``'s fields; each flag's default is declared in one place (a flag or the
dataclass field behind it);
``pdserve serve --config FILE.yaml``; and ``python -m pdserve.router`` serves gRPC."""

from __future__ import annotations

import argparse
import ast
import asyncio
import dataclasses
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest
from disagg_client import TEST_AUTH, TEST_SECRET

from pdserve.cluster.auth import SECRET_ENV, add_cluster_auth_args
from pdserve.cluster.worker_config import add_worker_args
from pdserve.engine.args import add_engine_args
from pdserve.entrypoints.cli import build_parser, subcommand
from pdserve.entrypoints.config_file import parse_with_config
from pdserve.router import config
from pdserve.router.__main__ import build_parser as router_build_parser
from pdserve.router.flags import ROUTER_SETTINGS, flag_kwargs

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = (*ROUTER_SETTINGS, config.RouterListen)
# the modules whose functions declare the flags of the two parsers
FLAG_MODULES = ("router/config.py", "router/flags.py", "router/__main__.py",
                "entrypoints/serve.py", "entrypoints/cli.py", "engine/args.py",
                "cluster/auth.py")
# those of the workers' parser (cluster/worker_process.py)
WORKER_MODULES = ("engine/args.py", "cluster/worker_config.py", "cluster/auth.py")


def serve_parser():
    return subcommand(build_parser(), "serve")


def router_parser():
    return router_build_parser()


def flags_of(parser) -> dict[str, object]:
    """Long flag -> its action, for every flag of ``parser``."""
    return {opt: a for a in parser._actions for opt in a.option_strings if opt.startswith("--")}


def other_flags() -> set[str]:
    """Flags that are not the router's settings: the engine's and the cluster's."""
    parser = argparse.ArgumentParser(add_help=False)
    add_engine_args(parser)
    add_cluster_auth_args(parser, generated=True)
    return set(flags_of(parser))


def field_flags() -> dict[str, dataclasses.Field]:
    """Flag -> the field that declares it (not a shared one)."""
    return {f.metadata["flag"]: f for cls in SETTINGS for f in config.flag_fields(cls)
            if not f.metadata.get("shared")}


@pytest.mark.parametrize("make", [serve_parser, router_parser], ids=["serve", "router"])
def test_every_field_is_a_flag_with_its_default(make):
    parser = make()
    flags = flags_of(parser)
    for cls in SETTINGS:
        for f in dataclasses.fields(cls):
            meta = f.metadata
            assert "flag" in meta or "source" in meta or meta.get("internal"), \
                f"{cls.__name__}.{f.name} has no flag, no source flag and is not internal"
            flag = meta.get("flag") or meta.get("source")
            if flag is None:
                continue
            assert flag in flags, f"{cls.__name__}.{f.name}: {flag} is no flag of {parser.prog}"
            if "flag" in meta:
                action = flags[flag]
                assert action.dest == config.flag_dest(f)
                declared = field_flags()[flag].metadata["flag_default"]
                assert parser.get_default(action.dest) == declared, flag
                value = action.type(declared) if isinstance(declared, str) and action.type \
                    else declared
                assert value == f.default, f"{cls.__name__}.{f.name}'s default vs {flag}'s"


def test_every_router_flag_is_a_field():
    router = set(flags_of(router_parser()))
    serve = set(flags_of(serve_parser()))
    known = set(field_flags()) | other_flags() | {"--help", "--log-level", "--redis-url"}
    assert router - known == set(), "python -m pdserve.router flags without a field"
    # the flags both commands have are the router's: each is a field (or engine/cluster)
    assert (router & serve) - known == set(), "router flags of pdserve serve without a field"
    assert set(field_flags()) <= router & serve


def test_a_generated_flag_has_its_fields_type_and_choices():
    kwargs = flag_kwargs(next(f for f in dataclasses.fields(config.RouterConfig)
                              if f.name == "disaggregation"))
    assert kwargs["choices"] == config.DISAGGREGATION_MODES and kwargs["default"] == "auto"
    kwargs = flag_kwargs(next(f for f in dataclasses.fields(config.GRPCLimits)
                              if f.name == "max_concurrent_streams"))
    assert kwargs["type"] is int and kwargs["default"] == 256


# a default written as one of these reads another declaration (a dataclass field's): it
# is no declaration of its own
LOOKUPS = {"engine_default", "worker_default", "d", "_HTTP"}
# the dataclasses behind the engine and worker flags: their field defaults are
# declarations of those flags' defaults too
ENGINE_CONFIG = ("engine/engine_config.py", "EngineConfig")
WORKER_CONFIG = ("cluster/worker_config.py", "WorkerConfig")
# flags of pdserve serve whose WorkerConfig field has another name
WORKER_FIELDS = {"--kv-lease-s": "lease_s", "--worker-host": "host"}
PLANNER_GROUP = "SLO planner (--autoscale)"  # another module's defaults (entrypoints/planner.py)


def _is_lookup(node: ast.expr) -> bool:
    """Whether a default's expression reads another declaration (``LOOKUPS``)."""
    if isinstance(node, ast.Call):
        node = node.func
    elif isinstance(node, ast.Subscript):
        node = node.value
    else:
        return False
    return getattr(node, "id", getattr(node, "attr", None)) in LOOKUPS


def _declares(node: ast.expr | None) -> bool:
    """Whether ``node``, a default's expression, declares one: not absent, None or a
    lookup."""
    return node is not None and not (isinstance(node, ast.Constant) and node.value is None) \
        and not _is_lookup(node)


def declared_defaults(modules: tuple[str, ...] = FLAG_MODULES) -> dict[str, list[str]]:
    """Flag -> where a default other than None is written for it (file:line): in an
    ``add_argument("--flag", default=...)`` call or a ``setting``, ``derived`` or
    ``shared(default, "--flag", ...)`` field of ``modules``, those that build a parser; a
    default that looks another one up (``LOOKUPS``) is none."""
    found: dict[str, list[str]] = {}
    for module in modules:
        path = ROOT / module
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            name = getattr(node.func, "attr", getattr(node.func, "id", None))
            if name == "add_argument" and isinstance(node.args[0], ast.Constant):
                flag = node.args[0].value
                default = next((k.value for k in node.keywords if k.arg == "default"), None)
            elif name in ("setting", "derived", "shared") and len(node.args) > 1 and \
                    isinstance(node.args[1], ast.Constant):
                flag, default = node.args[1].value, node.args[0]
            else:
                continue
            if _declares(default):
                found.setdefault(flag, []).append(f"{module}:{node.lineno}")
    return found


def field_defaults(module: str, cls: str) -> dict[str, str]:
    """Field -> where its default is written (file:line), for the fields of dataclass
    ``cls`` in ``module`` whose default is declared there (see ``_declares``)."""
    tree = ast.parse((ROOT / module).read_text())
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
    return {n.target.id: f"{module}:{n.lineno}" for n in body
            if isinstance(n, ast.AnnAssign) and _declares(n.value)}


def engine_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False)
    add_engine_args(parser)
    return parser


def worker_parser() -> argparse.ArgumentParser:
    """The engine's and the worker's flags of ``python -m pdserve.{prefill,decode}_worker``
    (``cluster/worker_process.py``)."""
    parser = engine_parser()
    add_worker_args(parser)
    return parser


def planner_flags(parser) -> set[str]:
    return {opt for group in parser._action_groups if group.title == PLANNER_GROUP
            for a in group._group_actions for opt in a.option_strings}


def declarations(parser, router: bool) -> dict[str, list[str]]:
    """Flag -> every place its default is declared, for the flags of ``parser`` but the
    planner's: the flag modules (``declared_defaults``) and the dataclass field behind it,
    EngineConfig's for an engine flag, WorkerConfig's for a worker flag (a flag of
    ``router/config.py``'s dataclasses is in ``declared_defaults`` already, when
    ``router``; else the parser is the workers')."""
    sites = declared_defaults(FLAG_MODULES if router else WORKER_MODULES)
    engine, worker = field_defaults(*ENGINE_CONFIG), field_defaults(*WORKER_CONFIG)
    engine_flags = set(flags_of(engine_parser()))
    router_flags = set(field_flags()) if router else set()
    found = {}
    for flag, action in flags_of(parser).items():
        if flag in planner_flags(parser):
            continue
        where = list(sites.get(flag, ()))
        if flag in engine_flags:
            where += [engine[action.dest]] if action.dest in engine else []
        elif flag not in router_flags:
            name = WORKER_FIELDS.get(flag, action.dest)
            where += [worker[name]] if name in worker else []
        found[flag] = where
    return found


@pytest.mark.parametrize("make, router", [(serve_parser, True), (router_parser, True),
                                          (worker_parser, False)],
                         ids=["serve", "router", "worker"])
def test_each_flags_default_is_declared_in_one_place(make, router):
    """A flag's default is written once: in its flag's declaration or in the dataclass
    field behind it, which the other reads (``engine_default``, ``worker_default``)."""
    parser = make()
    declared = declarations(parser, router)
    twice = {flag: where for flag, where in declared.items() if len(where) > 1}
    assert twice == {}, "a flag's default declared in several places"
    for modules in (FLAG_MODULES, WORKER_MODULES):
        twice = {flag: where for flag, where in declared_defaults(modules).items()
                 if len(where) > 1}
        assert twice == {}, "a flag's default declared in several places"
    for flag, where in declared.items():
        action = flags_of(parser)[flag]
        implied = isinstance(action, (argparse._StoreTrueAction,
                                      argparse._StoreFalseAction, argparse._HelpAction))
        if action.default is not None and not implied:
            assert where, f"{flag}'s default {action.default!r} is not declared where " \
                "the scan looks"
    assert "LIFECYCLE_FIELDS" not in (ROOT / "router/flags.py").read_text()


# fields with no flag: set by code (WorkerConfig.heartbeat_ttl_s: tests), or from other flags
ENGINE_INTERNAL = {"load_progress"}
WORKER_INTERNAL = {"role", "engine", "auth", "metrics_auth", "heartbeat_ttl_s"}
# worker flags whose default is not their field's, on purpose
WORKER_OTHER_DEFAULTS = {"kv_host"}  # None: --advertise-host, else --host


def test_every_engine_and_worker_field_is_a_flag_with_its_default():
    """The engine's flags are ``EngineConfig``'s fields and the workers' ``WorkerConfig``'s,
    each with the field's default; and the router's settings read from engine flags take
    the engine's defaults."""
    from pdserve.cluster.worker_config import WorkerConfig
    from pdserve.engine.engine_config import EngineConfig, engine_default

    engine = {a.dest: a for a in engine_parser()._actions}
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    assert set(engine) == set(fields) - ENGINE_INTERNAL
    for name, action in engine.items():
        if fields[name].default is not dataclasses.MISSING:
            assert action.default == fields[name].default == engine_default(name), name
    parser = argparse.ArgumentParser(add_help=False)
    add_worker_args(parser)
    fields = {f.name: f for f in dataclasses.fields(WorkerConfig)}
    dest = {name: {"lease_s": "kv_lease_s"}.get(name, name) for name in fields}
    assert {dest[name] for name in set(fields) - WORKER_INTERNAL} <= \
        {a.dest for a in parser._actions}
    for name in set(fields) - WORKER_INTERNAL - WORKER_OTHER_DEFAULTS:
        assert parser.get_default(dest[name]) == fields[name].default, name
    router = config.RouterConfig(model="m", redis_url="redis://")
    for name in ("block_size", "kv_cache_dtype", "generation_config"):
        assert getattr(router, name) == engine_default(name)


def serve_args(tmp_path, text: str, *argv: str):
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    parser = build_parser()
    return parse_with_config(parser, subcommand(parser, "serve"),
                             ["serve", "--config", str(path), *argv])


def test_a_config_file_sets_the_flags_and_the_command_line_wins(tmp_path):
    args = serve_args(tmp_path, "port: 8001\ngrpc_port: 0\nmax-waiting-requests: 64\n"
                      "disaggregation: always\nenable-auto-tool-choice: true\n"
                      "tool_call_parser: hermes\nserved-model-name: [a, b]\n"
                      "api-key: [k1, k2]\npublic-endpoints: /health\n"
                      "local-prefill-threshold: 4\nstall-interval-s: 2\n",
                      "--port", "9000", "--api-key", "k3")
    assert (args.port, args.grpc_port, args.max_waiting_requests) == (9000, 0, 64)
    assert (args.disaggregation, args.enable_auto_tool_choice) == ("always", True)
    assert args.tool_call_parser == "hermes" and args.served_model_name == ["a", "b"]
    assert args.api_key == ["k3"]  # the command line's list replaces the file's
    assert args.public_endpoints == frozenset({"/health"})
    assert args.local_prefill_threshold == 4 and args.stall_interval_s == 2.0
    assert serve_args(tmp_path, "api_key: [k1]\n").api_key == ["k1"]
    assert serve_args(tmp_path, "").port == 8000


@pytest.mark.parametrize("text, message", [
    ("no-such-flag: 1\n", "unknown key 'no-such-flag'"),
    ("port: eighty\n", "key 'port': invalid literal"),
    ("disaggregation: sometimes\n", "key 'disaggregation': 'sometimes' is not one of"),
    ("enable_auto_tool_choice: 1\n", "key 'enable_auto_tool_choice': 1 is not true or false"),
    ("public-endpoints: /admin\n", "key 'public-endpoints': /admin is an admin endpoint"),
    ("- port\n", "needs a mapping"),
    ("port: [1, 2]\n", "key 'port'"),
])
def test_a_bad_config_file_is_an_error_naming_the_key(tmp_path, text, message):
    with pytest.raises(ValueError, match="--config .*" + message.replace("[", r"\[")):
        serve_args(tmp_path, text)


def test_pdserve_serve_reports_a_bad_config_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("grpc-port: many\n")
    proc = subprocess.run([sys.executable, "-m", "pdserve.entrypoints.cli", "serve",
                           "--config", str(path)], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 2
    assert "pdserve: error: --config" in proc.stderr and "key 'grpc-port'" in proc.stderr


def test_pdserve_serve_starts_with_the_config_files_ports(tmp_path):
    """A taken gRPC port given in the file stops ``pdserve serve`` at its first phase."""
    path = tmp_path / "serve.yaml"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        path.write_text(f"grpc_port: {port}\nport: 0\n")
        proc = subprocess.run([sys.executable, "-m", "pdserve.entrypoints.cli", "serve",
                               "--config", str(path)], capture_output=True, text=True,
                              timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr
    assert f"pdserve: error: cannot listen on 127.0.0.1:{port}" in proc.stderr
    assert "--grpc-port" in proc.stderr and "Redis at" not in proc.stdout


def test_python_m_pdserve_router_serves_grpc(tmp_path):
    """``python -m pdserve.router`` against a prefill and a decode worker: one Generate on
    its gRPC port."""
    from pdserve.cluster.wire import sampling_params_to_proto
    from pdserve.cluster.worker_config import WorkerConfig
    from pdserve.decode_worker.server import DecodeWorker
    from pdserve.engine import EngineConfig, SamplingParams
    from pdserve.engine.demo_model import make_demo_model
    from pdserve.entrypoints.redis_server import RedisServer, free_port
    from pdserve.prefill_worker.server import PrefillWorker
    from pdserve.proto import router_pb2, router_pb2_grpc

    model = make_demo_model(tmp_path / "demo")
    engine = EngineConfig(str(model), dtype="float32", max_model_len=128, load_progress=False,
                          num_gpu_blocks_override=64, num_threads=1)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def call(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(120)

    log = tmp_path / "router.log"
    with RedisServer() as redis:
        workers = [PrefillWorker(WorkerConfig("prefill", engine, redis_url=redis.url,
                                              auth=TEST_AUTH)),
                   DecodeWorker(WorkerConfig("decode", engine, redis_url=redis.url,
                                             auth=TEST_AUTH))]
        proc = None
        try:
            for worker in workers:
                call(worker.start())
            # NOTE: picked once the workers listen: a port freed before they start may be
            # the ephemeral one the kernel hands one of them
            port, grpc_port = free_port(), free_port()
            with open(log, "w") as out:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "pdserve.router", "--redis-url", redis.url,
                     "--model", str(model), "--max-model-len", "128", "--port", str(port),
                     "--grpc-port", str(grpc_port)], stdout=out, stderr=subprocess.STDOUT,
                    env={**os.environ, SECRET_ENV: TEST_SECRET})
            wait_ready(proc, f"http://127.0.0.1:{port}", log)
            params = sampling_params_to_proto(SamplingParams(max_tokens=3, temperature=0.0))
            with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
                stub = router_pb2_grpc.RouterStub(channel)
                replies = list(stub.Generate(router_pb2.GenerateRequest(
                    text="The quick brown fox", sampling_params=params), timeout=60))
            assert replies and replies[-1].finish_reason, log.read_text()[-2000:]
            assert 1 <= sum(len(r.token_ids) for r in replies) <= 3
            assert f", gRPC 127.0.0.1:{grpc_port}" in log.read_text()
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(30)
            for worker in workers:
                call(worker.stop())
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)


def wait_ready(proc: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + 90
    while True:
        try:
            if httpx.get(url + "/ready", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"python -m pdserve.router did not get ready:\n"
                               f"{log.read_text()[-3000:]}")
        time.sleep(0.1)
