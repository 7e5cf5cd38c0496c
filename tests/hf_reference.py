"""HF transformers as the reference: tiny random checkpoints and greedy generation with logits."""

from __future__ import annotations

import os

import torch

BASE = dict(
    vocab_size=97,
    hidden_size=32,
    num_layers=2,
    num_attention_heads=4,
    ffn_hidden_size=48,
    q_lora_rank=16,
    kv_lora_rank=8,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    head_dim=4,
    v_head_dim=8,
    moe_topk=3,
    n_routed_experts=6,
    zero_expert_num=2,
    expert_ffn_hidden_size=12,
    routed_scaling_factor=2.5,
    max_position_embeddings=512,
    eos_token_id=96,
    bos_token_id=1,
)

TINY_CONFIGS = {
    "zero_experts": dict(seed=0),
    "no_zero_experts": dict(seed=1, zero_expert_num=0, moe_topk=2),
    "odd_sizes": dict(
        seed=2,
        eos_token_id=2,
        vocab_size=83,
        hidden_size=36,
        num_layers=3,
        num_attention_heads=3,
        ffn_hidden_size=22,
        q_lora_rank=10,
        kv_lora_rank=6,
        qk_nope_head_dim=5,
        qk_rope_head_dim=6,
        head_dim=6,
        v_head_dim=7,
        moe_topk=5,
        n_routed_experts=7,
        zero_expert_num=3,
        expert_ffn_hidden_size=9,
        routed_scaling_factor=6.0,
    ),
    # HF builds the classifier's bias but its router never adds it: neither may afd.
    "router_bias": dict(seed=3, router_bias=True),
}


def make_hf_checkpoint(
    path: str,
    seed: int = 0,
    bias_std: float = 0.05,
    weight_std: float = 0.2,
    max_shard_size: str | None = None,
    **overrides,
) -> str:
    """A LongcatFlashForCausalLM with random weights (larger than HF's init, so that routing and
    attention are far from uniform) and a non-zero e_score_correction_bias, saved in the hub layout."""
    from transformers import LongcatFlashConfig, LongcatFlashForCausalLM

    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    cfg = LongcatFlashConfig(**{**BASE, **overrides})
    torch.manual_seed(seed)
    model = LongcatFlashForCausalLM(cfg)
    scale_weights_(model, weight_std)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.router.e_score_correction_bias.normal_(0.0, bias_std)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kw)
    return path


def hf_greedy(path: str, prompts: list[list[int]], max_new_tokens: int):
    """Per prompt: (generated ids, per-step fp32 logits), from HF generate with batch size 1."""
    from transformers import LongcatFlashForCausalLM

    # The eager expert loop, as for every family: from transformers 5.25 LongCat's experts default to
    # torch._grouped_mm, which needs 16-byte strides that odd_sizes lacks ("strides should be multiple of 16
    # bytes" on the CPU), and the greedy tokens are held to one per-expert computation on every release.
    model = LongcatFlashForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation="eager")
    return greedy_with_logits(model, prompts, max_new_tokens)


def scale_weights_(model, weight_std: float) -> None:
    """Weights larger than HF's init (norms near 1), so that routing and attention are far from uniform."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0.0, weight_std)


def greedy_with_logits(model, prompts: list[list[int]], max_new_tokens: int):
    """Per prompt: (generated ids, per-step fp32 logits), from HF generate with batch size 1."""
    model.eval()
    out = []
    for p in prompts:
        r = model.generate(
            torch.tensor([p]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        out.append((r.sequences[0, len(p) :].tolist(), [x[0].float() for x in r.logits]))
    return out


def max_rel_err(ours: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    return max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(ours, ref))


# Prompts of different lengths; the longest spans several KV blocks at the block sizes tests use.
PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 3],
    [1, 40, 41],
    [60],
    [7, 3, 9, 11, 13, 70, 71, 72, 73],
]
