"""A worker's own Prometheus metrics, served over HTTP on ``--metrics-port``, to the holders
of a metrics or admin key where it listens beyond loopback (``cluster/metrics_auth.py``).

Every sample carries ``model_name``, ``worker`` (the worker id) and ``role`` (``prefill``
or ``decode``) labels. Names follow vLLM where vLLM has the metric:

- ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` (gauges, requests);
- ``vllm:kv_cache_usage_perc`` (gauge, 0..1: blocks in use over all blocks);
- ``vllm:num_preemptions_total`` (counter, preemptions by recompute);
- ``vllm:prefix_cache_queries_total``, ``vllm:prefix_cache_hits_total`` (counters,
  tokens: prompt tokens looked up in this worker's prefix cache, and found there);
- ``vllm:iteration_tokens_total`` (histogram, tokens scheduled per engine step);
- ``vllm:spec_decode_num_drafts_total``, ``vllm:spec_decode_num_draft_tokens_total``,
  ``vllm:spec_decode_num_accepted_tokens_total`` (counters: speculative decoding's
  proposing steps, proposed tokens, and those accepted; 0 without speculation).

pdserve's own use the ``pdserve:`` prefix:

- ``pdserve:kv_transfers_total{result}`` (counter: ``ok`` and ``failed`` transfers),
  ``pdserve:kv_transfer_bytes_total`` (counter, payload bytes of the successful ones),
  ``pdserve:kv_transfer_seconds_total`` (counter, wall seconds of the successful ones),
  ``pdserve:kv_transfers_in_flight`` (gauge): a prefill worker counts what it sent, a
  decode worker what it pulled;
- ``pdserve:kv_leases``, ``pdserve:kv_leased_blocks`` (gauges: prefilled requests whose
  blocks wait for their decode worker, and those blocks),
  ``pdserve:requests_waiting_for_kv`` (gauge), ``pdserve:unowned_blocks`` (gauge: the
  ownership audit, 0 unless a block leaked);
- ``pdserve:worker_draining`` (gauge, 1 while the worker drains);
- ``pdserve:engine_config_info`` (gauge, 1, the engine's settings as labels: dtype,
  kv_cache_dtype, block_size, num_blocks, max_num_seqs, max_num_batched_tokens,
  max_model_len; each pool can have its own, but for kv_cache_dtype and block_size).

Every value is read when Prometheus scrapes, from figures the engine thread keeps (ints
read without stopping it, and the ownership audit it takes between steps), so serving
pays nothing per token for them.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Protocol
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from pdserve.cluster.metrics_auth import MetricsAuth
from pdserve.kvtransfer.protocol import KVTransferCounters

if TYPE_CHECKING:
    from pdserve.cluster.worker_config import WorkerConfig
    from pdserve.engine.async_engine import AsyncEngine

LABELS = ["model_name", "worker", "role"]


class MetricsSource(Protocol):
    """What ``WorkerCollector`` reads of a worker at each scrape (``WorkerRuntime`` is
    one): its engine (None before it is built: nothing is reported), its id, its
    configuration (``role``) and whether it drains."""

    engine: AsyncEngine | None
    worker_id: str
    config: WorkerConfig
    draining: bool


class WorkerCollector(Collector):
    """Reads ``runtime``'s engine and ``kv_counters()`` at each scrape."""

    def __init__(self, runtime: MetricsSource,
                 kv_counters: Callable[[], KVTransferCounters]) -> None:
        self.runtime = runtime
        self.kv_counters = kv_counters

    def collect(self) -> Iterator[Metric]:
        runtime = self.runtime
        if runtime.engine is None:
            return
        engine = runtime.engine.engine
        scheduler = engine.scheduler
        labels = [engine.served_model_name, runtime.worker_id, runtime.config.role]

        def gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, documentation, labels=LABELS)
            family.add_metric(labels, value)
            return family

        def counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, documentation, labels=LABELS)
            family.add_metric(labels, value)
            return family

        yield gauge("vllm:num_requests_running", "Requests in the running batch.",
                    len(scheduler.running))
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.",
                    len(scheduler.waiting))
        yield gauge("vllm:kv_cache_usage_perc", "KV cache usage: blocks in use / all (0..1).",
                    engine.kv_cache_manager.usage)
        yield counter("vllm:num_preemptions", "Preemptions (by recompute).",
                      scheduler.num_preemptions_total)
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix "
                      "cache.", scheduler.prefix_cache_queries_total)
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                      scheduler.prefix_cache_hits_total)
        yield counter("vllm:spec_decode_num_drafts", "Speculative decoding: steps in which "
                      "a request proposed tokens.", scheduler.num_drafts_total)
        yield counter("vllm:spec_decode_num_draft_tokens", "Speculative decoding: tokens "
                      "proposed.", scheduler.num_draft_tokens_total)
        yield counter("vllm:spec_decode_num_accepted_tokens", "Speculative decoding: "
                      "proposed tokens the target model accepted.",
                      scheduler.num_accepted_tokens_total)
        buckets, total = engine.iteration_tokens.snapshot()
        family = HistogramMetricFamily("vllm:iteration_tokens_total",
                                       "Tokens scheduled per engine step.", labels=LABELS)
        family.add_metric(labels, [(_bound(b), c) for b, c in buckets], total)
        yield family

        kv = self.kv_counters()
        transfers = CounterMetricFamily("pdserve:kv_transfers", "KV transfers by result.",
                                        labels=[*LABELS, "result"])
        transfers.add_metric([*labels, "ok"], kv.num_transfers)
        transfers.add_metric([*labels, "failed"], kv.num_failed)
        yield transfers
        yield counter("pdserve:kv_transfer_bytes", "KV payload bytes moved by successful "
                      "transfers.", kv.num_bytes)
        yield counter("pdserve:kv_transfer_seconds", "Wall seconds of successful KV "
                      "transfers.", kv.seconds)
        yield gauge("pdserve:kv_transfers_in_flight", "KV transfers whose payload is moving.",
                    kv.num_in_flight)
        yield counter("pdserve:kv_connections_refused", "Connections to this worker's KV "
                      "listeners (its KV store, its pair listeners) dropped for failing the "
                      "cluster's handshake.", kv.num_refused)
        ownership = runtime.engine.ownership
        yield gauge("pdserve:kv_leases", "Prefilled requests whose blocks wait for their "
                    "decode worker.", ownership.num_leases)
        yield gauge("pdserve:kv_leased_blocks", "Blocks held by KV leases.",
                    ownership.num_leased_blocks)
        yield gauge("pdserve:requests_waiting_for_kv", "Requests whose KV is being pulled.",
                    ownership.num_requests_waiting_for_kv)
        yield gauge("pdserve:unowned_blocks", "Blocks in use that no owner holds (the "
                    "ownership audit; 0 unless a block leaked).", ownership.num_unowned_blocks)
        yield gauge("pdserve:worker_draining", "1 while the worker drains.",
                    int(runtime.draining))
        config = {"dtype": str(engine.model_config.dtype).removeprefix("torch."),
                  "kv_cache_dtype": engine.config.kv_cache_dtype,
                  "block_size": engine.config.block_size, "num_blocks": engine.num_blocks,
                  "max_num_seqs": scheduler.config.max_num_seqs,
                  "max_num_batched_tokens": scheduler.config.max_num_batched_tokens,
                  "max_model_len": engine.model_config.max_model_len}
        info = GaugeMetricFamily("pdserve:engine_config_info", "The engine's settings, as "
                                 "labels (value 1), as vLLM's cache_config_info.",
                                 labels=[*LABELS, *config])
        info.add_metric([*labels, *(str(v) for v in config.values())], 1)
        yield info


def _bound(bound: float) -> str:
    return "+Inf" if bound == float("inf") else str(int(bound))


REQUEST_TIMEOUT_S = 10.0  # a scrape's socket reads and writes, each
UNAUTHORIZED = (b"401 Unauthorized: this worker's /metrics needs a metrics API key (or "
                b"the admin key) as 'Authorization: Bearer <key>'\n")


class _Server(ThreadingMixIn, WSGIServer):
    """One thread per scrape (daemon threads: nothing waits for them at close)."""

    daemon_threads = True


class _Handler(WSGIRequestHandler):
    """Logs nothing; every read and write of a connection waits ``REQUEST_TIMEOUT_S``
    at most (a client that sends nothing holds its thread no longer)."""

    timeout = REQUEST_TIMEOUT_S

    def log_message(self, format, *args) -> None:
        pass


def guarded(app: Callable, auth: MetricsAuth) -> Callable:
    """The WSGI app ``app`` behind ``auth``: a request without one of its keys as
    ``Authorization: Bearer <key>`` gets 401 (``WWW-Authenticate: Bearer``) and nothing
    of ``app``; with no key in ``auth``, ``app`` itself."""
    if not auth:
        return app

    def guarded_app(environ: dict, start_response: Callable) -> Iterable[bytes]:
        if auth.allows(environ.get("HTTP_AUTHORIZATION")):
            return app(environ, start_response)
        start_response("401 Unauthorized", [
            ("Content-Type", "text/plain; charset=utf-8"),
            ("Content-Length", str(len(UNAUTHORIZED))),
            ("WWW-Authenticate", 'Bearer realm="pdserve worker metrics"')])
        return [UNAUTHORIZED]

    return guarded_app


class MetricsServer:
    """``WorkerCollector`` on its own registry, served over HTTP (prometheus_client's
    WSGI app, behind ``guarded``) by a daemon thread at ``host:port`` (``port`` 0: a free
    one). ``auth``: the keys a scrape must present (none: every scrape is answered).
    ``address`` is ``advertise_host:port`` (default ``host``), where Prometheus reaches
    it; ``discoverable``: whether the registry record advertises it (False for a
    routable worker's loopback-only metrics, ``WorkerRuntime.start_metrics``).

    Raises:
        OSError: ``host:port`` cannot be bound.
    """

    def __init__(self, collector: WorkerCollector, host: str, port: int,
                 advertise_host: str | None = None, auth: MetricsAuth | None = None,
                 discoverable: bool = True) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(collector)
        family, _, _, _, sockaddr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        server_class = type("MetricsHTTPServer", (_Server,), {"address_family": family})
        app = guarded(make_wsgi_app(self.registry), auth or MetricsAuth())
        self._server = make_server(sockaddr[0], port, app, server_class,
                                   handler_class=_Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="worker-metrics")
        self._thread.start()
        self.host = host
        self.port = self._server.server_port
        self.address = f"{advertise_host or host}:{self.port}"
        self.discoverable = discoverable

    def close(self) -> None:
        """Stop serving (waits for the serving loop, at most 5 s) and close the socket."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5.0)
