"""Prometheus metrics: what both roles share (the base class, its labels, the per-layer buckets, the /metrics
server); each role's metrics are in attention_metrics.py and ffn_metrics.py. Labels are bounded: role, node,
model_name (and finished_reason, phase, expert, layer where a metric needs them). Names use the afd_ prefix
and base units; request-level histograms use vLLM's bucket sets, per-layer and per-step timings
microsecond-to-second buckets. What the hot path counts per layer or per expert is kept in plain lists and
exported at scrape time."""

from __future__ import annotations

import errno
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from afd.backend import host_syncs
from afd.cluster.ports import PortInUse
from afd.cluster.supervise import RESTARTS_ENV

FINE_BUCKETS = (
    1e-6,
    5e-6,
    1e-5,
    2.5e-5,
    5e-5,
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    1e-2,
    2.5e-2,
    5e-2,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    10.0,
)
BASE_LABELS = ("role", "node", "model_name")
CLUSTER_STATE_DOC = (
    "Cluster state as this node last heard it (ClusterStatus.State): 0 STARTING, 1 READY, "
    "2 DEGRADED, 3 DRAINING, 4 SHUTDOWN, 5 FAILED."
)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class NodeMetrics:
    def __init__(self, role: str, node: str, model_name: str):
        self.registry = CollectorRegistry()
        self._base = {"role": role, "node": node, "model_name": model_name}
        self.restarts = int(os.environ.get(RESTARTS_ENV) or 0)
        self.registry.register(Collector(self._host_syncs))
        self.registry.register(Collector(self._restarts))
        self.registry.register(Collector(self._kernels))

    def _restarts(self):
        # the launcher's count, handed to each restarted process (afd.cluster.supervise): it has no port of its own
        doc = "Times the launcher restarted this node after it failed (afd launch / afd serve / afd.LLM; 0 elsewhere)."
        fam = CounterMetricFamily("afd_node_restarts", doc, labels=BASE_LABELS)
        fam.add_metric(self._values(), self.restarts)
        yield fam

    def _kernels(self):
        # chosen by timing as the GEMMs first meet each case (afd.backend.kernel_choice): read at scrape time
        from afd.backend.kernel_choice import process_choice

        doc = (
            "1 for the kernel each GEMM case runs on this node, chosen by timing on this machine "
            "(op: operation, dtype, weight shape, row class)."
        )
        fam = GaugeMetricFamily("afd_kernel_info", doc, labels=(*BASE_LABELS, "op", "kernel"))
        for case, choice in sorted(process_choice().choices().items(), key=lambda kv: kv[0].label):
            fam.add_metric([*self._values(), case.label, choice.kernel], 1)
        yield fam

    def _host_syncs(self):
        doc = "Times this process's host waited for its device (afd/backend/host_syncs.py; 0 on CPU)."
        fam = CounterMetricFamily("afd_host_syncs", doc, labels=BASE_LABELS)
        fam.add_metric(self._values(), host_syncs.total())
        yield fam

    def _make(self, kind, name: str, doc: str, extra: tuple[str, ...] = (), **kw):
        m = kind(name, doc, BASE_LABELS + extra, registry=self.registry, **kw)
        return m if extra else m.labels(**self._base)

    def labels(self, metric, **extra):
        return metric.labels(**self._base, **extra)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def watch_cluster_state(self, state) -> None:
        """afd_cluster_state: `state()` (ClusterStatus.State as this node last heard it from the
        coordinator), read at scrape time so that the gauge is never staler than the node's own view."""

        def collect():
            fam = GaugeMetricFamily("afd_cluster_state", CLUSTER_STATE_DOC, labels=BASE_LABELS)
            fam.add_metric(self._values(), state())
            yield fam

        self.registry.register(Collector(collect))

    def _values(self, *extra: str) -> list[str]:
        return [*(self._base[k] for k in BASE_LABELS), *extra]


class Collector:
    """Exports the metric families `collect` builds at scrape time from plain values."""

    def __init__(self, collect):
        self.collect = collect


def serve_metrics(host: str, port: int, metrics: NodeMetrics, healthy, what: str = "metrics") -> ThreadingHTTPServer:
    """/metrics and /health (200 when healthy() else 503, empty body) for nodes without the API. A port in use
    is a PortInUse naming `what` (e.g. "FFN node ffn0's ports.metrics")."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's naming)
            if self.path == "/metrics":
                body, code, ctype = metrics.render(), 200, CONTENT_TYPE
            elif self.path == "/health":
                body, code, ctype = b"", 200 if healthy() else 503, "text/plain"
            else:
                body, code, ctype = b"not found\n", 404, "text/plain"
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    try:
        server = ThreadingHTTPServer((host, port), Handler)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise PortInUse(f"port {port} on {host} is in use ({what})") from None
        raise
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="afd-metrics-http", daemon=True).start()
    return server
