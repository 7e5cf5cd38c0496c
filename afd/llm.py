"""`afd.LLM`: offline generation, colocated (both halves in this process) or across AFD node processes."""

from __future__ import annotations

import torch

from afd.backend import get_backend
from afd.checkpoint import build_attention_half, build_ffn_half, open_reader
from afd.config import CacheConfig, ModelConfig
from afd.generation import generate
from afd.kv_cache import KVCache, blocks_needed
from afd.local_cluster import LocalClusterSpec, run_generate
from afd.moe_exchange import LocalMoE
from afd.runner import ModelRunner
from afd.sampling import SamplingParams

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPES)}")
    return DTYPES[name]


def validate_prompts(cfg: ModelConfig, prompts, max_tokens) -> list[int]:
    """Checks token ids and lengths; returns max_tokens as one int per prompt."""
    if not isinstance(prompts, list) or not all(isinstance(p, list) for p in prompts):
        raise ValueError("prompt_token_ids must be a list of lists of token ids")
    per = list(max_tokens) if isinstance(max_tokens, (list, tuple)) else [max_tokens] * len(prompts)
    if len(per) != len(prompts):
        raise ValueError(f"max_tokens has {len(per)} entries for {len(prompts)} prompts")
    for i, (p, n) in enumerate(zip(prompts, per)):
        if not p:
            raise ValueError(f"prompt {i} is empty")
        bad = [t for t in p if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt {i}: token id {bad[0]!r} is outside the vocabulary [0, {cfg.vocab_size})")
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"max_tokens must be at least 1, got {n}.")
        if len(p) + n > cfg.max_position_embeddings:
            raise ValueError(f"prompt {i}: {len(p)} tokens + max_tokens {n} exceed the model's maximum "
                             f"context length of {cfg.max_position_embeddings} tokens")
    return per


class LLM:
    """Offline generation.

    model: an HF checkpoint directory (LongCat-Flash). With `dummy_weights`, only its config.json is read
    and the weights are seeded random.
    """

    def __init__(self, model: str, dtype: str = "float32", device: str = "cpu", dummy_weights: bool = False,
                 seed: int = 0, block_size: int = 16, attention_nodes: int | None = None,
                 ffn_nodes: int | None = None, colocated: bool | None = None, overlap: bool = True,
                 micro_batches: int = 1):
        """Colocated unless attention_nodes or ffn_nodes is given (or colocated=False): then every
        generate() call runs that many node processes on this machine (afd.local_cluster)."""
        self.cfg = ModelConfig.from_dir(model)
        self.dtype = parse_dtype(dtype)
        self.cache_cfg = CacheConfig(block_size=block_size)
        self.overlap, self.micro_batches = overlap, micro_batches
        if colocated is None:
            colocated = attention_nodes is None and ffn_nodes is None
        self.cluster = None if colocated else LocalClusterSpec(
            model, attention_nodes or 1, ffn_nodes or 1, dtype, dummy_weights, seed, overlap, micro_batches,
            block_size)
        if self.cluster:
            if device != "cpu":
                raise ValueError("multi-process afd.LLM runs on the CPU; launch nodes for devices (afd launch)")
            return
        self.backend = get_backend(device)
        reader = open_reader(model, dummy=dummy_weights, seed=seed)
        dev = self.backend.device
        self.attn = build_attention_half(self.cfg, reader, self.dtype, dev)
        self.ffn = build_ffn_half(self.cfg, reader, self.dtype, dev)

    def generate(self, prompt_token_ids: list[list[int]], max_tokens: int | list[int],
                 temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                 ignore_eos: bool = False, logits_out: list | None = None) -> list[list[int]]:
        """Generated token ids per prompt. `logits_out`, if given, receives each step's fp32 logits."""
        per = validate_prompts(self.cfg, prompt_token_ids, max_tokens)
        if self.cluster:
            if logits_out is not None:
                raise ValueError("logits_out is only available colocated")
            return run_generate(self.cluster, prompt_token_ids, per, temperature, ignore_eos)[0]
        bs = self.cache_cfg.block_size
        num_blocks = sum(blocks_needed(len(p) + n, bs) for p, n in zip(prompt_token_ids, per))
        kv = KVCache(self.cfg, num_blocks, bs, self.dtype, self.backend.device)
        runner = ModelRunner(self.attn, LocalMoE(self.ffn, self.backend), kv, self.backend.device,
                             micro_batches=self.micro_batches, overlap=self.overlap)
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        return generate(runner, kv, prompt_token_ids, per, params, self.cfg.eos_token_ids, ignore_eos,
                        logits_out)
