"""HF transformers as the DeepSeek-V3 reference: tiny random checkpoints and greedy generation with logits."""

from __future__ import annotations

import os

import torch
from hf_reference import greedy_with_logits, scale_weights_

BASE = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=40,
    moe_intermediate_size=12,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=8,
    kv_lora_rank=8,
    q_lora_rank=16,
    qk_rope_head_dim=4,
    v_head_dim=8,
    qk_nope_head_dim=8,
    n_group=2,
    topk_group=1,
    num_experts_per_tok=3,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    max_position_embeddings=512,
    eos_token_id=96,
    bos_token_id=1,
)

DEEPSEEK_CONFIGS = {
    # one dense layer first, then MoE layers with 2 groups of which 1 is kept
    "grouped": dict(seed=10),
    # every layer MoE; q without a LoRA; rope dims in halves; 3 of 3 groups (so K > one group's experts);
    # two shared experts; unnormalised weights; tied embeddings
    "odd_sizes": dict(
        seed=12,
        vocab_size=83,
        eos_token_id=82,
        hidden_size=36,
        intermediate_size=22,
        moe_intermediate_size=9,
        num_hidden_layers=2,
        num_attention_heads=3,
        num_key_value_heads=3,
        n_shared_experts=2,
        n_routed_experts=9,
        kv_lora_rank=6,
        q_lora_rank=None,
        qk_rope_head_dim=6,
        v_head_dim=7,
        qk_nope_head_dim=5,
        n_group=3,
        topk_group=3,
        num_experts_per_tok=4,
        first_k_dense_replace=0,
        norm_topk_prob=False,
        rope_interleave=False,
        routed_scaling_factor=1.5,
        tie_word_embeddings=True,
    ),
    # YaRN: a stretched context (blended inverse frequencies), mscale on cos/sin and on the softmax scale;
    # two dense layers first, 4 groups keeping 2
    "yarn": dict(
        seed=18,
        max_position_embeddings=64,
        num_hidden_layers=4,
        first_k_dense_replace=2,
        qk_rope_head_dim=8,
        n_routed_experts=12,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=4,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=50.0,
            factor=4.0,
            original_max_position_embeddings=16,
            beta_fast=8,
            beta_slow=1,
            mscale=1.3,
            mscale_all_dim=0.7,
        ),
    ),
}


def make_deepseek_checkpoint(
    path: str, seed: int = 0, bias_std: float = 0.05, weight_std: float = 0.2, **overrides
) -> str:
    """A DeepseekV3ForCausalLM with random weights (larger than HF's init, so that routing and attention
    are far from uniform) and a non-zero e_score_correction_bias, saved as save_pretrained writes it."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    cfg = DeepseekV3Config(**{**BASE, **overrides})
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(cfg)
    scale_weights_(model, weight_std)
    with torch.no_grad():
        for layer in model.model.layers[cfg.first_k_dense_replace :]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, bias_std)
    model.save_pretrained(path)
    return path


def hf_greedy(path: str, prompts: list[list[int]], max_new_tokens: int):
    """Per prompt: (generated ids, per-step fp32 logits), from HF generate with batch size 1."""
    from transformers import DeepseekV3ForCausalLM

    # the eager expert loop: grouped_mm (the default) needs 16-byte aligned sizes, which odd_sizes lacks
    model = DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation="eager")
    return greedy_with_logits(model, prompts, max_new_tokens)
