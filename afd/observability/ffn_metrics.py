"""An FFN node's Prometheus metrics: compute and idle time, experts' loads, prefetch and the passes per
mode. What the hot path counts per layer or per expert is kept in plain lists and exported at scrape time."""

from __future__ import annotations

from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from afd.backend.counters import DeviceCounter
from afd.observability.metrics import BASE_LABELS, FINE_BUCKETS, Collector, NodeMetrics


class FFNMetrics(NodeMetrics):
    def __init__(self, node: str, model_name: str, experts, num_layers: int):
        """experts: the routed experts this node holds (their weight slots' order: Experts.held)."""
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
        self.held = tuple(experts)
        self.counts = DeviceCounter(len(self.held) + 1)
        """Tokens per held expert, then the token assignments to identity experts: added up on the device
        and read at scrape time (afd.backend.counters), so the hot path has no host sync."""
        # Seconds per layer: a bounded label (a model has a few dozen layers), kept in plain lists since
        # a labelled Prometheus child costs a lock and a dict lookup per observation on the hot path.
        self.layer_compute = [0.0] * num_layers
        self.layer_idle = [0.0] * num_layers
        self.prefetch_budget = [0] * num_layers
        """Bytes each layer's last prefetch was allowed (afd.dataplane.prefetch_budget): computed, so exported."""
        self.registry.register(Collector(self._collect))

    def add_expert_tokens(self, sizes) -> None:
        """sizes [G]: tokens per local expert, a device tensor or a list."""
        self.counts.add((0, sizes))

    def add_routed(self, experts) -> None:
        """A layer's routing (afd.model.experts.Experts after its call): tokens per local expert, and the
        identity-expert assignments where this holder applies them (one FFN node does, so the cluster's sum
        is not multiplied by the number of FFN nodes: every FFN node routes every token). Both stay on the
        device: no host sync on the hot path. Read from the module, never from a hook: a graph (afd.model
        .ffn_graph) runs no Python per call, and recounts both over its real rows."""
        parts = [(0, experts.last_counts)]
        if experts.last_zero is not None:
            parts.append((len(self.held), experts.last_zero))
        self.counts.add(*parts)

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

        self.registry.register(Collector(collect))

    def _collect(self):
        experts = CounterMetricFamily(
            "afd_expert_tokens", "Token-expert assignments per routed expert.", labels=(*BASE_LABELS, "expert")
        )
        *per_expert, zero_tokens = self.counts.read()
        for i, n in enumerate(per_expert):
            experts.add_metric(self._values(str(self.held[i])), n)
        yield experts
        zero = CounterMetricFamily(
            "afd_zero_expert_tokens",
            "Token assignments to zero-computation (identity) experts; 0 on FFN nodes that do not apply them.",
            labels=BASE_LABELS,
        )
        zero.add_metric(self._values(), zero_tokens)
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
