"""The attention node's offline mode: generate for a file of prompts, then leave.

It comes up like any node of a cluster YAML (control plane, ranks, data plane) and runs the static-
batch loop of afd.generation instead of the HTTP engine. `afd generate --attention-nodes A --ffn-nodes
F`, `afd.LLM(..., attention_nodes=A)` and `afd bench-step` run it through afd.local_cluster.
"""

from __future__ import annotations

import json
import logging

from afd.checkpoint import build_attention_half, open_reader
from afd.generation import generate
from afd.kv_cache import KVCache, blocks_needed
from afd.llm import parse_dtype, validate_prompts
from afd.moe_exchange import RemoteMoE
from afd.node_runtime import bring_up
from afd.runner import ModelRunner
from afd.sampling import SamplingParams

log = logging.getLogger("afd.attention")


def run_offline(cfg, args) -> int:
    with open(args.prompts_file) as f:
        spec = json.load(f)
    dtype = parse_dtype(cfg.model.dtype)
    built = {}

    def load(rt) -> None:
        reader = open_reader(rt.model_path, cfg.model.dummy_weights, cfg.model.seed)
        built["attn"] = build_attention_half(rt.model_cfg, reader, dtype, rt.backend.device)

    rt = bring_up(cfg, args.node, args.bind_host, load)
    try:
        mcfg = rt.model_cfg
        prompts, max_tokens = spec["prompts"], spec["max_tokens"]
        per = validate_prompts(mcfg, prompts, max_tokens) if prompts else []
        moe = RemoteMoE(rt.plane, list(rt.assignment.peer_ranks), mcfg.hidden_size, dtype, rt.backend.device)
        bs = cfg.engine.block_size
        blocks = max(1, sum(blocks_needed(len(p) + n, bs) for p, n in zip(prompts, per)))
        kv = KVCache(mcfg, blocks, bs, dtype, rt.backend.device)
        runner = ModelRunner(built["attn"], moe, kv, rt.backend.device, cfg.layout.micro_batches,
                             cfg.layout.overlap)
        steps: list[dict] = []
        last_wait = [0.0]

        def on_step(tokens: int, seconds: float) -> None:
            waited = moe.timers.total("ffn_wait")
            steps.append({"tokens": tokens, "seconds": seconds, "ffn_wait": waited - last_wait[0]})
            last_wait[0] = waited

        params = SamplingParams(temperature=spec.get("temperature", 0.0))
        out = generate(runner, kv, prompts, per, params, mcfg.eos_token_ids, spec.get("ignore_eos", False),
                       on_step=on_step) if prompts else []
        moe.leave()
        with open(args.output_file, "w") as f:
            json.dump({"outputs": out, "steps": steps, "a2f_bytes": moe.bytes_sent,
                       "micro_batches": runner.micro_batches}, f)
        log.info("generated %d sequences in %d steps", len(out), len(steps))
        return 0
    finally:
        rt.close()
