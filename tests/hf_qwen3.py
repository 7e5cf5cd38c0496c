"""HF transformers as the reference for Qwen3-MoE: tiny random checkpoints and greedy generation."""

from __future__ import annotations

import os

import torch
from hf_reference import greedy_with_logits, scale_weights_

BASE = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=40,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    moe_intermediate_size=12,
    num_experts=6,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    max_position_embeddings=512,
    rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
    eos_token_id=96,
    bos_token_id=1,
)

TINY_CONFIGS = {
    # GQA (2 query heads per KV head), every layer sparse, top-k weights renormalised.
    "gqa": dict(seed=0),
    # Odd sizes, plain MHA, a dense layer from mlp_only_layers, raw softmax weights, attention biases.
    "odd_dense": dict(
        seed=1,
        vocab_size=83,
        hidden_size=36,
        intermediate_size=22,
        num_hidden_layers=3,
        num_attention_heads=3,
        num_key_value_heads=3,
        head_dim=6,
        moe_intermediate_size=9,
        num_experts=7,
        num_experts_per_tok=3,
        norm_topk_prob=False,
        mlp_only_layers=[1],
        attention_bias=True,
        eos_token_id=2,
    ),
    # decoder_sparse_step 2: layers 0 and 2 dense, 1 and 3 sparse; one KV head for all 4 query heads;
    # lm_head tied to the embeddings (the checkpoint has no lm_head.weight).
    "sparse_step": dict(
        seed=2,
        num_hidden_layers=4,
        decoder_sparse_step=2,
        num_key_value_heads=1,
        num_experts_per_tok=3,
        norm_topk_prob=False,
        tie_word_embeddings=True,
    ),
}


def make_qwen3_checkpoint(path: str, seed: int = 0, weight_std: float = 0.2, **overrides) -> str:
    """A Qwen3MoeForCausalLM with random weights larger than HF's init (so that routing and attention
    are far from uniform), saved with save_pretrained (per-expert keys, as on the hub)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    cfg = Qwen3MoeConfig(**{**BASE, **overrides})
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg)
    scale_weights_(model, weight_std)
    model.save_pretrained(path)
    return path


def hf_greedy(path: str, prompts: list[list[int]], max_new_tokens: int):
    """Per prompt: (generated ids, per-step fp32 logits), from HF generate with batch size 1."""
    from transformers import Qwen3MoeForCausalLM

    # The eager experts: torch's grouped_mm needs 16-byte strides, which odd sizes lack.
    model = Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation="eager")
    return greedy_with_logits(model, prompts, max_new_tokens)
