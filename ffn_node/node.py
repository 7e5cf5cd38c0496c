"""`FFNNode`: an FFN node process of a cluster YAML — bring-up, /health and /metrics, the pairs attention
ranks form with it (ffn_node/pairs.py), the serving loop (ffn_node/server.py), and its report at exit."""

from __future__ import annotations

import json
import logging
import os
from http.server import ThreadingHTTPServer

import torch

from afd.cluster.topology import served_model_name
from afd.config.placement import format_experts
from afd.config.schema import ClusterConfig
from afd.control import control_pb2 as pb
from afd.dataplane.prefetch import WEIGHTS, PrefetchConfig, PrefetchSchedule
from afd.model.checkpoint import build_ffn_half, open_reader, serving_quant
from afd.model.config import parse_dtype
from afd.model.ffn_graph import FFNGraph, wrap
from afd.model.halves import FFNHalf
from afd.node.runtime import NodeRuntime, bring_up
from afd.observability.ffn_metrics import FFNMetrics
from afd.observability.metrics import serve_metrics
from ffn_node.pairs import PairAcceptor
from ffn_node.server import FFNServer, ServeEnd

log = logging.getLogger("afd.ffn")
_SERVING = (pb.ClusterStatus.READY, pb.ClusterStatus.DRAINING, pb.ClusterStatus.DEGRADED)


class FFNNode:
    def __init__(self, cfg: ClusterConfig, args):
        self.cfg, self.args = cfg, args
        self.dtype: torch.dtype = parse_dtype(cfg.model.dtype)
        self.runtime: NodeRuntime | None = None
        self.ffn: FFNHalf | None = None
        """The experts this node holds, or an FFNGraph standing in for them (graph mode: afd.model.ffn_graph.wrap)."""
        self.metrics: FFNMetrics | None = None
        self.server: FFNServer | None = None
        self.pairs: PairAcceptor | None = None
        self.healthy = True
        """False once the serving loop ended: /health says 503."""
        self._http: ThreadingHTTPServer | None = None

    def start(self) -> None:
        cfg, args = self.cfg, self.args
        self.pairs = PairAcceptor(cfg, args.node)
        rt = self.runtime = bring_up(
            cfg, args.node, args.bind_host, self._load, on_status=_on_status(args.node), pairs=self.pairs
        )
        a, ffn, plane = rt.assignment, self.ffn, rt.plane
        assert a is not None and ffn is not None and plane is not None  # bring_up registered, loaded (_load), paired
        mtp_layers = ffn.mtp_layers  # the MTP module's MoE layer: per-layer metrics too
        self.metrics = metrics = FFNMetrics(
            args.node,
            served_model_name(cfg.model.path, args.served_model_name),
            ffn.held,
            rt.model_cfg.num_layers + len(mtp_layers),
        )
        metrics.watch_cluster_state(lambda: rt.cluster_state)
        metrics.watch_ffn_graph(ffn.passes if isinstance(ffn, FFNGraph) else None)
        node = cfg.node(args.node)
        if node.ports.metrics:
            what = f"FFN node {node.name}'s ports.metrics"
            self._http = serve_metrics(args.bind_host, node.ports.metrics, metrics, self._ready, what)
        pf = cfg.prefetch
        pcfg = PrefetchConfig(pf.enabled, pf.budget_bytes, tuple(pf.weights or WEIGHTS), pf.next_layer)
        prefetch = PrefetchSchedule(ffn, rt.backend, pcfg) if pcfg.active(rt.backend) else None
        log.info("weight prefetch: %s", _describe(prefetch, pcfg))
        self.server = FFNServer(
            ffn,
            rt.backend,
            plane,
            self.pairs.formed,
            self.dtype,
            prefetch=prefetch,
            metrics=metrics,
            rejoin_timeout=cfg.cluster.rejoin_timeout,
            current=self.pairs.current,
            attention_ranks=len(a.peer_ranks),
            exchange_dtype=cfg.layout.exchange_dtype,
            routing=cfg.routing,
            join_timeout=cfg.cluster.startup_timeout,
        )
        log.info("serving the pairs of %d attention rank(s)", len(a.peer_ranks))

    def _load(self, rt: NodeRuntime) -> None:
        a, cfg, name = rt.assignment, self.cfg, self.args.node
        assert a is not None and self.pairs is not None  # bring_up registers before it loads; start() made pairs
        mcfg = rt.model_cfg
        held = cfg.placement(mcfg.n_routed_experts, mcfg.expert_groups[0]).held_by(name)
        serves_zero = cfg.serves_zero(name)
        self.pairs.experts = held
        reader = open_reader(rt.model_path, self.cfg.model.dummy_weights, self.cfg.model.seed)
        ffn = build_ffn_half(
            mcfg,
            reader,
            self.dtype,
            rt.backend.device,
            held,
            serves_zero,
            mtp=self.cfg.engine.speculative_tokens > 0,
            quant=serving_quant(rt.model_path, self.cfg.model.quantization, rt.backend),
        )
        # graph mode as the attention nodes read it; built here, before the data plane forms, so no peer waits
        eng = self.cfg.engine
        # a graph holds a layer's router and experts; under routing attention the router runs on the attention
        # side and the rows per node vary, so the experts run eager (docs/architecture/graph-mode.md)
        mode = "eager" if cfg.routing == "attention" else cfg.layout.graph_mode
        self.ffn = wrap(ffn, rt.backend, mode, eng.graph_batch_sizes, len(a.peer_ranks), eng.compile_cache_dir)
        log.info(
            "experts %s of %d loaded (routing %s)%s",
            format_experts(held),
            mcfg.n_routed_experts,
            cfg.routing,
            ", serving identity experts" if serves_zero else "",
        )

    @property
    def rt(self) -> NodeRuntime:
        """`runtime`, once start() brought the node up."""
        assert self.runtime is not None  # set by start()
        return self.runtime

    def _ready(self) -> bool:
        return self.healthy and self.rt.cluster_state in _SERVING

    def serve(self) -> int:
        """Serves the attention ranks' pairs, as they come and go, until they are gone for good."""
        server = self.server
        assert server is not None  # set by start()
        end = server.serve()
        self.healthy = False
        code = 0
        if end is ServeEnd.ABANDONED:
            log.error("stopping: %s (%s)", end.value, "; ".join(server.peers.gone.values()))
            code = 1
        else:
            log.info("stopped serving: %s", end.value)
        self._report(server)
        if self._http is not None:
            self._http.shutdown()
        self.rt.close()
        return code

    def stop(self) -> None:
        """From the signal thread: the main thread may be blocked in the data plane, which is left to the exit."""
        if self.runtime is not None:
            self.runtime.close(plane=False)

    def _report(self, server: FFNServer) -> None:
        t = server.timers
        log.info(
            "%d steps, %d tokens; compute %.3fs, idle %.3fs",
            server.steps,
            server.tokens,
            t.total("compute"),
            t.total("idle"),
        )
        if self.args.report_file:
            with open(self.args.report_file, "w") as f:
                json.dump(
                    {
                        "steps": server.steps,
                        "tokens": server.tokens,
                        "compute_seconds": t.total("compute"),
                        "idle_seconds": t.total("idle"),
                        "graph": _graph_report(self.ffn),
                    },
                    f,
                )


def _graph_report(ffn) -> dict | None:
    """Graph mode's figures (None: eager): layer passes by mode, and the graphs warm-up built."""
    if not isinstance(ffn, FFNGraph):
        return None
    return {"passes": dict(ffn.passes), "warmup_graphs": ffn.warmup_graphs, "warmup_seconds": ffn.warmup_seconds}


def _describe(prefetch: PrefetchSchedule | None, pcfg: PrefetchConfig) -> str:
    if prefetch is None:
        return "off"
    if pcfg.budget_bytes is not None:
        return f"on, {pcfg.budget_bytes >> 10} KiB per layer (prefetch.budget_bytes)"
    spec = prefetch.budget.spec
    return f"on, per layer min(bandwidth x measured gap, cache): {spec.source}"


RESTART_EXIT = 75
"""The exit code of an FFN node asked to restart (Coordinator.Restart): non-zero, so that its supervisor starts
it again (EX_TEMPFAIL: try again)."""


def _on_status(name: str):
    def on_status(status) -> None:
        if status is None:
            return
        if status.state == pb.ClusterStatus.SHUTDOWN:
            log.info("cluster shut down (%s); exiting", status.message)
            logging.shutdown()
            os._exit(0)
        if name in status.restarting:  # its attention peers re-form without it (replicas) or wait for it
            log.warning("asked to restart (afd rebalance --apply): exiting for the supervisor to start it again")
            logging.shutdown()
            os._exit(RESTART_EXIT)

    return on_status
