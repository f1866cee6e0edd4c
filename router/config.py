"""Every router setting, as typed dataclasses with their defaults and their checks
(README, Operating pdserve): ``RouterConfig`` (one model's router: its model, admission,
migration, routing, tool calling and deadlines towards its workers), ``HTTPLimits`` and
``GRPCLimits`` (a client's side of an exchange), ``RouterListen`` (the router's ports)
and ``APIAuthSettings`` (client and operator API keys).

Each default is declared here, once. A field that is a command-line flag says so in its
metadata (``setting``: the flag's name, help, type, choices, group); ``router/flags.py``
generates the flags of ``pdserve serve`` and ``python -m pdserve.router`` from it, and reads
them back into these classes. A field without a flag says where its value comes from
(``derived``) or that it has none (``internal``); ``tests/test_router_config.py`` checks
that no field lacks its flag and no flag its field.

The engine flags' defaults are ``EngineConfig``'s (``engine_default``): a field read from
one (``engine_derived``: ``block_size``, ``kv_cache_dtype``, ``generation_config``) takes
it when a config is made.

Imported by every router module; imports none but ``router/limits.py`` (constants) until a
config is made, so ``pdserve --help`` reads the flags without loading the router.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdserve.router.limits import MAX_NUM_SEQUENCES

if TYPE_CHECKING:
    from pdserve.cluster.auth import ClusterAuth

DEFAULT_PUBLIC_ENDPOINTS = ("/health", "/ready", "/metrics")  # served without an API key
# the admin endpoints (router/api_keys.py), and every path under them: never public
ADMIN_PATHS = ("/admin", "/metrics/targets")
DISAGGREGATION_MODES = ("auto", "always")
PREFILL_ROUTING_POLICIES = ("prefix-aware", "round-robin")
SCHEDULING_POLICIES = ("fcfs", "priority")  # vLLM's --scheduling-policy
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")  # vLLM's (tool_parsers.py)
REASONING_PARSERS = ("deepseek_r1", "qwen3")  # vLLM's (router/reasoning.py)
# argparse groups of the generated flags: title -> description
GROUPS = {
    "router timeouts": (
        "A Prefill call or decode stream has no deadline: a slow one is never taken for a "
        "failed worker. One silent for --stall-interval-s has its worker asked for Health; "
        "only a worker that gives no answer --health-failure-threshold times in a row "
        "(--health-check-timeout-s each) is dead, and its requests move to another worker."),
    "client authentication": (
        "With an API key (from a flag, else PDSERVE_API_KEY, else VLLM_API_KEY) clients must "
        "send 'Authorization: Bearer <key>' (gRPC: the same metadata); with none, the API is "
        "open."),
    "operator authentication": (
        "The admin endpoints (/admin/*: pdserve scale; /metrics/targets) take only an admin "
        "key (from a flag, else PDSERVE_ADMIN_API_KEY), never a client key; an admin key also "
        "works as a client key. With none, they answer loopback clients only."),
}


def setting(default: Any, flag: str, help: str, *, type: Any = None,
            choices: tuple | None = None, action: str | None = None, group: str | None = None,
            metavar: str | None = None, flag_default: Any = None) -> Any:
    """A dataclass field that is the command-line flag ``flag``, with ``default``.

    ``type``: argparse's (default: the default's own type when it is an int, float or
    str); the string ``"api_key"``, ``"api_key_file"`` or ``"public_endpoints"`` names a
    converter of ``router/flags.py``. ``action``: argparse's (``store_true``, ``append``).
    ``flag_default``: the flag's default when it is the field's in another form (a string
    that ``type`` turns into ``default``). ``group``: a title of ``GROUPS``.
    """
    meta = {"flag": flag, "help": help, "type": type, "choices": choices, "action": action,
            "group": group, "metavar": metavar,
            "flag_default": default if flag_default is None else flag_default}
    return field(default=default, metadata=meta)


def shared(default: Any, flag: str) -> Any:
    """A field whose flag ``flag`` another dataclass here generates (with the same
    default): one flag sets both."""
    return field(default=default, metadata={"flag": flag, "shared": True})


def derived(default: Any, source: str, **kwargs) -> Any:
    """A field whose value comes from another command-line flag, ``source`` (an engine
    flag, ``--redis-url``, the cluster authentication flags), not one of its own."""
    return field(default=default, metadata={"source": source}, **kwargs)


def engine_derived(flag: str) -> Any:
    """A field whose value comes from the engine flag ``flag`` (``derived``), with that
    flag's default: ``EngineConfig``'s field of the flag's name (``engine_default``), read
    when a config is made, so that importing this module loads no engine (nor torch)."""
    name = flag.lstrip("-").replace("-", "_")

    def default() -> Any:
        from pdserve.engine.engine_config import engine_default

        return engine_default(name)

    return derived(dataclasses.MISSING, flag, default_factory=default)


def internal(default: Any) -> Any:
    """A field with no flag: only code (tests, the SLO planner) sets it."""
    return field(default=default, metadata={"internal": True})


def flag_fields(cls) -> list[dataclasses.Field]:
    """The fields of dataclass ``cls`` that are flags (``setting`` or ``shared``)."""
    return [f for f in dataclasses.fields(cls) if "flag" in f.metadata]


def flag_dest(f: dataclasses.Field) -> str:
    """The argparse ``dest`` of field ``f``'s flag (``--stall-interval-s``:
    ``stall_interval_s``)."""
    return f.metadata["flag"].lstrip("-").replace("-", "_")


def from_args(cls, args: Any, **extra):
    """A ``cls`` from the flags of its fields in ``args`` (an argparse Namespace), and
    ``extra`` for its other fields.

    Raises:
        ValueError: a value out of range (``cls``'s checks; the message names the flag).
    """
    return cls(**{f.name: getattr(args, flag_dest(f)) for f in flag_fields(cls)}, **extra)


def check_seconds(value, flag: str) -> None:
    """Raise ValueError naming ``flag`` unless ``value`` is a positive finite number of
    seconds (the HTTP and gRPC servers' deadlines)."""
    if isinstance(value, bool) or not (isinstance(value, (int, float)) and
                                       0 < value < float("inf")):
        raise ValueError(f"{flag} must be a positive number of seconds, not {value!r}")


def is_admin_path(path: str) -> bool:
    """Whether the HTTP ``path`` is an admin endpoint: ``/admin``, ``/metrics/targets``
    or a path under one of them."""
    return any(path == p or path.startswith(p + "/") for p in ADMIN_PATHS)


def check_public_paths(paths: Iterable[str]) -> None:
    """Raise ValueError naming the first admin path (``is_admin_path``) in ``paths``: an
    admin endpoint is never public."""
    for path in sorted(paths):
        if is_admin_path(path):
            raise ValueError(f"{path} is an admin endpoint: it cannot be public (it takes "
                             "the admin API key, --admin-api-key, or with none a loopback "
                             "client)")


def _flag_of(cls, name: str) -> str:
    """The flag of ``cls``'s field ``name`` (for error messages), else the field's name."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return f.metadata.get("flag", name)


@dataclass(slots=True)
class RouterListen:
    """Where the router listens: ``host`` (an address; ``0.0.0.0`` or ``::`` every one),
    ``port`` for HTTP and ``grpc_port`` for gRPC (``pdserve.v1.Router``; 0: no gRPC)."""

    host: str = setting("127.0.0.1", "--host", "router HTTP and gRPC address")
    port: int = setting(8000, "--port", "router HTTP port")
    grpc_port: int = setting(50050, "--grpc-port", "router gRPC port (pdserve.v1.Router; "
                             "0: none)")


@dataclass(frozen=True)
class HTTPLimits:
    """How long a request may take to arrive, in seconds (``router/http_server.py``).

    Attributes:
        header_timeout_s: request line and headers, from the connection's opening or the
            previous response's end.
        body_timeout_s: the body, from the end of the headers.
        send_timeout_s: how long the client may leave the response's write buffer full
            (over its high-water mark) without taking bytes from it.

    Raises:
        ValueError: a timeout that is not a positive finite number of seconds (the
            message names the flag).
    """

    header_timeout_s: float = setting(
        10.0, "--request-header-timeout-s",
        "seconds a request's line and headers may take to arrive (from the connection's "
        "opening, or the previous response's end), and a gRPC connection's HTTP/2 "
        "preface; past it the connection is closed (%(default)s)")
    body_timeout_s: float = setting(
        60.0, "--request-body-timeout-s",
        "seconds a request's body may take to arrive after its headers; past it the "
        "connection is closed (%(default)s)")
    send_timeout_s: float = setting(
        60.0, "--response-send-timeout-s",
        "seconds a client may take no bytes of a response while the router has more to "
        "send; past it the connection is dropped (a gRPC stream ends with "
        "DEADLINE_EXCEEDED) and the request cancelled (%(default)s)")

    def __post_init__(self) -> None:
        for f in flag_fields(HTTPLimits):
            check_seconds(getattr(self, f.name), f.metadata["flag"])


_HTTP = {f.name: f.default for f in dataclasses.fields(HTTPLimits)}


@dataclass(frozen=True, slots=True)
class GRPCLimits:
    """What one client connection of the gRPC API may hold (``router/grpc_server.py``).

    Attributes:
        handshake_timeout_s: seconds from a connection's opening to its HTTP/2 preface
            (``--request-header-timeout-s``).
        send_timeout_s: seconds a ``Generate`` may wait to hand its client one response
            message (``--response-send-timeout-s``).
        max_concurrent_streams: RPCs one connection runs at once
            (``--grpc-max-concurrent-streams``, HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS).
        max_connection_idle_s: seconds a connection may stay open with no RPC
            (``--grpc-max-connection-idle-s``).

    Raises:
        ValueError: a time that is not a positive finite number of seconds, or a stream
            count below 1 (the message names the flag).
    """

    handshake_timeout_s: float = shared(_HTTP["header_timeout_s"], "--request-header-timeout-s")
    send_timeout_s: float = shared(_HTTP["send_timeout_s"], "--response-send-timeout-s")
    # nginx's http2_max_concurrent_streams is 128, Go's 250
    max_concurrent_streams: int = setting(
        256, "--grpc-max-concurrent-streams",
        "RPCs one gRPC connection may run at once (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS); "
        "a client queues the rest (%(default)s)")
    # clients reconnect by themselves
    max_connection_idle_s: float = setting(
        300.0, "--grpc-max-connection-idle-s",
        "seconds a gRPC connection may stay open with no RPC before the router closes it "
        "(GOAWAY; clients reconnect) (%(default)s)")

    def __post_init__(self) -> None:
        check_seconds(self.handshake_timeout_s, "--request-header-timeout-s")
        check_seconds(self.send_timeout_s, "--response-send-timeout-s")
        check_seconds(self.max_connection_idle_s, "--grpc-max-connection-idle-s")
        streams = self.max_concurrent_streams
        if isinstance(streams, bool) or not isinstance(streams, int) or not \
                1 <= streams <= 2**31 - 1:
            raise ValueError("--grpc-max-concurrent-streams must be an integer in "
                             f"[1, {2**31 - 1}], not {streams!r}")

    def server_options(self) -> list[tuple[str, int]]:
        """grpc channel arguments for ``grpc.aio.server`` (milliseconds, rounded up, at
        most grpc's int range: about 24.8 days)."""
        def ms(seconds: float) -> int:
            return min(math.ceil(seconds * 1e3), 2**31 - 1)

        return [("grpc.server_handshake_timeout_ms", ms(self.handshake_timeout_s)),
                ("grpc.max_concurrent_streams", self.max_concurrent_streams),
                ("grpc.max_connection_idle_ms", ms(self.max_connection_idle_s))]


@dataclass(slots=True)
class APIAuthSettings:
    """The client and operator API-key flags as given (``router/flags.py`` reads them,
    with the environment, into ``router/api_keys.py``'s ``ApiKeyAuth`` and ``AdminAuth``).
    ``public_endpoints``: HTTP paths served without a key, never an admin one."""

    api_key: list[str] | None = setting(  # noqa: RUF009
        None, "--api-key", "accept this API key; repeat for several (visible to local users "
        "in ps: prefer PDSERVE_API_KEY or --api-key-file)", type="api_key", action="append",
        metavar="KEY", group="client authentication")
    api_key_file: str | None = setting(
        None, "--api-key-file", "accept the API keys in this file, one per non-empty line",
        type="api_key_file", metavar="PATH", group="client authentication")
    public_endpoints: frozenset[str] = setting(
        frozenset(DEFAULT_PUBLIC_ENDPOINTS), "--public-endpoints",
        "comma-separated HTTP paths served without a key (gRPC Health follows /health); '' "
        "protects every path; never an admin endpoint (default: %(default)s)",
        type="public_endpoints", metavar="PATHS", group="client authentication",
        flag_default=",".join(DEFAULT_PUBLIC_ENDPOINTS))
    admin_api_key: list[str] | None = setting(  # noqa: RUF009
        None, "--admin-api-key", "accept this admin API key; repeat for several (visible in "
        "ps: prefer PDSERVE_ADMIN_API_KEY or --admin-api-key-file)", type="api_key",
        action="append", metavar="KEY", group="operator authentication")
    admin_api_key_file: str | None = setting(
        None, "--admin-api-key-file", "accept the admin API keys in this file, one per "
        "non-empty line", type="api_key_file", metavar="PATH", group="operator authentication")

    def __post_init__(self) -> None:
        check_public_paths(self.public_endpoints)


_SECONDS_FIELDS = ("registry_interval_s", "health_interval_s", "health_timeout_s",
                   "stall_interval_s", "control_timeout_s")
_TIMEOUTS = "router timeouts"


@dataclass(slots=True)
class RouterConfig:
    """Router settings. Times in seconds; ``max_model_len`` defaults to the checkpoint's
    ``max_position_embeddings``; prompts under ``local_prefill_threshold`` tokens are
    prefilled on the decode worker (0: never).

    ``disaggregation``: ``"auto"`` decides per request where a prompt is prefilled
    (``routing.choose_prefill_path``: on the decode worker when fewer than
    ``local_prefill_threshold`` tokens are left after its prefix cache, when every
    prefill worker computes on the decode worker's own hardware, or when the chosen one
    has ``max_prefill_queue_size`` prefills waiting); ``"always"`` sends every prompt of
    at least ``local_prefill_threshold`` tokens to the prefill pool while it has a
    worker. ``prefill_routing``: ``"prefix-aware"`` (``routing.choose_prefill_worker``)
    or ``"round-robin"`` (each prefill to the next worker in turn, a baseline).
    ``scheduling_policy`` (vLLM's): ``"fcfs"`` refuses a request's ``priority`` other
    than 0; ``"priority"`` sends it to the workers, whose schedulers serve lower values
    first (``engine/scheduler.py``).

    Admission control (503 + ``Retry-After`` before any work; migrations bypass it, as
    they are requests already accepted): ``max_waiting_requests`` admitted requests
    without their first token yet; per prefill worker ``prefill_max_inflight`` Prefill
    calls; per decode worker ``decode_max_inflight`` streams and a KV usage under
    ``decode_max_kv_usage`` (its last Health). A worker's calls and streams are this
    router's plus other router replicas' as its last Health reported them
    (``WorkerHandle.admission_count``). A worker at a cap gets no new
    request; a request that no worker of a needed pool can take is refused.
    ``migration_limit``: attempts after the first that one request may make.

    Deadlines (the "router timeouts" flags): a Prefill call and a decode
    stream have none; when one has been silent for ``stall_interval_s`` the router asks
    its worker's Health, and only a worker that does not answer within
    ``health_failure_threshold`` calls of ``health_timeout_s`` (or answers ``stopped``)
    fails the attempt, which moves on as any failed attempt does
    (``WorkerPool.is_alive``). ``health_interval_s``/``health_timeout_s`` also pace
    the background Health poll that routing reads; ``control_timeout_s`` bounds each
    ``GrantKV``, ``Abort`` and ``Release``, and the wait for those still under way at
    ``stop()``.
    ``reasoning_parser`` (``router/reasoning.py``) splits a chat reply's reasoning from
    its content, as vLLM's flag of that name does.
    ``tool_call_parser`` (``router/tool_parsers.py``) reads tool calls out of the model's
    text; ``enable_auto_tool_choice`` lets requests leave the choice to the model
    (``tool_choice: auto``), as vLLM's flags of those names do.
    ``auth``: the cluster secret (and mutual TLS) of every call to a worker, and the key
    that registry records must be signed with; None: a cluster without authentication.
    ``redis_url`` may hold the Redis password.

    The model (``engine/model_source.py``): ``model`` is a local checkpoint folder or
    ``.gguf`` file (``pdserve serve`` resolves hub ids first); ``tokenizer`` another local
    tokenizer to use (``--tokenizer``), ``chat_template`` a template or a file holding one
    (``--chat-template``); ``generation_config`` (``auto``, ``vllm`` or a folder) whose
    sampling defaults fill a request's unset fields. ``served_model_name`` is the name
    responses give and workers register under (default: ``model``);
    ``served_model_aliases`` further names requests may use (vLLM's second and later
    ``--served-model-name``). ``block_size`` and ``kv_cache_dtype`` must be the workers':
    the prefix index holds the workers' block hashes, whose root includes both
    (``block_hash.root_block_hash``).
    """

    model: str = derived(dataclasses.MISSING, "--model")
    redis_url: str = derived(dataclasses.MISSING, "--redis-url")
    served_model_name: str | None = derived(None, "--served-model-name")
    served_model_aliases: tuple[str, ...] = derived((), "--served-model-name")
    tokenizer: str | None = derived(None, "--tokenizer")
    chat_template: str | None = derived(None, "--chat-template")
    generation_config: str = engine_derived("--generation-config")
    block_size: int = engine_derived("--block-size")
    kv_cache_dtype: str = engine_derived("--kv-cache-dtype")
    max_model_len: int | None = derived(None, "--max-model-len")
    # NOTE: a prompt shorter than one block has no full block to reuse from any prefix
    # cache and costs the decode worker about one step to prefill, less than a KV transfer
    local_prefill_threshold: int = setting(
        16, "--local-prefill-threshold",
        "prompts shorter than this many tokens are prefilled on the decode worker, never "
        "in the prefill pool (0: never; default: one block, %(default)s)")
    disaggregation: str = setting(
        "auto", "--disaggregation",
        "auto: decide per request whether the prefill pool pays (prefill on the decode "
        "worker when little of the prompt is left after its prefix cache, when every "
        "prefill worker computes on the decode worker's own CPUs or GPU, or when the pool "
        "is busy); always: the pool prefills every prompt of at least "
        "--local-prefill-threshold tokens", choices=DISAGGREGATION_MODES)
    # NOTE: Dynamo's conditional disaggregation uses a queue of 2; a prefill worker
    # batches the Prefill calls waiting for it, so a few waiting ones still finish together
    max_prefill_queue_size: int = setting(
        4, "--max-prefill-queue-size",
        "with --disaggregation auto, a prefill worker with this many prefills waiting "
        "counts as busy: prompts are prefilled on their decode worker instead")
    prefill_routing: str = setting(
        "prefix-aware", "--prefill-routing",
        "prefix-aware: the prefill worker with the lowest uncached blocks + load (the "
        "Redis prefix index); round-robin: the next one in turn (a baseline to compare "
        "with)", choices=PREFILL_ROUTING_POLICIES)
    scheduling_policy: str = setting(
        "fcfs", "--scheduling-policy",
        "fcfs: first come, first served, and a request's priority other than 0 is refused "
        "(400); priority: a request's priority (vLLM's field, lower first, default 0) "
        "orders the workers' queues and picks which running request is preempted",
        choices=SCHEDULING_POLICIES)
    overlap_weight: float = internal(1.0)
    registry_interval_s: float = internal(1.0)
    # NOTE: a call silent for stall_interval_s has its worker asked for Health, and only
    # health_failure_threshold calls in a row without an answer (health_timeout_s each)
    # make the worker dead: about 14 s at most to tell a hung worker, one Health call per
    # 10 s of silence for a slow one
    health_interval_s: float = setting(
        0.5, "--health-check-interval-s",
        "seconds between the Health polls of every worker (their load, for routing) and "
        "between the tries of a stall probe (%(default)s)", group=_TIMEOUTS)
    health_timeout_s: float = setting(
        1.0, "--health-check-timeout-s",
        "seconds one Health call may take; a worker past it gets no new request until it "
        "answers again (%(default)s)", group=_TIMEOUTS)
    health_failure_threshold: int = setting(  # SGLang's router's --health-failure-threshold
        3, "--health-failure-threshold",
        "Health calls in a row a worker with a silent call must leave unanswered to be "
        "taken for dead (%(default)s)", group=_TIMEOUTS)
    stall_interval_s: float = setting(
        10.0, "--stall-interval-s",
        "seconds a Prefill call or a decode stream may send nothing before its worker is "
        "asked for Health, and again after each further such silence (%(default)s)",
        group=_TIMEOUTS)
    control_timeout_s: float = setting(
        5.0, "--control-timeout-s",
        "seconds each GrantKV, Abort and Release call may take, and the wait at shutdown "
        "for those under way (%(default)s)", group=_TIMEOUTS)
    retry_after_s: int = internal(1)
    # NOTE: the admission defaults admit any one request (at most MAX_NUM_SEQUENCES
    # sequences) on an idle cluster of one worker per pool
    migration_limit: int = setting(
        3, "--migration-limit",
        "attempts after the first a request may make when a worker fails (retries, and "
        "migrations of running streams)")
    max_waiting_requests: int = setting(
        2 * MAX_NUM_SEQUENCES, "--max-waiting-requests",
        "admitted sequences without their first token; past it: 503")
    prefill_max_inflight: int = setting(
        MAX_NUM_SEQUENCES, "--prefill-max-inflight",
        "Prefill calls in flight per prefill worker (this router's, plus other router "
        "replicas' as the worker's Health reports them)")
    decode_max_inflight: int = setting(
        2 * MAX_NUM_SEQUENCES, "--decode-max-inflight",
        "streams in flight per decode worker (this router's, plus other router replicas' "
        "as the worker's Health reports them)")
    decode_max_kv_usage: float = setting(
        0.98, "--decode-max-kv-usage",
        "decode workers whose KV cache usage (0-1) is at or past this get no new request")
    enable_auto_tool_choice: bool = setting(
        False, "--enable-auto-tool-choice",
        "let the model decide when to call tools (tool_choice 'auto', the default with "
        "tools); needs --tool-call-parser", action="store_true")
    trust_request_chat_template: bool = setting(
        False, "--trust-request-chat-template",
        "render a chat request's own chat_template (vLLM's flag; off: such a request is "
        "refused, as a template is code every client could then run in the router)",
        action="store_true")
    enable_tokenizer_info_endpoint: bool = setting(
        False, "--enable-tokenizer-info-endpoint",
        "serve GET /tokenizer_info (vLLM's): the tokenizer's special tokens, chat template "
        "and length, what lm-evaluation-harness's remote tokenizer reads; it shows them "
        "to every client", action="store_true")
    tool_call_parser: str | None = setting(
        None, "--tool-call-parser",
        "how the model writes tool calls: hermes (Hermes, Qwen), llama3_json (Llama "
        "3.1-3.3), mistral, pythonic (Llama 3.2 and 4's Python lists of calls)",
        choices=TOOL_CALL_PARSERS)
    reasoning_parser: str | None = setting(
        None, "--reasoning-parser",
        "split a reasoning model's chat replies into message.reasoning (the <think> "
        "block) and content: deepseek_r1 (DeepSeek-R1, its distills, QwQ), qwen3 (Qwen3, "
        "Qwen3-Thinking)", choices=REASONING_PARSERS)
    auth: ClusterAuth | None = field(default=None, repr=False,
                                     metadata={"source": "--cluster-secret-file"})

    def __post_init__(self) -> None:
        for name in _SECONDS_FIELDS:
            check_seconds(getattr(self, name), name)
        for name in ("health_failure_threshold", "migration_limit", "max_waiting_requests",
                     "prefill_max_inflight", "decode_max_inflight"):
            if getattr(self, name) < (0 if name == "migration_limit" else 1):
                raise ValueError(f"{name}={getattr(self, name)} is out of range")
        if self.disaggregation not in DISAGGREGATION_MODES:
            raise ValueError(f"disaggregation={self.disaggregation!r} must be one of "
                             f"{DISAGGREGATION_MODES}")
        if self.prefill_routing not in PREFILL_ROUTING_POLICIES:
            raise ValueError(f"prefill_routing={self.prefill_routing!r} must be one of "
                             f"{PREFILL_ROUTING_POLICIES}")
        if self.max_prefill_queue_size < 1:
            raise ValueError(f"max_prefill_queue_size={self.max_prefill_queue_size} must "
                             "be >= 1")
        if not 0.0 < self.decode_max_kv_usage <= 1.0:
            raise ValueError(f"decode_max_kv_usage={self.decode_max_kv_usage} must be in (0, 1]")
        if self.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
            raise ValueError(f"tool_call_parser={self.tool_call_parser!r} must be one of "
                             f"{TOOL_CALL_PARSERS}")
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(f"reasoning_parser={self.reasoning_parser!r} must be one of "
                             f"{REASONING_PARSERS}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy={self.scheduling_policy!r} must be one of "
                             f"{SCHEDULING_POLICIES}")
        from pdserve.kernels.kv_quant import canonical_kv_cache_dtype  # NOTE: loads torch

        canonical_kv_cache_dtype(self.kv_cache_dtype)  # NOTE: raises for an unknown name
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs a tool_call_parser "
                             "(--tool-call-parser)")


def check_router_flags(values: dict[str, Any]) -> None:
    """Check ``RouterConfig`` keyword arguments read from their flags (``values``) before
    anything starts, naming the flag of the first that is out of range.

    Raises:
        ValueError: ``--enable-auto-tool-choice`` without ``--tool-call-parser``, a time
            that is not a positive number of seconds, or ``--health-failure-threshold``
            below 1.
    """
    if values.get("enable_auto_tool_choice") and values.get("tool_call_parser") is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (the format "
                         "the model writes its tool calls in)")
    for name in _SECONDS_FIELDS:
        if name in values:
            check_seconds(values[name], _flag_of(RouterConfig, name))
    threshold = values.get("health_failure_threshold", 1)
    if threshold < 1:
        raise ValueError(f"--health-failure-threshold must be at least 1, not {threshold}")
