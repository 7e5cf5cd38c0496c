"""An attention node's Prometheus metrics: requests (vLLM's names and bucket sets), the engine's steps and
the exchange seen from the attention side."""

from __future__ import annotations

import re

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from afd.observability.metrics import BASE_LABELS, FINE_BUCKETS, Collector, NodeMetrics

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
MAX_FIELD_LABELS = 32
"""Distinct field names afd_ignored_request_fields_total keeps a series for; later names count as other."""
_FIELD_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


class AttentionMetrics(NodeMetrics):
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
        # vLLM's vllm:prefix_cache_queries / _hits: their ratio is the hit rate (0 with prefix caching off)
        self.prefix_cache_queries = self._make(
            c, "afd_prefix_cache_queries", "Prefix cache queries, in tokens: each admitted request's tokens."
        )
        self.prefix_cache_hits = self._make(
            c, "afd_prefix_cache_hits", "Prefix cache hits, in tokens: those found in cached KV blocks."
        )
        self._step = self._make(h, "afd_step_seconds", "Forward step time.", ("phase",), buckets=FINE_BUCKETS)
        self.ffn_wait = self._make(
            h,
            "afd_ffn_wait_seconds",
            "Per step, time blocked waiting for FFN results (exchange not hidden).",
            buckets=FINE_BUCKETS,
        )
        self.a2f_bytes = self._make(c, "afd_a2f_bytes", "Bytes of hidden states sent to FFN nodes.")
        self._exchange_bytes = self._make(
            c,
            "afd_exchange_bytes",
            "Bytes of the MoE exchange with the FFN nodes, by direction: to_ffn the inputs as sent "
            "(layout.exchange_dtype), to_attention the results.",
            ("direction",),
        )
        self.zero_expert_tokens = self._make(
            c,
            "afd_zero_expert_tokens",
            "Token assignments to zero-computation (identity) experts this node applied itself "
            "(layout.routing attention; under routing ffn an FFN node counts them).",
        )
        self.micro_batches = self._make(
            g, "afd_micro_batches", "Micro-batches the last step ran with (fixed, or MicroBatchTuner's choice)."
        )
        self.engine_dead = self._make(g, "afd_engine_dead", "1 once the engine stopped for good (/health is 503).")
        doc = f"Request fields ignored: in no vLLM request model, unknown to afd (past {MAX_FIELD_LABELS}: other)."
        self._ignored = self._make(c, "afd_ignored_request_fields", doc, ("field",))
        self._ignored_names: set[str] = set()
        for reason in ("stop", "length", "abort"):  # exported at 0 before the first request, so
            self.labels(self._success, finished_reason=reason)  # dashboards show 0, not "no data"
        for phase in ("prefill", "decode", "mixed"):
            self.labels(self._step, phase=phase)
        for direction in ("to_ffn", "to_attention"):
            self.exchange_bytes(direction)

    def exchange_bytes(self, direction: str):
        """afd_exchange_bytes_total{direction}: to_ffn or to_attention (afd.dataplane.protocol.DIRECTIONS)."""
        return self.labels(self._exchange_bytes, direction=direction)

    def ignored_field(self, name: str) -> None:
        """Counts one ignored field. The names come from clients, and each label value is a series kept for
        good (here and in Prometheus): a client sending random names must not grow them without bound."""
        if name not in self._ignored_names:
            if len(self._ignored_names) >= MAX_FIELD_LABELS or not _FIELD_NAME.fullmatch(name):
                name = "other"
            self._ignored_names.add(name)
        self.labels(self._ignored, field=name).inc()

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

        self.registry.register(Collector(collect))

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

        self.registry.register(Collector(collect))

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

        self.registry.register(Collector(collect))

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

        self.registry.register(Collector(collect))

    def step(self, phase: str):
        return self.labels(self._step, phase=phase)
