"""`afd bench-paged`: decode step time against context length, attention reading the paged cache a chunk
of blocks at a time (afd/model/paged_attention.py) against the whole-sequence gather it replaced.

The gather is kept here only, as the reference: `gather_decode` patches it in for the steps that time
it, so both run in one process on the same model, cache and block tables. A step is a whole colocated
decode step (embedding, every layer's attention and MoE, logits) of B sequences at context L, from a KV
cache filled with random latents (the values do not change the time) over block tables drawn at random
from the pool, as a long-running server's are. Implementations and contexts are interleaved over
`--repeats` rounds whose order rotates, and the implementations step by step within a round; each
figure is a median over steps, then over rounds, and the ratio the median of the rounds' ratios.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import tempfile
import time
from collections.abc import Iterator
from unittest import mock

import torch

from afd.bench.common import interleaved, median
from afd.bench.step import SCENARIOS, add_model_args
from afd.cluster.flags import DefaultsHelpFormatter
from afd.model import paged_attention
from afd.model.gqa import GQAttention
from afd.model.mla import MLAttention

BEFORE = "gather (before)"


def add_parser(sub) -> None:
    p = sub.add_parser(
        "bench-paged",
        help="decode step time vs context length: paged attention in place vs a whole-sequence gather",
        formatter_class=DefaultsHelpFormatter,
    )
    add_model_args(p)
    p.add_argument("--contexts", default="256,1024,4096", help="comma-separated context lengths (tokens)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=5, help="decode steps timed per round")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--chunks",
        default=str(paged_attention.CHUNK_BLOCKS),
        help="comma-separated blocks per chunk to time (the product's default first)",
    )
    p.add_argument("--output", default=None, help="write the results as JSON here")
    p.set_defaults(func=run)


def _mla_gather(self: MLAttention, q_nope, q_rot, meta, cache) -> torch.Tensor:
    """MLAttention._decode_absorbed as it was: every sequence's whole cache copied out, one softmax."""
    w_uk, w_uv = self._w_uk_uv()
    q_full = torch.cat([torch.einsum("bhn,hnc->bhc", q_nope, w_uk), q_rot], dim=-1)  # [B, NH, C + R]
    B, nb = meta.decode_block_tables.shape
    kv = cache[meta.decode_block_tables].view(B, nb * meta.block_size, -1)  # [B, L, C + R]
    score = torch.einsum("bhd,bld->bhl", q_full, kv) * self.scale
    pos = torch.arange(kv.shape[1], device=kv.device)
    score.masked_fill_(pos[None, None, :] >= meta.decode_ctx_lens[:, None, None], float("-inf"))
    p = torch.softmax(score, dim=-1, dtype=torch.float32).to(q_full.dtype)
    o_lat = torch.einsum("bhl,blc->bhc", p, kv[..., : self.kv_lora])  # [B, NH, C]
    return torch.einsum("bhc,hvc->bhv", o_lat, w_uv)


def _gqa_gather(self: GQAttention, q, meta, cache) -> torch.Tensor:
    """GQAttention._decode as it was. q [B, KVH, G, D]."""
    B, nb = meta.decode_block_tables.shape
    k = cache[0][meta.decode_block_tables].view(B, nb * meta.block_size, self.n_kv, -1)  # [B, L, KVH, D]
    v = cache[1][meta.decode_block_tables].view(B, nb * meta.block_size, self.n_kv, -1)
    score = torch.einsum("bkgd,blkd->bkgl", q, k) * self.scale
    pos = torch.arange(k.shape[1], device=k.device)
    score.masked_fill_(pos >= meta.decode_ctx_lens[:, None, None, None], float("-inf"))
    p = torch.softmax(score, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.einsum("bkgl,blkd->bkgd", p, v)


@contextlib.contextmanager
def gather_decode() -> Iterator[None]:
    """Decode through the whole-sequence gather (MLA and GQA) while inside."""
    with (
        mock.patch.object(MLAttention, "_decode_absorbed", _mla_gather),
        mock.patch.object(GQAttention, "_decode", _gqa_gather),
    ):
        yield


@contextlib.contextmanager
def implementation(name: str) -> Iterator[None]:
    if name == BEFORE:
        with gather_decode():
            yield
    else:
        with mock.patch.object(paged_attention, "CHUNK_BLOCKS", int(name.split("=")[1])):
            yield


def run(args) -> int:
    from afd.bench.common import Colocated
    from afd.engine.messages import StepSeq

    contexts = [int(c) for c in args.contexts.split(",")]
    impls = [f"paged chunk={int(c)}" for c in args.chunks.split(",")] + [BEFORE]
    B, longest = args.batch_size, max(contexts)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            model = tmp
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump(SCENARIOS[args.scenario], f)
        col = Colocated(model, dummy_weights=True)
        engine = col.llm.job_engine([[3] * longest] * B, [1] * B, graph_mode="eager")
    runner = engine.runner
    kv = runner.kv.data
    torch.manual_seed(0)
    kv.copy_(torch.randn_like(kv) * 0.5)
    pool = list(range(runner.kv.allocator.num_blocks))
    random.Random(0).shuffle(pool)
    bs = runner.kv.block_size

    def seqs(ctx: int) -> list[StepSeq]:
        nb = -(-ctx // bs)
        return [StepSeq([3 + i], ctx - 1, pool[i * nb : (i + 1) * nb]) for i in range(B)]

    before = torch.get_num_threads()
    torch.set_num_threads(args.threads)

    def one(ctx: str, _round: int) -> dict[str, float]:
        """Each implementation's median step (ms) at this context, their steps taken in turn (the order
        rotating each step) so that a slow phase of the shared machine falls on all of them alike."""
        batch = seqs(int(ctx))
        times: dict[str, list[float]] = {i: [] for i in impls}
        for step in range(args.steps + 1):
            for impl in impls[step % len(impls) :] + impls[: step % len(impls)]:
                with implementation(impl):
                    t0 = time.perf_counter()
                    runner.execute(batch)
                    if step:  # the first is a warm-up
                        times[impl].append(time.perf_counter() - t0)
        return {i: 1e3 * median(t) for i, t in times.items()}

    try:
        rounds = interleaved([str(c) for c in contexts], args.repeats, one, log=lambda s: print(s, flush=True))
    finally:
        torch.set_num_threads(before)
    # per context: each implementation's median over rounds, and the median of the rounds' before / after
    results = {
        c: {i: median(r[i] for r in v) for i in impls} | {"ratio": median(r[BEFORE] / r[impls[0]] for r in v)}
        for c, v in rounds.items()
    }
    print(
        f"\n{args.model or args.scenario} (dummy weights): batch {B}, block size {bs}, {args.threads} thread(s), "
        f"median of {args.steps} steps x {args.repeats} rounds"
    )
    print("| context | " + " | ".join(f"{i} (ms)" for i in impls) + f" | {BEFORE} / {impls[0]} |")
    print("|---" * (len(impls) + 2) + "|")
    for c, r in results.items():
        print(f"| {c} | " + " | ".join(f"{r[i]:.2f}" for i in impls) + f" | {r['ratio']:.2f}x |")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"config": vars(args) | {"func": None}, "results": results, "rounds": rounds}, f, indent=2)
    return 0
