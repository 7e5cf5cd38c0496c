"""Graph mode's warm-up: every graph a node can meet, compiled (on CUDA, captured) before it serves.

Where the backend asks for it (`Backend.capture_at_warmup`), the factory calls `warm_up` once the runner's
half is a GraphHalf: for each bucket up to the largest micro-batch the engine can form, and each block-table
width up to the longest sequence its KV cache holds, each layer's pre_moe and post_moe graph runs once over
placeholder rows. The placeholders are what a padded row is (position 0 of the scratch block), so their KV
writes touch no sequence. The graphs are the compute between two exchanges, so no FFN round trip is needed;
a remote exchange still gets an idle step now and then (`keep_alive`), since the FFN nodes wait for this
node's next step header no longer than cluster.comm_timeout. After warm-up a step compiles nothing: a
(bucket, width) left out runs eager (GraphHalf._fn).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from afd.engine.graph_half import GraphHalf
from afd.model.attention_metadata import AttentionMetadata

log = logging.getLogger("afd.graph")

KEEP_ALIVE_SECONDS = 1.0
"""Seconds at most between idle steps to the FFN nodes during warm-up: far below any comm_timeout, and
rare enough that an idle step paced by another attention node's steps costs little."""


def shapes(buckets: list[int], max_rows: int, max_blocks: int) -> list[tuple[int, int]]:
    """The (bucket, width) pairs a step can pad to: buckets up to the one a micro-batch of max_rows takes
    (all of them if none does: the larger batches run eager), widths 1, 2, 4, ... up to max_blocks'."""
    fit = [b for b in buckets if b >= max_rows]
    used = [b for b in buckets if b <= fit[0]] if fit else list(buckets)
    top = 1 << max(0, max_blocks - 1).bit_length()
    widths = [1 << k for k in range(top.bit_length())]
    return [(b, w) for b in used for w in widths]


@torch.inference_mode()  # as the runner's steps: a graph traced outside it would be traced again inside
def warm_up(half: GraphHalf, kv, max_rows: int, max_blocks: int, keep_alive: Callable[[], object] | None = None):
    """Compiles every (phase, layer) graph of each (bucket, width) in `shapes`, logs how many and how long,
    and leaves `half` compiling nothing more."""
    t0 = last = time.perf_counter()
    half._compiles_left = -1  # no per-step limit while warming up
    device = kv.data.device
    for bucket, width in shapes(half.buckets, max_rows, max_blocks):
        table = [half.scratch_block] + [0] * (width - 1)
        meta = AttentionMetadata.build([0] * bucket, [1] * bucket, [table] * bucket, half.block_size, device)
        x, rope = half.attn.embed(torch.zeros(bucket, dtype=torch.long, device=device), meta)
        s = half._pad_step(rope, meta)
        assert s is not None and (s.bucket, s.width) == (bucket, width)
        for layer in range(half.attn.cfg.num_layers):
            cache = kv.layer(layer)
            pre, post = half._fn("pre", layer, s), half._fn("post", layer, s)  # None: no compiler, eager
            h, m = half.attn.pre_moe(layer, x, rope, meta, cache) if pre is None else pre(x, s.rope, *s.meta, cache)
            x = (
                half.attn.post_moe(layer, h, m, rope, meta, cache)
                if post is None
                else post(h, m, s.rope, *s.meta, cache)
            )
            if keep_alive is not None and time.perf_counter() - last > KEEP_ALIVE_SECONDS:
                keep_alive()
                last = time.perf_counter()
    half.warmed_up, half._compiles_left = True, 0
    half.warmup_graphs = sum(fn is not None for fn in half._fns.values())
    half.warmup_seconds = time.perf_counter() - t0
    log.info(
        "graph mode: warm-up compiled %d graphs (buckets up to %d rows, block tables up to %d blocks) in %.1fs",
        half.warmup_graphs,
        max_rows,
        max_blocks,
        half.warmup_seconds,
    )
