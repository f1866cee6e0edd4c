"""The router's Prometheus metrics (docs/architecture.md, Metrics).

Where vLLM has a metric the name, type, ``model_name`` label and histogram buckets are
vLLM's (``vllm/v1/metrics/loggers.py``), so dashboards built for vLLM work; pdserve's own
carry the ``pdserve:`` prefix. Counters are exposed with the ``_total`` suffix that
prometheus-client appends (``vllm:prompt_tokens_total``), as vLLM's are.

Each ``RouterMetrics`` owns its ``CollectorRegistry`` (nothing registers globally), so a
process, or a test, can hold many routers.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# vLLM's buckets, seconds.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                  5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


REJECTION_REASONS = ("max_waiting_requests", "prefill_pool_full", "decode_pool_full")
CLEANUP_METHODS = ("Abort", "Release")  # the clean-up RPCs (router/attempt.py)


class RouterMetrics:
    """One router's metrics for one served model, on a registry of its own.

    vLLM's: ``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds``,
    ``vllm:request_time_per_output_token_seconds``, ``vllm:e2e_request_latency_seconds``
    (histograms); ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` (gauges);
    ``vllm:prompt_tokens``, ``vllm:generation_tokens``, ``vllm:request_success``
    (``finished_reason``), ``vllm:prefix_cache_queries``, ``vllm:prefix_cache_hits``
    (counters, in tokens). pdserve's: ``pdserve:routing_decisions`` (``role``,
    ``worker``), ``pdserve:prefill_path`` (``path``: remote or local; ``reason``: why,
    ``routing.PREFILL_PATH_REASONS``), ``pdserve:prefix_index_lookups`` (``result``: hit, miss, unavailable),
    ``pdserve:prefix_index_available`` (1 or 0), ``pdserve:request_retries``,
    ``pdserve:request_migrations``, ``pdserve:registry_available`` (1 or 0),
    ``pdserve:registry_outages``, ``pdserve:registry_rejected_records`` (records ignored
    because their signature does not verify), ``pdserve:requests_rejected`` (``reason``),
    ``pdserve:stall_probes`` (``role``; ``result``: alive or dead: a worker asked for its
    Health after a call to it was silent for ``--stall-interval-s``),
    ``pdserve:cleanup_rpc_retries`` and ``pdserve:cleanup_rpc_failures`` (``method``:
    ``Abort``, ``Release``; failed attempts of clean-up RPCs that were retried, and
    clean-up RPCs given up after their last attempt), and from the
    workers' Health: ``pdserve:worker_requests_waiting_for_kv``, ``pdserve:worker_kv_leases``,
    ``pdserve:worker_leased_blocks``, ``pdserve:worker_unowned_blocks`` and
    ``pdserve:worker_kv_transfers_in_flight`` (``role``, ``worker``).
    Every metric has the ``model_name`` label.
    """

    CONTENT_TYPE = CONTENT_TYPE_LATEST  # of ``exposition()``

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry()
        self._children: dict[tuple, object] = {}  # (metric id, label values) -> child
        self._add_vllm_metrics()
        self._add_availability_metrics()
        self._add_refusal_metrics()
        self._add_labelled_metrics()

    def _add_vllm_metrics(self) -> None:
        """vLLM's metrics with only the ``model_name`` label: the latency histograms
        (seconds), the running and waiting gauges, and the token counters."""
        self.time_to_first_token = self._one(
            Histogram, "vllm:time_to_first_token_seconds", "Time to first token, seconds.",
            buckets=TTFT_BUCKETS_S)
        self.inter_token_latency = self._one(
            Histogram, "vllm:inter_token_latency_seconds", "Inter-token latency, seconds.",
            buckets=ITL_BUCKETS_S)
        self.time_per_output_token = self._one(
            Histogram, "vllm:request_time_per_output_token_seconds",
            "Time per output token after the first (TPOT) of each request, seconds.",
            buckets=ITL_BUCKETS_S)
        self.e2e_request_latency = self._one(
            Histogram, "vllm:e2e_request_latency_seconds", "End-to-end request latency, seconds.",
            buckets=E2E_BUCKETS_S)
        self.num_requests_running = self._one(
            Gauge, "vllm:num_requests_running", "Requests generating tokens.")
        self.num_requests_waiting = self._one(
            Gauge, "vllm:num_requests_waiting", "Requests waiting for their first token.")
        self.prompt_tokens = self._one(
            Counter, "vllm:prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = self._one(
            Counter, "vllm:generation_tokens", "Generated tokens.")
        self.prefix_cache_queries = self._one(
            Counter, "vllm:prefix_cache_queries", "Prompt tokens looked up in prefix caches.")
        self.prefix_cache_hits = self._one(
            Counter, "vllm:prefix_cache_hits", "Prompt tokens found in prefix caches.")

    def _add_availability_metrics(self) -> None:
        """pdserve's metrics with only the ``model_name`` label: the prefix index's and the
        worker registry's availability, registry outages and rejected records, retries and
        migrations."""
        self.prefix_index_available = self._one(
            Gauge, "pdserve:prefix_index_available",
            "1 while the Redis prefix index answers, 0 while routing by load alone.")
        self.request_retries = self._one(
            Counter, "pdserve:request_retries",
            "Attempts retried on another worker before any token was sent.")
        self.request_migrations = self._one(
            Counter, "pdserve:request_migrations",
            "Requests resumed on another decode worker after tokens were sent.")
        self.registry_available = self._one(
            Gauge, "pdserve:registry_available",
            "1 while the Redis worker registry answers, 0 while the router keeps its last "
            "view of the workers.")
        self.registry_outages = self._one(
            Counter, "pdserve:registry_outages", "Times the worker registry became unreachable.")
        self.registry_rejected_records = self._one(
            Gauge, "pdserve:registry_rejected_records",
            "Worker records in the registry the router ignores: unsigned, forged, or signed "
            "with another cluster's secret.")
        self._registry_up = True

    def _add_refusal_metrics(self) -> None:
        """Requests refused by admission control, and clean-up RPCs retried or given up,
        by reason and method; every label value exposed as 0 from the start."""
        self._rejections = Counter(
            "pdserve:requests_rejected", "Requests refused with 503 by admission control, "
            "by the cap that refused them.", labelnames=["model_name", "reason"],
            registry=self.registry)
        for reason in REJECTION_REASONS:  # NOTE: 0 from the start, so dashboards see them
            self._rejections.labels(self.model_name, reason)
        self._cleanup_retries = Counter(
            "pdserve:cleanup_rpc_retries", "Failed attempts of clean-up RPCs to workers "
            "(Abort, Release) that were retried.", labelnames=["model_name", "method"],
            registry=self.registry)
        self._cleanup_failures = Counter(
            "pdserve:cleanup_rpc_failures", "Clean-up RPCs to workers (Abort, Release) that "
            "failed on every attempt; the worker frees what they were for by itself.",
            labelnames=["model_name", "method"], registry=self.registry)
        for method in CLEANUP_METHODS:  # NOTE: 0 from the start, so dashboards see them
            self._cleanup_retries.labels(self.model_name, method)
            self._cleanup_failures.labels(self.model_name, method)

    def _add_labelled_metrics(self) -> None:
        """The metrics with labels past ``model_name``: the workers' Health audit,
        finish reasons, prefill paths, routing decisions, prefix index lookups, stall
        probes and pool sizes."""
        self._worker_gauges = {
            name: Gauge(f"pdserve:worker_{name}", documentation,
                        labelnames=["model_name", "role", "worker"], registry=self.registry)
            for name, documentation in (
                ("requests_waiting_for_kv", "Requests whose KV a decode worker is pulling."),
                ("kv_leases", "Prefilled prompts whose KV a prefill worker pins for a decode."),
                ("leased_blocks", "KV blocks pinned under leases."),
                ("unowned_blocks",
                 "KV blocks owned by no request, lease or cache: a leak; always 0."),
                ("kv_transfers_in_flight", "KV transfers whose payload is moving."))}
        self._request_success = Counter(
            "vllm:request_success", "Finished requests by finish reason.",
            labelnames=["model_name", "finished_reason"], registry=self.registry)
        self._prefill_paths = Counter(
            "pdserve:prefill_path", "Where fresh prompts were prefilled: remote (the "
            "prefill pool) or, for every other reason, on their decode worker.",
            labelnames=["model_name", "path", "reason"], registry=self.registry)
        self._routing_decisions = Counter(
            "pdserve:routing_decisions", "Requests routed to each worker, by role.",
            labelnames=["model_name", "role", "worker"], registry=self.registry)
        self._prefix_index_lookups = Counter(
            "pdserve:prefix_index_lookups", "Prefix index lookups by result.",
            labelnames=["model_name", "result"], registry=self.registry)
        self._stall_probes = Counter(
            "pdserve:stall_probes", "Workers asked whether they are alive after a call to "
            "them was silent for --stall-interval-s, by answer: alive (the call goes on) or "
            "dead (it fails and the request moves).",
            labelnames=["model_name", "role", "result"], registry=self.registry)
        self._pool_size = Gauge(
            "pdserve:pool_size", "Workers in each pool: those the router routes to "
            "(healthy), and all it knows (live in the registry or still answering Health).",
            labelnames=["model_name", "role", "state"], registry=self.registry)

    def _one(self, kind, name: str, documentation: str, **kwargs):
        """A metric of ``kind`` with only the ``model_name`` label, that label bound."""
        return kind(name, documentation, labelnames=["model_name"], registry=self.registry,
                    **kwargs).labels(self.model_name)

    def record_stall_probe(self, role: str, alive: bool) -> None:
        """Count one stall probe of a ``role`` worker and its answer."""
        self._stall_probes.labels(self.model_name, role, "alive" if alive else "dead").inc()

    def record_routing(self, role: str, worker_id: str) -> None:
        """Count one request sent to ``worker_id`` in ``role`` (``prefill`` or ``decode``)."""
        self._child(self._routing_decisions, role, worker_id).inc()

    def record_prefill_path(self, reason: str) -> None:
        """Count one fresh prompt's prefill path (``routing.PREFILL_PATH_REASONS``):
        ``remote`` goes to the prefill pool, every other reason is local."""
        self._child(self._prefill_paths, "remote" if reason == "remote" else "local",
                    reason).inc()

    def record_rejection(self, reason: str) -> None:  # one of REJECTION_REASONS
        """Count one request refused by admission control (``reason``: the cap)."""
        self._child(self._rejections, reason).inc()

    def record_cleanup(self, method: str, retried: bool) -> None:
        """Count one failed attempt of the clean-up RPC ``method`` (``CLEANUP_METHODS``):
        ``retried``, or the last one, after which the RPC is given up."""
        counter = self._cleanup_retries if retried else self._cleanup_failures
        counter.labels(self.model_name, method).inc()

    def record_registry(self, available: bool, num_rejected: int | None = None) -> None:
        """The registry answered (or not) a refresh; an outage is counted as it starts.
        ``num_rejected``: records that listing ignored (bad or no signature)."""
        if num_rejected is not None:
            self.registry_rejected_records.set(num_rejected)
        if not available and self._registry_up:
            self.registry_outages.inc()
        self._registry_up = available
        self.registry_available.set(1 if available else 0)

    def record_worker_health(self, role: str, reply) -> None:
        """One worker's ``HealthResponse``: its ownership audit as ``pdserve:worker_*``."""
        values = {"requests_waiting_for_kv": reply.num_requests_waiting_for_kv,
                  "kv_leases": reply.num_kv_leases, "leased_blocks": reply.num_leased_blocks,
                  "unowned_blocks": reply.num_unowned_blocks,
                  "kv_transfers_in_flight": reply.num_kv_transfers_in_flight}
        for name, value in values.items():
            self._worker_gauges[name].labels(self.model_name, role, reply.worker_id).set(value)

    def record_pool_size(self, role: str, num_healthy: int, num_known: int) -> None:
        """The size of the ``role`` pool: healthy workers, and all it knows."""
        self._pool_size.labels(self.model_name, role, "healthy").set(num_healthy)
        self._pool_size.labels(self.model_name, role, "known").set(num_known)

    def _child(self, metric, *labels: str):
        """``metric.labels(model_name, *labels)``, looked up once per label set: the
        routing step counts on every request, and ``labels()`` checks and hashes its
        arguments on each call (microseconds a decision)."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(self.model_name, *labels)
        return child

    def forget_worker(self, role: str, worker_id: str) -> None:
        """Drop a worker that left the registry from the per-worker gauges."""
        for gauge in self._worker_gauges.values():
            with contextlib.suppress(KeyError):
                gauge.remove(self.model_name, role, worker_id)

    def record_index_lookup(self, result: str) -> None:
        """Count one prefix-index lookup: ``hit``, ``miss`` or ``unavailable``; the
        availability gauge follows (0 after ``unavailable``, 1 otherwise)."""
        self._child(self._prefix_index_lookups, result).inc()
        self.prefix_index_available.set(0 if result == "unavailable" else 1)

    def record_prefix_cache(self, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        """Count a prompt's tokens as queried and its prefix-cache hits as hits (tokens)."""
        self.prefix_cache_queries.inc(num_prompt_tokens)
        self.prefix_cache_hits.inc(num_cached_tokens)

    def record_success(self, finished_reason: str) -> None:
        """Count one finished request (``stop``, ``length``, ``abort``)."""
        self._request_success.labels(self.model_name, finished_reason).inc()

    def request(self, *, arrival_s: float | None = None,
                clock: Callable[[], float] = time.monotonic) -> RequestMetrics:
        """A ``RequestMetrics`` for one new request, arriving now (or at ``arrival_s``)."""
        return RequestMetrics(self, arrival_s=arrival_s, clock=clock)

    def exposition(self) -> bytes:
        """The registry in Prometheus' text format (serve with ``CONTENT_TYPE``)."""
        return generate_latest(self.registry)


class RequestMetrics:
    """Timings of one request, observed into its router's histograms.

    TTFT is arrival to the first token; ITL is observed at every later arrival of tokens
    (one observation per message, as vLLM does per engine step); TPOT is
    ``(last token - first token) / (num_generation_tokens - 1)``, observed at the end when
    more than one token came (vLLM's ``request_time_per_output_token``, which leaves the
    prefill's token out); e2e is arrival to finish. Times come from ``clock`` (seconds).
    """

    def __init__(self, metrics: RouterMetrics, *, arrival_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.metrics = metrics
        self.clock = clock
        self.arrival_s = clock() if arrival_s is None else arrival_s
        self.first_token_s: float | None = None
        self.last_token_s: float | None = None
        self.num_generation_tokens = 0
        self.finish_s: float | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        if self.num_generation_tokens < 2:
            return None
        return (self.last_token_s - self.first_token_s) / (self.num_generation_tokens - 1)

    @property
    def e2e_s(self) -> float | None:
        return None if self.finish_s is None else self.finish_s - self.arrival_s

    def on_tokens(self, num_tokens: int = 1) -> None:
        """``num_tokens`` generated tokens arrived now."""
        if num_tokens <= 0:
            return
        now_s = self.clock()
        if self.first_token_s is None:
            self.first_token_s = now_s
            self.metrics.time_to_first_token.observe(now_s - self.arrival_s)
        else:
            self.metrics.inter_token_latency.observe(now_s - self.last_token_s)
        self.last_token_s = now_s
        self.num_generation_tokens += num_tokens
        self.metrics.generation_tokens.inc(num_tokens)

    def on_finish(self, finished_reason: str, *, num_prompt_tokens: int) -> None:
        """The request ended now with ``finished_reason`` (``stop``, ``length``, ``abort``)."""
        self.finish_s = self.clock()
        self.metrics.e2e_request_latency.observe(self.finish_s - self.arrival_s)
        if self.tpot_s is not None:
            self.metrics.time_per_output_token.observe(self.tpot_s)
        self.metrics.prompt_tokens.inc(num_prompt_tokens)
        self.metrics.record_success(finished_reason)
