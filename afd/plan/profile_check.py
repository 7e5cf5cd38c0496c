"""The cluster's own decode step at each batch size (`afd profile` without --no-cluster): the YAML's model
at 1A1F on this machine (afd.cluster.local, the nodes `afd launch` starts), overlap as the YAML says and one
micro-batch, so that the fitted pieces and the link can be held against the step they should add up to.
The nodes are started once and take an untimed warm-up job, then one job per batch size."""

from __future__ import annotations

import statistics
import time


def cluster_steps(config, batch_sizes, context: int, steps: int, log=print) -> list[dict]:
    """[{batch, step, wait_fraction}] per batch size: the median decode step (seconds, after 2 warm-up steps)
    of attention node 0 and the share of it spent waiting on the FFN node. config: an afd.LLM's resolved
    configuration (its model path resolved, its dtype the checkpoint's)."""
    from afd.cluster.local import LocalCluster
    from afd.cluster.local_spec import LocalClusterSpec

    mod = config.model
    spec = LocalClusterSpec(
        mod.path,
        1,
        1,
        dtype=str(mod.dtype),
        quantization=mod.quantization,
        dummy_weights=mod.dummy_weights,
        seed=mod.seed,
        overlap=config.layout.overlap,
        micro_batches=1,
        block_size=config.engine.block_size,
    )
    from afd.model.registry import load_config
    from afd.plan.profile_measure import synthetic_prompts

    vocab = load_config(mod.path).vocab_size
    out = []
    with LocalCluster(spec) as cluster:
        cluster.start()
        # untimed: the nodes' first job pays for their first-use costs (allocator, lazy inits)
        cluster.generate(synthetic_prompts(max(batch_sizes), context, vocab, offset=40_000), 4, ignore_eos=True)
        for b in batch_sizes:
            t0 = time.perf_counter()
            prompts = synthetic_prompts(b, context, vocab, offset=50_000 + b)
            _, reports = cluster.generate(prompts, steps + 3, ignore_eos=True)
            decode = [s for s in reports[0]["steps"][1:] if s["tokens"] == b][2:]
            total = sum(s["seconds"] for s in decode)
            out.append(
                {
                    "batch": b,
                    "step": statistics.median(s["seconds"] for s in decode),
                    "wait_fraction": sum(s["ffn_wait"] for s in decode) / total if total else 0.0,
                }
            )
            log(f"cluster 1A1F batch {b}: {time.perf_counter() - t0:.1f}s")
        cluster.close()
    return out
