"""The attention half in graph mode: its decode layers as compiled graphs, one per batch-size bucket.

`GraphHalf` wraps an attention half and is used in its place (embed, pre_moe, post_moe, logits, and
every other attribute passed through), so the runner cannot tell the two apart. A micro-batch whose
every sequence decodes one token and whose size B fits a bucket of `engine.graph_batch_sizes` is padded
to that bucket P and each layer's pre_moe / post_moe runs as the backend's compiled graph for
(phase, layer, P, block-table width rounded up to a power of two); anything else runs eager.

Padded rows decode a dummy token at position 0 of a scratch block, one block of the KV cache taken from
the allocator for good (never in any block table), so their cache writes collide with no real sequence
and they attend to nothing but themselves. Their outputs are sliced off: the runner sees B rows and
exchanges B rows with the FFN side. The exchange stays outside the graphs (between pre_moe and post_moe).

Graphs compile lazily, one per step (whatever its micro-batches: the runner calls `begin_step` with
them before the first layer): the first steps of a new (bucket, width) run their other layers eager while the graphs
arrive one by one. A step that stalls for every layer's compile would keep the FFN nodes waiting past
cluster.comm_timeout on a cold cache (one inductor compile takes 5-30 s on a CPU); one compile per step
keeps each stall to one graph. Where the backend compiles at warm-up instead (`Backend.capture_at_warmup`:
CUDA, NPU), afd/engine/graph_warmup.py compiles every graph before the node serves and no step compiles.
`steps` (afd_graph_steps_total) counts a micro-batch's forward pass as
graph when every layer of it ran a compiled graph, else as eager (prefill, mixed, above the largest bucket,
graphs still compiling or failed). The (bucket, width) total is logged once its last
graph is in; a warm compile cache (engine.compile_cache_dir) turns compiles into reloads.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from afd.backend.base import named_method, to_device
from afd.model.attention_metadata import AttentionMetadata
from afd.model.halves import AttentionHalf

log = logging.getLogger("afd.graph")


@dataclass
class _Step:
    """One micro-batch's decode step padded to its bucket: what each layer's graph reads."""

    rows: int  # B, the real rows
    bucket: int  # P >= B
    width: int  # block-table columns, a power of two
    rope: tuple  # the rotary tables, [P, ...] each
    meta: tuple  # positions [P], slot mapping [P], block tables [P, width], context lengths [P]
    eager_layers: int = 0  # phases of layers that ran eager (graphs compiling, or failed)
    out: torch.Tensor | None = None  # what pre_moe last returned: the real rows of...
    h: torch.Tensor | None = None  # ...its padded h
    m: torch.Tensor | None = None  # and padded m, which post_moe takes back without padding again


@dataclass
class _MicroBatch:
    meta: AttentionMetadata  # the runner's, passed to every layer of the micro-batch
    step: _Step | None  # None: it runs eager


class GraphHalf(nn.Module):
    attn: AttentionHalf
    supports_graph: ClassVar[bool] = True  # it is the graph
    unquantized: ClassVar[tuple[str, ...]] = ()  # wrapped once quantized (afd.engine.factory)

    def __init__(self, attn: AttentionHalf, backend, buckets, cache_dir: str | None, kv):
        """buckets: the batch sizes that get graphs; kv: the KV cache, which gives up one block as scratch."""
        super().__init__()
        self.attn = attn
        self.backend, self.cache_dir = backend, cache_dir
        self.buckets = sorted(set(buckets))
        self.block_size = kv.block_size
        self.scratch_block = kv.allocator.allocate(1)[0]
        # Names of the graphs carry what their shapes and dtypes depend on beyond (phase, layer, bucket, width):
        # torchair finds a cached graph by module repr and name alone and runs it without a guard.
        self._tag = hashlib.md5(repr((str(kv.data.dtype), tuple(kv.data.shape))).encode()).hexdigest()[:8]
        self.steps = {"graph": 0, "eager": 0}
        """Micro-batch forward passes by mode (afd_graph_steps_total; one per step with one micro-batch):
        graph when every layer ran compiled."""
        self._compiles_left = 1  # graphs the current step may still compile
        self._micro_batches: list[_MicroBatch] = []  # the current step's (begin_step)
        self.compile_seconds: dict[tuple[int, int], float] = {}
        """(bucket, width) -> seconds its graphs took to compile (or load) on their first call."""
        self.prefetch_bytes = 8 << 20 if backend.prefetch_by_default else 0
        self._fns: dict[tuple, Any] = {}  # (phase, layer, bucket, width) -> graph, _FirstCall, or None: eager
        self.warmed_up = False
        """Set by afd.engine.graph_warmup: every graph is in, and a step compiles none (a shape left out: eager)."""
        self.warmup_graphs, self.warmup_seconds = 0, 0.0
        self._not_warmed: set[tuple[int, int]] = set()  # (bucket, width)s a step met after warm-up, said once
        log.info(
            "graph mode on %s: batch buckets %s, compiled %s per bucket and block-table width, cache %s",
            backend.name,
            self.buckets,
            "at warm-up" if backend.capture_at_warmup else "lazily",
            cache_dir or "the backend's default",
        )

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["attn"], name)

    def begin_step(self, metas: list[AttentionMetadata], ropes: list[Any]) -> None:
        """A step begins with these micro-batches (their metadata and rotary tables, as the runner passes
        them to every layer): each is padded to its bucket once, and the step may compile one graph."""
        self._compiles_left = 0 if self.warmed_up else 1
        self._micro_batches = [_MicroBatch(meta, self._pad_step(rope, meta)) for meta, rope in zip(metas, ropes)]

    # ---- the attention half's interface ---------------------------------------------------------------

    def embed(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, Any]:
        return self.attn.embed(input_ids, meta)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn.logits(x)

    def combine(self, i: int, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.attn.combine(i, h, y)

    def moe_reads_token_ids(self, i: int) -> bool:
        return self.attn.moe_reads_token_ids(i)

    def mtp_hidden(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn.mtp_hidden(x)

    def pre_moe(self, i: int, x, rope, meta, kv: torch.Tensor):
        s = self._step(meta)
        fn = None if s is None else self._fn("pre", i, s)
        if s is None or fn is None:
            if s is not None:
                s.eager_layers += 1
                s.out = None
            return self.attn.pre_moe(i, x, rope, meta, kv)
        h, m = fn(_pad(x, s.bucket), s.rope, *s.meta, kv)  # [P, H] each (m None on a dense layer)
        s.eager_layers += self._fns[("pre", i, s.bucket, s.width)] is None  # its first call failed: ran eager
        s.out, s.h, s.m = h[: s.rows], h, m
        return s.out, None if m is None else m[: s.rows]

    def post_moe(self, i: int, h, m, rope, meta, kv: torch.Tensor):
        s = self._step(meta)
        fn = None if s is None else self._fn("post", i, s)
        last = i == self.attn.cfg.num_layers - 1
        if s is None or fn is None:
            if last:  # the micro-batch's pass ends here: count it
                self.steps["eager"] += 1
            return self.attn.post_moe(i, h, m, rope, meta, kv)
        if s.out is not None and s.out is h:
            hp, mp = s.h, s.m
        else:  # pre_moe ran eager (its graph failed): pad here
            hp, mp = _pad(h, s.bucket), None if m is None else _pad(m, s.bucket)
        s.out = s.h = s.m = None
        out = fn(hp, mp, s.rope, *s.meta, kv)[: s.rows]
        s.eager_layers += self._fns[("post", i, s.bucket, s.width)] is None
        if last:
            self.steps["eager" if s.eager_layers else "graph"] += 1
        return out

    # ---- padding ----------------------------------------------------------------------------------------

    def _step(self, meta: AttentionMetadata) -> _Step | None:
        """The padded step of this micro-batch, or None: it runs eager (as does one that begin_step did
        not announce)."""
        return next((mb.step for mb in self._micro_batches if mb.meta is meta), None)

    def _pad_step(self, rope, meta: AttentionMetadata) -> _Step | None:
        B = meta.num_tokens
        if B == 0 or meta.prefill_seqs or meta.decode_rows.numel() != B:
            return None  # prefill or mixed: eager
        P = next((b for b in self.buckets if b >= B), None)
        if P is None:
            return None
        W = 1 << max(0, max(len(s.block_table) for s in meta.seqs) - 1).bit_length()
        tables = [s.block_table + [0] * (W - len(s.block_table)) for s in meta.seqs]
        tables += [[self.scratch_block] + [0] * (W - 1)] * (P - B)  # padded rows: position 0 of the scratch block
        positions = _pad(meta.positions, P)
        slots = _pad(meta.slot_mapping, P, self.scratch_block * self.block_size)
        ctx = _pad(meta.decode_ctx_lens, P, 1)
        # staged through pinned memory: a plain copy to a device makes the host wait for the stream
        table = to_device(torch.tensor(tables, dtype=torch.long), meta.positions.device)
        return _Step(B, P, W, tuple(_pad(t, P) for t in rope), (positions, slots, table, ctx))

    # ---- the compiled graphs -----------------------------------------------------------------------------

    def _fn(self, phase: str, layer: int, s: _Step):
        """The compiled graph of (phase, layer, bucket, width), compiled on its first call; None: eager."""
        key = (phase, layer, s.bucket, s.width)
        fn = self._fns.get(key, False)
        if fn is False:
            if self.warmed_up and (s.bucket, s.width) not in self._not_warmed:
                self._not_warmed.add((s.bucket, s.width))
                log.warning(
                    "graph mode: bucket %d, width %d was not compiled at warm-up; it runs eager", s.bucket, s.width
                )
            if not self._compiles_left:
                return None  # this step has compiled its graph (or warm-up has): this layer runs eager
            self._compiles_left -= 1
            name = f"{phase}_moe_l{layer}_b{s.bucket}_w{s.width}_{self._tag}"
            try:
                graph = self.backend.compile(named_method(self, name, _traced(phase, layer)), self.cache_dir)
                fn = _FirstCall(self, key, graph)
            except Exception as e:  # noqa: BLE001 (the compiler cannot even start: eager, said once)
                log.warning("graph mode: no compiler for %s (%s: %s); it runs eager", name, type(e).__name__, e)
                fn = None
            self._fns[key] = fn
        return fn

    def _compiled(self, key: tuple, seconds: float | None) -> None:
        """A graph's first call ended (seconds) or failed (None: that graph runs eager from now on)."""
        phase, layer, bucket, width = key
        if seconds is None:
            self._fns[key] = None
            return
        self._fns[key] = self._fns[key].fn
        total = self.compile_seconds[(bucket, width)] = self.compile_seconds.get((bucket, width), 0.0) + seconds
        if phase == "post" and layer == self.attn.cfg.num_layers - 1:
            log.info(
                "graph mode: batch bucket %d, block-table width %d: %d layers compiled in %.1fs",
                bucket,
                width,
                self.attn.cfg.num_layers,
                total,
            )

    def _trace(self, phase: str, layer: int, *args):
        """What each graph computes: pre_moe or post_moe of one layer over padded, static-shape inputs."""
        if phase == "pre":
            x, rope, positions, slots, tables, ctx, kv = args
        else:
            x, m, rope, positions, slots, tables, ctx, kv = args
        rows = torch.arange(x.shape[0], device=x.device)
        meta = AttentionMetadata(positions, slots, [], self.block_size, rows, tables, ctx, [])
        if phase == "pre":
            h, m = self.attn.pre_moe(layer, x, rope, meta, kv)
            self._prefetch(layer, phase, h if m is None else m)
            return h, m
        h = self.attn.post_moe(layer, x, m, rope, meta, kv)
        self._prefetch(layer, phase, h)
        return h

    def _prefetch(self, layer: int, phase: str, after: torch.Tensor) -> None:
        """Inside the graph, after `after` is computed: a hint that the weights the next graph reads first
        are needed soon (npu_prefetch; what they are, the half says in `prefetch_weights`)."""
        if self.prefetch_bytes:
            for w in self.attn.prefetch_weights(layer, phase):
                self.backend.prefetch(w, self.prefetch_bytes, after)


class _FirstCall:
    """A compiled graph's first call, which compiles it: timed, and on failure logged once and eager after."""

    def __init__(self, half: GraphHalf, key: tuple, fn):
        self.half, self.key, self.fn = half, key, fn

    def __call__(self, *args):
        t0 = time.perf_counter()
        try:
            out = self.fn(*args)
        except Exception as e:  # noqa: BLE001 (any compile failure: that graph runs eager, the step goes on)
            why = " ".join(line.strip() for line in str(e).splitlines()[:3])
            log.warning("graph mode: %s does not compile (%s: %s); it runs eager", self.key, type(e).__name__, why)
            self.half._compiled(self.key, None)
            phase, layer = self.key[:2]
            return self.half._trace(phase, layer, *args)
        self.half._compiled(self.key, time.perf_counter() - t0)
        return out


def _traced(phase: str, layer: int):
    return lambda half, *args: half._trace(phase, layer, *args)


def _pad(t: torch.Tensor, rows: int, value: int = 0) -> torch.Tensor:
    """t [n, ...] -> [rows, ...], `value` below."""
    n = t.shape[0]
    return t if n == rows else torch.cat([t, t.new_full((rows - n, *t.shape[1:]), value)])
