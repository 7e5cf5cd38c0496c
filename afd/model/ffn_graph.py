"""The FFN half in graph mode: each MoE layer as a compiled graph, one per token bucket.

`FFNGraph` wraps an FFN half and is called in its place (forward(backend, layer, m); layer(), cfg,
mtp_layers and every other attribute passed through), so the FFN server cannot tell the two apart. A
layer's input of T tokens (every attention peer's rows of one micro-batch, concatenated) is padded with
zero rows to the smallest token bucket P >= T and runs as the backend's graph for (layer, P): router,
expert-slot bookkeeping and both grouped GEMMs, whose shapes depend on P and K alone (afd.model.experts).
The P - T padded rows route somewhere and are computed; their outputs are sliced off before anything is
sent, and the layer's counts (Experts.last_counts, last_zero: afd_expert_tokens, the prefetch's guess) are
recounted inside the graph over the real rows. Larger inputs (prefill chunks) run eager. The exchange stays
outside: the server receives into and sends from unpadded buffers, and sizes its messages on the host.

Where the backend builds graphs before serving (Backend.capture_at_warmup: CUDA graphs, torchair), `wrap`
builds every (layer, bucket) graph at once (`warm_up`, from the FFN node's load: before the data plane
forms, so no attention node waits on it) and no step compiles; a graph that fails runs eager, said once.
Where the backend's grouped GEMM reads the group sizes on the host (Backend.grouped_matmul_in_graph: CPU
always, CUDA outside torch._grouped_mm's fused path, e.g. fp32 or before Hopper, NPU beyond
npu_grouped_matmul's limits) the FFN half stays eager, said once: no graph holds a host read.
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Any, cast

import torch
from torch import nn

from afd.backend.base import Backend, named_method
from afd.model.experts import Experts
from afd.model.halves import FFNHalf

log = logging.getLogger("afd.graph")


def token_buckets(batch_sizes, peers: int) -> list[int]:
    """The FFN side's token buckets: the attention side's batch buckets (engine.graph_batch_sizes: a decode
    micro-batch carries one token per sequence), then the largest doubled until `peers` attention ranks'
    largest micro-batches fit one bucket together (the FFN node concatenates every peer's rows)."""
    buckets = sorted(set(batch_sizes))
    top = buckets[-1]
    while buckets[-1] < peers * top:
        buckets.append(2 * buckets[-1])
    return buckets


def wrap(ffn: FFNHalf, backend: Backend, mode: str | None, batch_sizes, peers: int, cache_dir: str | None = None):
    """`ffn`, or an FFNGraph over it (its graphs built now where the backend asks) when graph mode is on
    (`mode`, layout.graph_mode; None: the backend's default) and the backend can hold the layer in a graph."""
    if (mode or backend.graph_mode_default) != "compile":
        return ffn
    experts = [cast(Experts, ffn.layer(i).experts) for i in (*ffn.cfg.moe_layers, *ffn.mtp_layers)]
    if experts[0].quant is not None:  # the quantized grouped GEMMs are not held to a graph's constraints yet
        log.info(
            "graph mode: the FFN half runs eager on %s with quantized experts (%s)",
            backend.name,
            experts[0].quant.method,
        )
        return ffn
    if experts[0].w13.device.type == "cpu":  # a graph traces plain weights
        from afd.backend.cpu_packed import unpack

        unpack(ffn)
    # checked up front: where the sizes go to the host, a CUDA graph's capture fails, which is no fallback
    if not all(backend.grouped_matmul_in_graph(w) for e in experts for w in (e.w13, e.w2)):
        w = experts[0].w13
        log.info(
            "graph mode: the FFN half runs eager on %s: its grouped GEMM reads group sizes on the host (%s, %s)",
            backend.name,
            w.dtype,
            "x".join(map(str, w.shape)),
        )
        return ffn
    graph = FFNGraph(ffn, backend, token_buckets(batch_sizes, peers), cache_dir)
    if backend.capture_at_warmup:
        graph.warm_up()
    return graph


class FFNGraph(nn.Module):
    ffn: FFNHalf

    def __init__(self, ffn: FFNHalf, backend: Backend, buckets, cache_dir: str | None = None):
        super().__init__()
        self.ffn = ffn
        self.backend, self.cache_dir = backend, cache_dir
        self.buckets = sorted(set(buckets))
        self.passes = {"graph": 0, "eager": 0}
        """MoE layer forward passes by mode (afd_ffn_layer_passes_total): one per layer and micro-batch."""
        self._fns: dict[tuple[int, int], Any] = {}  # (layer, P) -> graph, or None: it runs eager
        self._untried: set[tuple[int, int]] = set()  # graphs whose first call (the compile) has not returned
        self.warmed_up = False
        """Set by warm_up: every graph is in, and a call compiles none (a graph left out runs eager)."""
        self.warmup_graphs, self.warmup_seconds = 0, 0.0
        w = self._experts(self.layers[0]).w13
        # torchair finds a cached graph by module repr and method name alone and runs it unguarded: the name
        # carries what the graph's shapes depend on beyond (layer, P)
        self._tag = hashlib.md5(repr((str(w.dtype), tuple(w.shape), ffn.held)).encode()).hexdigest()[:8]
        log.info("graph mode: FFN layers in graphs on %s, token buckets %s", backend.name, self.buckets)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["ffn"], name)

    @property
    def layers(self) -> tuple[int, ...]:
        """The MoE layers this half serves: the decoder's, then the MTP module's."""
        return tuple(self.ffn.cfg.moe_layers) + tuple(self.ffn.mtp_layers)

    def _experts(self, layer: int) -> Experts:
        return cast(Experts, self.ffn.layer(layer).experts)  # FFNHalf.layer's contract: an Experts there

    def forward(self, backend: Backend, i: int, m: torch.Tensor) -> torch.Tensor:
        """FFNHalf.forward: this node's share of layer i's MoE output on m [T, H]."""
        T = m.shape[0]
        P = next((b for b in self.buckets if b >= T), None)
        fn = None if P is None or T == 0 else self._fn(i, P)
        if fn is not None:
            assert P is not None
            x = m if T == P else torch.cat([m, m.new_zeros(P - T, m.shape[1])])  # [P, H]
            real = torch.arange(P, device=m.device) < T  # [P]: no host read, T is the host's
            out = self._call(i, P, fn, x, real)
            if out is not None:
                y, counts, zero = out
                experts = self._experts(i)
                experts.last_counts, experts.last_zero = counts, zero
                self.passes["graph"] += 1
                return y[:T]
        self.passes["eager"] += 1
        return self.ffn(backend, i, m)

    def _call(self, i: int, P: int, fn, x: torch.Tensor, real: torch.Tensor):
        """The graph's outputs, or None where its first call (the compile) failed: eager from then on."""
        key = (i, P)
        if key not in self._untried:
            return fn(x, real)
        t0 = time.perf_counter()
        try:
            out = fn(x, real)
        except Exception as e:  # noqa: BLE001 (any compile failure: that graph runs eager, the step goes on)
            why = " ".join(line.strip() for line in str(e).splitlines()[:3])
            log.warning(
                "graph mode: FFN layer %d, %d tokens does not compile (%s: %s); it runs eager",
                i,
                P,
                type(e).__name__,
                why,
            )
            self._fns[key] = None
            return None
        finally:
            self._untried.discard(key)
        log.debug("graph mode: FFN layer %d, %d tokens compiled in %.2fs", i, P, time.perf_counter() - t0)
        return out

    def _fn(self, layer: int, P: int):
        key = (layer, P)
        if key not in self._fns:
            if self.warmed_up:  # never mid-step on a backend that builds graphs before serving
                log.warning("graph mode: FFN layer %d, %d tokens was not built at warm-up; it runs eager", layer, P)
                self._fns[key] = None
                return None
            name = f"ffn_l{layer}_t{P}_{self._tag}"
            try:
                self._fns[key] = self.backend.compile(named_method(self, name, _trace_layer(layer)), self.cache_dir)
                self._untried.add(key)
            except Exception as e:  # noqa: BLE001 (the compiler cannot even start: eager, said once)
                log.warning("graph mode: no compiler for %s (%s: %s); it runs eager", name, type(e).__name__, e)
                self._fns[key] = None
        return self._fns[key]

    def _trace(self, layer: int, x: torch.Tensor, real: torch.Tensor):
        """What each graph computes: the layer over x [P, H], and its counts over the rows where real [P]."""
        y = self.ffn(self.backend, layer, x)  # [P, H]
        experts = self._experts(layer)
        ids = experts.last_ids  # [P, K], set by the call above
        assert ids is not None
        counts, zero = experts.counts(ids, real)
        return y, counts, zero

    @torch.inference_mode()  # as the server's calls: a graph traced outside it would be traced again inside
    def warm_up(self) -> None:
        """Builds every (layer, bucket) graph over zero rows, then compiles nothing more."""
        t0 = time.perf_counter()
        for layer in self.layers:
            w = self._experts(layer).w13  # [G, H, 2I]: the model's dtype and device
            for P in self.buckets:
                self(self.backend, layer, torch.zeros(P, w.shape[1], dtype=w.dtype, device=w.device))
        self.warmed_up = True
        self.warmup_graphs = sum(fn is not None for fn in self._fns.values())
        self.warmup_seconds = time.perf_counter() - t0
        self.passes.update(graph=0, eager=0)  # the steps' count starts now
        log.info(
            "graph mode: FFN warm-up built %d graphs (%d layers x buckets %s) in %.1fs",
            self.warmup_graphs,
            len(self.layers),
            self.buckets,
            self.warmup_seconds,
        )


def _trace_layer(layer: int):
    def body(half: FFNGraph, x: torch.Tensor, real: torch.Tensor):
        return half._trace(layer, x, real)

    return body
