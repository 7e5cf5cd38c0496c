"""When a router's top-k fits torch_npu.npu_moe_gating_top_k, and with which arguments (NpuBackend.moe_gating_top_k).

The op (one kernel): scores = sigmoid (norm_type 1) or softmax (norm_type 0) of logits [T, E] in fp32; groups
scored on scores + bias; the K best experts of the kept groups; weights = their unbiased scores, renormalised
(÷ (sum + eps)) for sigmoid only, times routed_scaling_factor, in the logits' dtype; ids int32.
source: torch_npu.npu_moe_gating_top_k, https://github.com/Ascend/op-plugin/blob/7.2.0/docs/context/
  torch_npu-npu_moe_gating_top_k.md (op-plugin 7.2.0; the same limits in 7.3.0 and 26.0.0); the equivalent
  program of .../blob/master/docs/zh/custom_APIs/torch_npu/torch_npu-npu_moe_gating_top_k.md @517f2e7, and
  CANN ops-transformer moe/moe_gating_top_k/op_kernel/moe_gating_top_k_generalized.h, for what the formulas leave
  open (weights unbiased; no renormalisation with softmax). tests/fakes/torch_npu/ops_gating.py cites them all.
op-plugin 7.1.0's document allows one shape only (E 256, 8 groups, 4 kept, K <= 32, with a bias: DeepSeek-V3's);
afd follows 7.2.0 and later, as it does for npu_mm_reduce_scatter_base.

Shapes: T tokens, E experts, G groups, K top-k.
"""

from __future__ import annotations

import torch

MAX_EXPERTS = 2048
"""E at most 2048; and E / G aligned up to 32, times G, at most 2048 (doc 7.2.0+)."""
EPS = 1e-20
"""The op's eps, and the one afd's routers add to the sum they divide by (HF's DeepSeek-V3 router's)."""


def gating_args(
    logits: torch.Tensor,
    k: int,
    bias: torch.Tensor | None,
    sigmoid: bool,
    groups: int,
    keep_groups: int,
    renormalise: bool,
) -> dict | None:
    """The op's keyword arguments for Backend.moe_gating_top_k's, or None where its documented limits or its
    numerics differ from what was asked (the caller then routes in plain torch)."""
    if logits.dim() != 2 or logits.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return None
    T, E = logits.shape
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != E or bias.dtype != logits.dtype):
        return None  # doc: bias 1-D [E], x's dtype
    # The op renormalises the K weights exactly when it uses sigmoid: a sigmoid router that does not, or a
    # softmax router that does (Qwen3-MoE's norm_topk_prob), is not this op.
    if renormalise != sigmoid:
        return None
    if T == 0 or E > MAX_EXPERTS or groups <= 0 or E % groups:
        return None  # empty x: not documented
    per_group = E // groups
    if per_group <= 2 or -(-per_group // 32) * 32 * groups > MAX_EXPERTS:
        return None
    if not 1 <= keep_groups <= groups or not 1 <= k <= per_group * keep_groups:
        return None
    return dict(
        bias=bias,
        k_group=keep_groups,
        group_count=groups,
        group_select_mode=1,  # a group's score: the sum of its top 2 (DeepSeek-V3's noaux_tc); any with G = 1
        renorm=0,  # the only value: norm, then top-k
        norm_type=1 if sigmoid else 0,
        out_flag=False,  # the scores themselves are not needed
        eps=EPS,
    )
