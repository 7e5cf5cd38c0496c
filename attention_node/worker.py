"""The attention node's offline mode: generate for a file of prompts, then leave.

It comes up like any node of a cluster YAML (control plane, ranks, data plane) and runs the engine
step by step on its prompts (afd.engine.offline) instead of serving HTTP. `afd generate
--attention-nodes A --ffn-nodes F`, `afd.LLM(..., attention_nodes=A)` and `afd bench-step` run it
through afd.cluster.local.
"""

from __future__ import annotations

import json
import logging

from afd.dataplane.exchange import RemoteMoE
from afd.engine import offline
from afd.engine.sampling import SamplingParams
from afd.model.checkpoint import build_attention_half, open_reader
from afd.model.config import parse_dtype
from afd.node.runtime import bring_up

log = logging.getLogger("afd.attention")


def run_offline(cfg, args) -> int:
    with open(args.prompts_file) as f:
        spec = json.load(f)
    dtype = parse_dtype(cfg.model.dtype)
    params = SamplingParams(**spec.get("sampling", {}))
    built = {}

    def load(rt) -> None:
        reader = open_reader(rt.model_path, cfg.model.dummy_weights, cfg.model.seed)
        built["attn"] = build_attention_half(rt.model_cfg, reader, dtype, rt.backend.device)

    rt = bring_up(cfg, args.node, args.bind_host, load)
    try:
        mcfg = rt.model_cfg
        prompts, max_tokens = spec["prompts"], spec["max_tokens"]
        per = offline.validate_prompts(mcfg, prompts, max_tokens) if prompts else []
        moe = RemoteMoE(rt.plane, list(rt.assignment.peer_ranks), mcfg.hidden_size, dtype, rt.backend.device)
        engine = offline.job_engine(built["attn"], moe, prompts, per, dtype, rt.backend.device,
                                    cfg.engine.block_size, cfg.layout.micro_batches, cfg.layout.overlap)
        steps: list[dict] = []
        out = offline.generate(engine, prompts, per, params, spec.get("ignore_eos", False),
                               on_step=lambda s: steps.append(s.report()), progress=True)
        moe.leave()
        with open(args.output_file, "w") as f:
            json.dump({"outputs": out, "steps": steps, "a2f_bytes": moe.bytes_sent,
                       "micro_batches": engine.runner.micro_batches}, f)
        log.info("generated %d sequences in %d steps", len(out), len(steps))
        return 0
    finally:
        rt.close()
