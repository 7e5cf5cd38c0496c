"""What the benchmark commands' smoke tests share: a tiny LongCat-Flash config and a command's parsed flags."""

from __future__ import annotations

import argparse

TINY_LONGCAT = dict(
    model_type="longcat_flash",
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
    max_position_embeddings=64,
    eos_token_id=2,
)


def bench_args(module, command: str, argv: list[str]) -> argparse.Namespace:
    """`afd COMMAND ARGV...` parsed by the module's own add_parser, as afd.cli would."""
    parser = argparse.ArgumentParser()
    module.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args([command, *argv])
