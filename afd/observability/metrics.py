"""Prometheus metrics of both roles. Labels are bounded: role, node, model_name (and finished_reason,
phase, expert, layer where a metric needs them). Names use the afd_ prefix and base units; request-level
histograms use vLLM's bucket sets, per-layer and per-step timings microsecond-to-second buckets.
What the hot path counts per layer or per expert is kept in plain lists and exported at scrape time."""

from __future__ import annotations

import errno
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from afd.backend import host_syncs
from afd.backend.base import bind_device
from afd.cluster.ports import PortInUse
from afd.cluster.supervise import RESTARTS_ENV

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
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


class _Metrics:
    def __init__(self, role: str, node: str, model_name: str):
        self.registry = CollectorRegistry()
        self._base = {"role": role, "node": node, "model_name": model_name}
        self.restarts = int(os.environ.get(RESTARTS_ENV) or 0)
        self.registry.register(_Collector(self._host_syncs))
        self.registry.register(_Collector(self._restarts))

    def _restarts(self):
        # the launcher's count, handed to each restarted process (afd.cluster.supervise): it has no port of its own
        doc = "Times the launcher restarted this node after it failed (afd launch / afd serve / afd.LLM; 0 elsewhere)."
        fam = CounterMetricFamily("afd_node_restarts", doc, labels=BASE_LABELS)
        fam.add_metric(self._values(), self.restarts)
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

        self.registry.register(_Collector(collect))

    def _values(self, *extra: str) -> list[str]:
        return [*(self._base[k] for k in BASE_LABELS), *extra]


class AttentionMetrics(_Metrics):
    def __init__(self, node: str, model_name: str):
        super().__init__("attention", node, model_name)
        h, g, c = Histogram, Gauge, Counter
        self.ttft = self._make(h, "afd_time_to_first_token_seconds", "Time to first token.", buckets=TTFT_BUCKETS)
        self.itl = self._make(h, "afd_inter_token_latency_seconds", "Time between output tokens.", buckets=ITL_BUCKETS)
        self.e2e = self._make(
            h, "afd_e2e_request_latency_seconds", "End-to-end request latency.", buckets=REQUEST_BUCKETS
        )
        self.queue = self._make(
            h, "afd_request_queue_time_seconds", "Time from arrival to first schedule.", buckets=REQUEST_BUCKETS
        )
        self.running = self._make(g, "afd_num_requests_running", "Requests in the running batch.")
        self.waiting = self._make(g, "afd_num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = self._make(g, "afd_kv_cache_usage_ratio", "Fraction of KV cache blocks in use (0..1).")
        self.prompt_tokens = self._make(c, "afd_prompt_tokens", "Prefilled prompt tokens.")
        self.generation_tokens = self._make(c, "afd_generation_tokens", "Generated tokens.")
        self._success = self._make(c, "afd_request_success", "Finished requests by reason.", ("finished_reason",))
        self.preemptions = self._make(c, "afd_num_preemptions", "Requests preempted for lack of KV blocks.")
        self._step = self._make(h, "afd_step_seconds", "Forward step time.", ("phase",), buckets=FINE_BUCKETS)
        self.ffn_wait = self._make(
            h,
            "afd_ffn_wait_seconds",
            "Per step, time blocked waiting for FFN results (exchange not hidden).",
            buckets=FINE_BUCKETS,
        )
        self.a2f_bytes = self._make(c, "afd_a2f_bytes", "Bytes of hidden states sent to FFN nodes.")
        self.micro_batches = self._make(
            g, "afd_micro_batches", "Micro-batches the last step ran with (fixed, or MicroBatchTuner's choice)."
        )
        self.engine_dead = self._make(g, "afd_engine_dead", "1 once the engine stopped for good (/health is 503).")
        for reason in ("stop", "length", "abort"):  # exported at 0 before the first request, so
            self.labels(self._success, finished_reason=reason)  # dashboards show 0, not "no data"
        for phase in ("prefill", "decode", "mixed"):
            self.labels(self._step, phase=phase)

    def success(self, reason: str):
        return self.labels(self._success, finished_reason=reason)

    def watch_kv_ranks(self, allocator) -> None:
        """afd_kv_cache_rank_usage_ratio{kv_rank}: with KVP (layout.kvp), each KV rank's share of the
        node's cache in use (afd_kv_cache_usage_ratio is the node's whole); read at scrape time."""
        if allocator.pools == 1:
            return

        def collect():
            fam = GaugeMetricFamily(
                "afd_kv_cache_rank_usage_ratio",
                "Fraction of each KV-parallel rank's KV blocks in use (0..1).",
                labels=(*BASE_LABELS, "kv_rank"),
            )
            for k, used in enumerate(allocator.pool_usage()):
                fam.add_metric(self._values(str(k)), used)
            yield fam

        self.registry.register(_Collector(collect))

    def watch_graph(self, attn) -> None:
        """afd_graph_steps_total{mode}: forward passes of a micro-batch in graph mode and eager (a step counts
        once per micro-batch), read at scrape time from a graph-mode half (afd.engine.graph.GraphHalf; in
        eager mode there is none and no such metric)."""
        steps = getattr(attn, "steps", None)
        if not isinstance(steps, dict) or set(steps) != {"graph", "eager"}:
            return

        def collect():
            fam = CounterMetricFamily(
                "afd_graph_steps",
                "Micro-batch forward passes by mode: graph (compiled, padded to a batch bucket) or eager.",
                labels=(*BASE_LABELS, "mode"),
            )
            for mode in ("graph", "eager"):
                fam.add_metric(self._values(mode), steps[mode])
            yield fam

        self.registry.register(_Collector(collect))

    def watch_tp(self, tp) -> None:
        """The TP group's counters (afd.model.tp.comm.TPComm), read at scrape time: bytes this rank sent
        per collective (every rank of a node runs the same collectives, so rank 0's count is each
        rank's), and micro-batches a sharded tp_comm mode ran as allreduce below its threshold."""
        if tp.size == 1:
            return

        def collect():
            sent = CounterMetricFamily(
                "afd_tp_comm_bytes",
                "Bytes this TP rank sent in its TP group, by collective.",
                labels=(*BASE_LABELS, "op"),
            )
            for op in ("all_reduce", "reduce_scatter", "all_gather", "all_to_all"):
                sent.add_metric(self._values(op), tp.bytes[op])
            fell = CounterMetricFamily(
                "afd_tp_comm_fallbacks",
                "Micro-batches a sharded tp_comm mode ran as allreduce (fewer tokens than its threshold).",
                labels=(*BASE_LABELS, "mode"),
            )
            fell.add_metric(self._values(tp.cfg.mode), tp.fallbacks[tp.cfg.mode])
            yield sent
            yield fell

        self.registry.register(_Collector(collect))

    def watch_spec_decode(self, stats) -> None:
        """MTP speculative decoding's counters (afd.engine.speculative.SpecDecodeStats), read at scrape
        time, under vLLM's names (vllm/v1/spec_decode/metrics.py) with the afd_ prefix. Acceptance rate:
        rate(afd_spec_decode_num_accepted_tokens_total) / rate(afd_spec_decode_num_draft_tokens_total);
        tokens per step of a drafting request: 1 + rate(..._num_accepted_tokens_total) /
        rate(afd_spec_decode_num_drafts_total)."""

        def collect():
            for name, doc, value in (
                ("afd_spec_decode_num_drafts", "Number of spec decoding drafts.", stats.num_drafts),
                ("afd_spec_decode_num_draft_tokens", "Number of draft tokens.", stats.num_draft_tokens),
                ("afd_spec_decode_num_accepted_tokens", "Number of accepted tokens.", stats.num_accepted_tokens),
            ):
                fam = CounterMetricFamily(name, doc, labels=BASE_LABELS)
                fam.add_metric(self._values(), value)
                yield fam
            fam = CounterMetricFamily(
                "afd_spec_decode_num_accepted_tokens_per_pos",
                "Accepted tokens per draft position.",
                labels=(*BASE_LABELS, "position"),
            )
            for pos, value in enumerate(stats.num_accepted_tokens_per_pos):
                fam.add_metric(self._values(str(pos)), value)
            yield fam

        self.registry.register(_Collector(collect))

    def step(self, phase: str):
        return self.labels(self._step, phase=phase)


class FFNMetrics(_Metrics):
    def __init__(self, node: str, model_name: str, expert_lo: int, expert_hi: int, num_layers: int):
        super().__init__("ffn", node, model_name)
        self.compute = self._make(
            Histogram,
            "afd_ffn_compute_seconds",
            "Router + experts time per layer and micro-batch.",
            buckets=FINE_BUCKETS,
        )
        self.idle = self._make(
            Histogram,
            "afd_ffn_idle_seconds",
            "Serving-loop time outside compute, per gap: before a layer's compute (waiting "
            "for its inputs) and between steps; compute + idle = the loop's wall time.",
            buckets=FINE_BUCKETS,
        )
        self.tokens = self._make(Counter, "afd_ffn_tokens", "Tokens through this node's MoE layers.")
        self.prefetch_bytes = self._make(Counter, "afd_prefetch_bytes", "Expert weight bytes prefetched.")
        self.expert_counts = torch.zeros(expert_hi - expert_lo, dtype=torch.int64)
        self._lo = expert_lo
        # Seconds per layer: a bounded label (a model has a few dozen layers), kept in plain lists since
        # a labelled Prometheus child costs a lock and a dict lookup per observation on the hot path.
        self.layer_compute = [0.0] * num_layers
        self.layer_idle = [0.0] * num_layers
        self.prefetch_budget = [0] * num_layers
        """Bytes each layer's last prefetch was allowed (afd.dataplane.prefetch_budget): computed, so exported."""
        self.zero_tokens = 0
        """Token assignments to identity experts: a device tensor once counted, read at scrape time."""
        self.registry.register(_Collector(self._collect))

    def add_expert_tokens(self, sizes) -> None:
        """sizes [G]: tokens per local expert, a device tensor (added up there and read at scrape time,
        so the hot path has no host sync) or a list."""
        sizes = torch.as_tensor(sizes)
        if self.expert_counts.device != sizes.device:
            self.expert_counts = self.expert_counts.to(sizes.device)
        self.expert_counts += sizes

    def add_routed(self, experts) -> None:
        """A layer's routing (afd.model.experts.Experts after its call): tokens per local expert, and the
        identity-expert assignments where this holder applies them (one FFN node does, so the cluster's sum
        is not multiplied by the number of FFN nodes: every FFN node routes every token). Both stay on the
        device: no host sync on the hot path. Read from the module, never from a hook: a graph (afd.model
        .ffn_graph) runs no Python per call, and recounts both over its real rows."""
        self.add_expert_tokens(experts.last_counts)
        if experts.last_zero is not None:
            self.zero_tokens = self.zero_tokens + experts.last_zero

    def watch_ffn_graph(self, passes: dict[str, int] | None) -> None:
        """afd_ffn_layer_passes_total{mode}: MoE layer forward passes (one per layer and micro-batch) as a
        compiled graph padded to a token bucket, or eager; read at scrape time from afd.model.ffn_graph's
        FFNGraph.passes (None in eager mode: no such metric)."""
        if passes is None:
            return

        def collect():
            fam = CounterMetricFamily(
                "afd_ffn_layer_passes",
                "MoE layer forward passes (per layer and micro-batch) by mode: graph (compiled, padded to a "
                "token bucket) or eager.",
                labels=(*BASE_LABELS, "mode"),
            )
            for mode in ("graph", "eager"):
                fam.add_metric(self._values(mode), passes[mode])
            yield fam

        self.registry.register(_Collector(collect))

    def _collect(self):
        experts = CounterMetricFamily(
            "afd_expert_tokens", "Token-expert assignments per routed expert.", labels=(*BASE_LABELS, "expert")
        )
        bind_device(self.expert_counts.device)  # the scrape thread reads a device tensor: bind first
        for i, n in enumerate(host_syncs.to_list(self.expert_counts)):
            experts.add_metric(self._values(str(self._lo + i)), n)
        yield experts
        zero = CounterMetricFamily(
            "afd_zero_expert_tokens",
            "Token assignments to zero-computation (identity) experts; 0 on FFN nodes that do not apply them.",
            labels=BASE_LABELS,
        )
        if isinstance(self.zero_tokens, torch.Tensor):
            host_syncs.note(self.zero_tokens.device)
        zero.add_metric(self._values(), int(self.zero_tokens))
        yield zero
        for name, values, doc in (
            ("afd_ffn_layer_compute_seconds", self.layer_compute, "Router + experts time per layer."),
            (
                "afd_ffn_layer_idle_seconds",
                self.layer_idle,
                "Time before each layer's compute (waiting for "
                "its inputs) per layer; the rest of afd_ffn_idle_seconds is spent between steps.",
            ),
        ):
            fam = CounterMetricFamily(name, doc, labels=(*BASE_LABELS, "layer"))
            for layer, v in enumerate(values):
                fam.add_metric(self._values(str(layer)), v)
            yield fam
        budget = GaugeMetricFamily(
            "afd_prefetch_budget_bytes",
            "Bytes the FFN node's weight prefetch may hint per layer: memory bandwidth x the measured wait "
            "for the layer's inputs, within the cache (0: prefetch off or no gap measured yet).",
            labels=(*BASE_LABELS, "layer"),
        )
        for layer, v in enumerate(self.prefetch_budget):
            budget.add_metric(self._values(str(layer)), v)
        yield budget


class _Collector:
    """Exports the metric families `collect` builds at scrape time from plain values."""

    def __init__(self, collect):
        self.collect = collect


def serve_metrics(host: str, port: int, metrics: _Metrics, healthy, what: str = "metrics") -> ThreadingHTTPServer:
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
