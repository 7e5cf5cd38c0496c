"""The attention node's offline mode: generate for a file of prompts, then leave.

It comes up like any node of a cluster YAML (control plane, ranks, data plane) and runs the engine
step by step on its prompts (afd.engine.offline) instead of serving HTTP. `afd generate
--attention-nodes A --ffn-nodes F`, `afd.LLM(..., attention_nodes=A)` and `afd bench-step` run it
through afd.cluster.local.
"""

from __future__ import annotations

import json
import logging

from afd.engine import offline
from afd.engine.graph import graph_report, settings_of
from afd.engine.runner import follow
from afd.engine.sampling import SamplingParams
from afd.model.config import parse_dtype
from afd.node.runtime import bring_up
from attention_node.halves import build_rank, load_halves

log = logging.getLogger("afd.attention")


def run_offline(cfg, args) -> int:
    """The node's job; on a TP rank > 0 (`--tp-rank`), that rank's share of it, led by rank 0. Every
    rank reads the same prompts file, so that their KV caches are sized alike."""
    with open(args.prompts_file) as f:
        spec = json.load(f)
    dtype = parse_dtype(cfg.model.dtype)
    params = SamplingParams(**spec.get("sampling", {}))
    built = {}
    rank = getattr(args, "tp_rank", 0)
    rt = bring_up(cfg, args.node, args.bind_host, lambda rt: built.update(load_halves(rt, dtype)), tp_rank=rank)
    try:
        mcfg = rt.model_cfg
        prompts, max_tokens = spec["prompts"], spec["max_tokens"]
        per = offline.validate_prompts(mcfg, prompts, max_tokens) if prompts else []
        attn, tp, moe = build_rank(rt, built, dtype)
        engine = offline.job_engine(
            attn,
            moe,
            prompts,
            per,
            dtype,
            rt.backend.device,
            cfg.engine.block_size,
            cfg.layout.micro_batches,
            cfg.layout.overlap,
            tp=tp,
            mtp=built.get("mtp"),
            speculative_tokens=cfg.engine.speculative_tokens,
            graph=settings_of(cfg),
        )
        if rank > 0:
            follow(engine.runner)
            log.info("TP rank %d done", rank)
            return 0
        steps: list[dict] = []
        logits: list | None = [] if spec.get("logits") else None
        out = offline.generate(
            engine,
            prompts,
            per,
            params,
            spec.get("ignore_eos", False),
            logits,
            on_step=lambda s: steps.append(s.report()),
            progress=True,
        )
        engine.runner.leave()
        with open(args.output_file, "w") as f:
            json.dump(
                {
                    "outputs": out,
                    "steps": steps,
                    "a2f_bytes": getattr(moe, "bytes_sent", 0),
                    "micro_batches": engine.runner.micro_batches,
                    "tp_bytes": dict(tp.bytes),
                    "tp_fallbacks": dict(tp.fallbacks),
                    "spec_decode": engine.spec.stats.report() if engine.spec else None,
                    "graph": graph_report(engine.runner.attn),
                    "logits": [[t.tolist() for t in p] for p in logits] if logits is not None else None,
                },
                f,
            )
        log.info("generated %d sequences in %d steps", len(out), len(steps))
        return 0
    finally:
        rt.close()
