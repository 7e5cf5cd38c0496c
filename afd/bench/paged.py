"""`afd bench-paged`: decode step time against context length, attention reading the paged cache a chunk
of blocks at a time (afd/model/paged_attention.py) against the whole-sequence gather it replaced.

The gather is kept only as the reference (afd/bench/paged_gather.py), patched in for the steps that time
it, so both run in one process on the same model, cache and block tables. A step is a whole colocated
decode step (embedding, every layer's attention and MoE, logits) of B sequences at context L, from a KV
cache filled with random latents (the values do not change the time) over block tables drawn at random
from the pool, as a long-running server's are. Implementations and contexts are interleaved over
`--repeats` rounds whose order rotates, and the implementations step by step within a round; each
figure is a median over steps, then over rounds, and the ratio the median of the rounds' ratios.
"""

from __future__ import annotations

import json
import random
import tempfile
import time

from afd.bench.common import count_flag, interleaved, median
from afd.bench.step import add_model_args, model_of
from afd.config.flags import DefaultsHelpFormatter


def add_parser(sub) -> None:
    p = sub.add_parser(
        "bench-paged",
        help="decode step time vs context length: paged attention in place vs a whole-sequence gather",
        formatter_class=DefaultsHelpFormatter,
    )
    add_model_args(p)
    p.add_argument("--contexts", default="256,1024,4096", help="comma-separated context lengths (tokens)")
    count_flag(p, "--batch-size", 8)
    count_flag(p, "--steps", 5, 1, "decode steps timed per round")
    count_flag(p, "--repeats", 5)
    count_flag(p, "--threads", 1)
    p.add_argument(
        "--chunks",
        default=None,
        help="comma-separated blocks per chunk to time (default: the product's, CHUNK_BLOCKS of "
        "afd/model/paged_attention.py)",
    )
    p.add_argument("--output", default=None, help="write the results as JSON here")
    p.set_defaults(func=run)


def run(args) -> int:
    import torch

    from afd.bench.common import Colocated
    from afd.bench.paged_gather import BEFORE, implementation
    from afd.engine.messages import StepSeq
    from afd.model.paged_attention import CHUNK_BLOCKS

    contexts = [int(c) for c in args.contexts.split(",")]
    chunks = str(CHUNK_BLOCKS) if args.chunks is None else args.chunks
    impls = [f"paged chunk={int(c)}" for c in chunks.split(",")] + [BEFORE]
    B, longest = args.batch_size, max(contexts)
    with tempfile.TemporaryDirectory() as tmp:
        model = model_of(args, tmp)
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
