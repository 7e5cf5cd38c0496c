"""Graph mode: the attention half's decode layers as compiled graphs, one per batch-size bucket.

`layout.graph_mode: compile` (or the backend's default) wraps the attention half where a runner is built
(afd.engine.factory.build_runner, for every path) in a GraphHalf
(afd/engine/graph_half.py), which the runner cannot tell from the half itself. Under attention TP (and so
KVP) the half stays eager: its collectives inside the graphs are future work.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from afd.backend.base import Backend
from afd.config.sections import GRAPH_BATCH_SIZES
from afd.engine.graph_half import GraphHalf
from afd.engine.half import RunnerHalf
from afd.model.halves import AttentionHalf

log = logging.getLogger("afd.graph")

__all__ = ["GraphHalf", "GraphSettings", "graph_report", "resolve_mode", "scratch_blocks", "settings_of", "wrap"]


@dataclass(frozen=True)
class GraphSettings:
    mode: str | None = None
    """eager or compile; None: the backend's `graph_mode_default` (chosen by measurement, see there)."""
    batch_sizes: tuple[int, ...] = GRAPH_BATCH_SIZES
    cache_dir: str | None = None


def settings_of(cfg) -> GraphSettings:
    """The graph settings of a cluster config (layout.graph_mode, engine.graph_batch_sizes / compile_cache_dir)."""
    eng = cfg.engine
    return GraphSettings(cfg.layout.graph_mode, tuple(eng.graph_batch_sizes), eng.compile_cache_dir)


def resolve_mode(settings: GraphSettings | None, device: torch.device) -> str:
    if settings is None:
        return "eager"
    if settings.mode is not None:
        return settings.mode
    from afd.backend.cpu import CpuBackend
    from afd.backend.cuda import CudaBackend
    from afd.backend.npu import NpuBackend

    backends: dict[str, type[Backend]] = {"cpu": CpuBackend, "cuda": CudaBackend, "npu": NpuBackend}
    return backends[device.type].graph_mode_default


def scratch_blocks(settings: GraphSettings | None, tp, device: torch.device) -> int:
    """KV blocks graph mode takes from a cache (the scratch block): what a cache sized for a job adds."""
    return int(resolve_mode(settings, device) == "compile" and tp.size == 1)


def wrap(attn: AttentionHalf, kv, settings: GraphSettings | None, tp, backend=None) -> RunnerHalf:
    """`attn`, or a GraphHalf over it when the settings ask for graph mode and the layout allows it."""
    device = kv.data.device
    if settings is None or resolve_mode(settings, device) != "compile":
        return attn
    if tp.size > 1:  # KVP needs TP ranks: this covers it too
        log.info(
            "graph mode: attention TP (%d ranks%s) runs eager; its collectives inside graphs are future work",
            tp.size,
            f", kvp {tp.cfg.kvp}" if tp.cfg.kvp > 1 else "",
        )
        return attn
    if not attn.supports_graph:
        log.info("graph mode: %s's attention half runs eager (it walks the sequences on the host)", attn.cfg.model_type)
        return attn
    if backend is None:
        from afd.backend import get_backend

        backend = get_backend(device.type, device.index or 0)
    if device.type == "cpu":  # inductor traces plain weights (and lays them out itself)
        from afd.backend.cpu_packed import unpack

        unpack(cast(nn.Module, attn))
    return GraphHalf(attn, backend, settings.batch_sizes, settings.cache_dir, kv)


def graph_report(attn) -> dict | None:
    """A half's graph-mode counters as JSON (None: not in graph mode): forward passes by mode, the compile
    seconds of each "BUCKETxWIDTH", and the graphs compiled at warm-up and its seconds (0: compiled lazily)."""
    if not isinstance(attn, GraphHalf):
        return None
    return {
        "steps": dict(attn.steps),
        "compile_seconds": {f"{b}x{w}": t for (b, w), t in attn.compile_seconds.items()},
        "warmup_graphs": attn.warmup_graphs,
        "warmup_seconds": attn.warmup_seconds,
    }
