"""HF transformers as the DeepSeek-V4 reference: tiny random DeepseekV4ForCausalLM checkpoints (fp32, made
with save_pretrained into a tmp dir, nothing downloaded) and HF's greedy generation with its logits.

The tiny configs shrink the sliding window and the compression rates so that short prompts plus 64 new
tokens already run past the window, close many CSA windows and several HCA ones."""

from __future__ import annotations

import os

import torch
from hf_reference import greedy_with_logits, scale_weights_

CSA, HCA, SWA = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"

BASE = dict(
    vocab_size=97,
    hidden_size=32,
    moe_intermediate_size=12,
    num_hidden_layers=4,
    num_attention_heads=4,
    head_dim=16,
    q_lora_rank=16,
    partial_rotary_factor=0.5,  # 8 rope dims of 16
    num_experts_per_tok=2,
    n_routed_experts=8,
    o_groups=2,
    o_lora_rank=8,
    index_n_heads=4,
    index_head_dim=8,
    index_topk=3,
    sliding_window=8,
    compress_rates={CSA: 4, HCA: 16},
    hc_mult=4,
    hc_sinkhorn_iters=20,
    layer_types=[SWA, CSA, HCA, CSA],
    mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
    swiglu_limit=0.5,  # low enough that the clip bites at the fixtures' weight scale
    max_position_embeddings=2048,  # room for the 1,024-token prompts
    eos_token_id=None,  # no early stop: every prompt runs the full 64 tokens past the window and the rates
    bos_token_id=1,
)

V4_CONFIGS = {
    # every layer type, hash then learned MoE, 4 streams
    "all_types": dict(seed=40),
    # 2 streams; HCA first (as the published models), CSA with a wider top-k; tied embeddings; 3 groups
    "hc2": dict(
        seed=41,
        hc_mult=2,
        num_hidden_layers=3,
        layer_types=[HCA, CSA, SWA],
        mlp_layer_types=["hash_moe", "moe", "moe"],
        o_groups=4,
        o_lora_rank=4,
        index_topk=5,
        num_experts_per_tok=3,
        tie_word_embeddings=True,
        swiglu_limit=10.0,
    ),
    # YaRN on the compressed layers' rope (as the released checkpoints), CSA rate 2, learned MoE only
    "yarn": dict(
        seed=42,
        num_hidden_layers=3,
        layer_types=[CSA, HCA, CSA],
        mlp_layer_types=["moe", "moe", "moe"],
        compress_rates={CSA: 2, HCA: 8},
        sliding_window=6,
        index_topk=4,
        compress_rope_theta=1600.0,
        rope_parameters=dict(
            rope_type="yarn", factor=4.0, original_max_position_embeddings=32, beta_fast=8, beta_slow=1
        ),
    ),
}


def make_v4_checkpoint(path: str, seed: int = 0, weight_std: float = 0.2, **overrides) -> str:
    """A DeepseekV4ForCausalLM with random weights (larger than HF's init, so that routing and attention
    are far from uniform), random attention sinks, compressor position biases and correction biases, and a
    random tid2eid table (distinct experts per token), saved as save_pretrained writes it."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    cfg = DeepseekV4Config(**{**BASE, **overrides})
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(cfg)
    scale_weights_(model, weight_std)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                picks = torch.rand(cfg.vocab_size, cfg.n_routed_experts, generator=g).argsort(dim=-1)
                b.copy_(picks[:, : cfg.num_experts_per_tok])
            elif name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.05, generator=g)
        for layer in model.model.layers:
            for hc in (layer.attn_hc, layer.ffn_hc):
                hc.scale.normal_(1.0, 0.3)
    model.save_pretrained(path)
    return path


def hf_model(path: str):
    from transformers import DeepseekV4ForCausalLM

    return DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation="eager").eval()


def hf_greedy(path: str, prompts: list[list[int]], max_new_tokens: int):
    """Per prompt: (generated ids, per-step fp32 logits), from HF generate with batch size 1."""
    return greedy_with_logits(hf_model(path), prompts, max_new_tokens)
