"""An FFN node of a cluster YAML: control plane bring-up, /health and /metrics, then the serving loop."""

from __future__ import annotations

import json
import logging
import os

from afd.control import control_pb2 as pb
from afd.control.client import ControlError
from afd.dataplane.transport import PeerError
from afd.node.args import start_cluster_node
from afd.node.signals import set_stop_handler

log = logging.getLogger("afd.ffn")


def _exit_on_shutdown(status) -> None:
    if status is not None and status.state == pb.ClusterStatus.SHUTDOWN:
        log.info("cluster shut down (%s); exiting", status.message)
        logging.shutdown()
        os._exit(0)


def run_cluster_node(args) -> int:
    cfg = start_cluster_node(args, "ffn")
    if isinstance(cfg, int):
        return cfg
    state = {"rt": None}
    set_stop_handler(lambda _: state["rt"] and state["rt"].close(plane=False))
    from afd.cluster.topology import served_model_name
    from afd.dataplane.prefetch import WEIGHTS, PrefetchConfig, PrefetchSchedule
    from afd.model.checkpoint import build_ffn_half, open_reader
    from afd.model.config import parse_dtype
    from afd.node.runtime import bring_up
    from afd.observability.metrics import FFNMetrics, serve_metrics
    from ffn_node.server import FFNServer, ServeEnd

    dtype = parse_dtype(cfg.model.dtype)
    built = {}

    def load(rt) -> None:
        a = rt.assignment
        reader = open_reader(rt.model_path, cfg.model.dummy_weights, cfg.model.seed)
        built["ffn"] = build_ffn_half(
            rt.model_cfg,
            reader,
            dtype,
            rt.backend.device,
            a.expert_lo,
            a.expert_hi,
            a.serves_zero_experts,
            mtp=cfg.engine.speculative_tokens > 0,
        )
        log.info(
            "experts [%d, %d) of %d loaded%s",
            a.expert_lo,
            a.expert_hi,
            rt.model_cfg.n_routed_experts,
            ", serving identity experts" if a.serves_zero_experts else "",
        )

    node = cfg.node(args.node)
    try:
        rt = state["rt"] = bring_up(cfg, args.node, args.bind_host, load, on_status=_exit_on_shutdown)
    except (ControlError, PeerError, OSError, ValueError) as e:  # ValueError: model config/checkpoint
        log.error("startup failed: %s", e)
        return 1
    a = rt.assignment
    mtp_layers = built["ffn"].mtp_layers  # the MTP module's MoE layer: per-layer metrics too
    metrics = FFNMetrics(
        node.name,
        served_model_name(cfg.model.path, args.served_model_name),
        a.expert_lo,
        a.expert_hi,
        rt.model_cfg.num_layers + len(mtp_layers),
    )
    metrics.watch_cluster_state(lambda: rt.cluster_state)
    metrics.count_zero_experts(built["ffn"].layer(i).experts for i in (*rt.model_cfg.moe_layers, *mtp_layers))
    healthy = {"ok": True}
    http = None
    if node.ports.metrics:
        http = serve_metrics(
            args.bind_host,
            node.ports.metrics,
            metrics,
            lambda: (
                healthy["ok"]
                and rt.cluster_state in (pb.ClusterStatus.READY, pb.ClusterStatus.DRAINING, pb.ClusterStatus.DEGRADED)
            ),
        )
    pf = cfg.prefetch
    pcfg = PrefetchConfig(pf.enabled, pf.budget_bytes, tuple(pf.weights or WEIGHTS), pf.next_layer)
    hook = PrefetchSchedule(built["ffn"], rt.backend, pcfg) if pcfg.active(rt.backend) else None
    log.info("weight prefetch: %s", f"on, {pcfg.budget_bytes >> 20} MiB per wait" if hook else "off")
    server = FFNServer(built["ffn"], rt.backend, rt.plane, list(a.peer_ranks), dtype, layer_hook=hook, metrics=metrics)
    log.info("serving %d attention peer(s)", len(a.peer_ranks))
    code = 0
    while True:
        end = server.serve()
        log.info("stopped serving generation %d: %s", rt.plane.generation, end.value)
        if end is not ServeEnd.REFORM:
            break
        why = "; ".join(server.gone.values())
        healthy["ok"] = False
        if cfg.cluster.rejoin_timeout <= 0:
            log.error("stopping: %s", why)
            code = 1
            break
        try:  # wait for the failed node's replacement, then serve the next generation
            server.reset(rt.reform(why), list(a.peer_ranks))
        except (ControlError, PeerError) as err:
            log.error("stopping: %s; %s", why, err)
            code = 1
            break
        healthy["ok"] = True
        log.info("data plane re-formed; serving %d attention peer(s)", len(a.peer_ranks))
    t = server.timers
    log.info(
        "%d steps, %d tokens; compute %.3fs, idle %.3fs",
        server.steps,
        server.tokens,
        t.total("compute"),
        t.total("idle"),
    )
    if args.report_file:
        with open(args.report_file, "w") as f:
            json.dump(
                {
                    "steps": server.steps,
                    "tokens": server.tokens,
                    "compute_seconds": t.total("compute"),
                    "idle_seconds": t.total("idle"),
                },
                f,
            )
    if http is not None:
        http.shutdown()
    rt.close()
    return code
