"""The attention node's offline mode: generate for a file of prompts, with the MoE half on FFN nodes."""

from __future__ import annotations

import json
import logging

import torch

from afd.backend import get_backend
from afd.checkpoint import build_attention_half, open_reader
from afd.config import ModelConfig
from afd.generation import generate
from afd.kv_cache import KVCache, blocks_needed
from afd.llm import parse_dtype, validate_prompts
from afd.moe_exchange import RemoteMoE
from afd.runner import ModelRunner
from afd.sampling import SamplingParams
from afd.transport import DataPlane

log = logging.getLogger("afd.attention")


def run_offline(args, ffn_ranks: list[int]) -> int:
    cfg = ModelConfig.from_dir(args.model)
    with open(args.prompts_file) as f:
        spec = json.load(f)
    prompts, max_tokens = spec["prompts"], spec["max_tokens"]
    per = validate_prompts(cfg, prompts, max_tokens) if prompts else []
    backend = get_backend(args.device, args.device_index)
    dtype = parse_dtype(args.dtype or "float32")
    attn = build_attention_half(cfg, open_reader(args.model, args.dummy_weights, args.seed), dtype,
                                backend.device)
    plane = DataPlane(backend, args.rank, args.world_size, args.master_addr, args.master_port,
                      args.comm_timeout)
    moe = RemoteMoE(plane, ffn_ranks, cfg.hidden_size, dtype, backend.device)
    bs = args.block_size
    kv = KVCache(cfg, max(1, sum(blocks_needed(len(p) + n, bs) for p, n in zip(prompts, per))), bs, dtype,
                 backend.device)
    runner = ModelRunner(attn, moe, kv, backend.device, micro_batches=args.micro_batches,
                         overlap=not args.no_overlap)
    steps: list[dict] = []

    def on_step(tokens: int, seconds: float) -> None:
        waited = moe.timers.total("ffn_wait")
        steps.append({"tokens": tokens, "seconds": seconds, "ffn_wait": waited - on_step.last_wait})
        on_step.last_wait = waited

    on_step.last_wait = 0.0
    params = SamplingParams(temperature=spec.get("temperature", 0.0))
    try:
        out = generate(runner, kv, prompts, per, params, cfg.eos_token_ids, spec.get("ignore_eos", False),
                       on_step=on_step) if prompts else []
        moe.leave(shutdown=spec.get("shutdown_ffn", False))
    finally:
        plane.close()
    with open(args.output_file, "w") as f:
        json.dump({"outputs": out, "steps": steps, "a2f_bytes": moe.bytes_sent}, f)
    log.info("generated %d sequences in %d steps", len(out), len(steps))
    return 0


def set_threads(n: int) -> None:
    if n:
        torch.set_num_threads(n)
