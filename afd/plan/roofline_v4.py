"""DeepSeek-V4's decode layer as a roofline sees it (afd.plan.roofline_ops' Ops, counted from afd's own kernels in
afd/model/deepseek_v4/): the mHC collapse and expand around each block, shared-KV MQA over a sliding window
plus, by layer type, compressed entries (CSA: the indexer's top-k of them; HCA: all), the grouped low-rank
output projection, and the shared expert in the window.

Its layers differ in their attention, so each kind's ops carry the share of the layers that run it (Op.share)
and a piece is the mean layer: the step's sum over layers is exact, the order of its tasks is the same in
every layer. Per decoding sequence at `context` positions, a layer reads its window (min(context, W) tokens of
one K = V head) and its compressed entries (context // rate of them); the indexer of a CSA layer scores all of
those and attends the top `index_topk`. The compressors, the indexer's weights_proj and wo_a stay in the model
dtype under quantization, as afd.model.deepseek_v4.attention.AttentionHalf.unquantized keeps them; the mHC
weights are fp32 (keep_in_fp32_strict)."""

from __future__ import annotations

from dataclasses import replace

from afd.model.deepseek_v4.config import CSA, HCA, SWA, DeepseekV4Config
from afd.plan.roofline_ops import Op, Precision, elementwise, gemm

FP32 = 4


def hyper(name: str, p: Precision, cfg: DeepseekV4Config, outputs: int) -> Op:
    """An mHC collapse (HyperConnection, HyperHead): the N streams [N*H] normed and projected to `outputs`
    mixing weights by an fp32 weight, then summed into one [H] row."""
    NH = cfg.hc_mult * cfg.hidden_size
    return Op(name, p.model_key, 2.0 * NH * outputs + 2.0 * NH, NH * outputs * FP32, (2 * NH + cfg.hidden_size) * p.act)


def _mix(name: str, p: Precision, cfg: DeepseekV4Config) -> Op:
    """expand / combine: post * out + comb^T streams over [N, H] (N*N*H multiply-adds), streams read and written."""
    N, H = cfg.hc_mult, cfg.hidden_size
    return Op(name, p.model_key, 2.0 * N * N * H, 0.0, (2 * N + 1) * H * p.act)


def _attention(cfg: DeepseekV4Config, p: Precision, context: int, kind: str, share: float) -> list[Op]:
    """One block's attention of `kind` (SWA, CSA, HCA) for a decoding token, every op at `share`."""
    H, D, Hq, rq = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.q_lora_rank
    rate = {SWA: 0, CSA: cfg.csa_rate, HCA: cfg.hca_rate}[kind]
    entries = context // rate if rate else 0
    keys = min(context, cfg.sliding_window) + (min(cfg.index_topk, entries) if kind == CSA else entries)
    g, ro = cfg.o_groups, cfg.o_lora_rank
    ops = [
        elementwise("attn_norm", p, H),
        gemm("wq_a", p, H, rq),
        elementwise("q_norm", p, rq),
        gemm("wq_b", p, rq, Hq * D),
        elementwise("q_head_norm_rope", p, Hq * D),
        gemm("wkv", p, H, D),
        elementwise("kv_norm_rope", p, D),
    ]
    if rate:
        series = 2 if kind == CSA else 1
        ops += [gemm("compressor", p, H, 2 * series * D, quantized=False), elementwise("entries", p, series * D)]
    if kind == CSA:
        c, ih = cfg.index_head_dim, cfg.index_n_heads
        ops += [
            gemm("indexer_compressor", p, H, 4 * c, quantized=False),
            gemm("indexer_wq_b", p, rq, ih * c),
            gemm("indexer_weights_proj", p, H, ih, quantized=False),
            Op("indexer_scores", p.model_key, 2.0 * ih * entries * c, 0.0, entries * c * p.act),
        ]
    ops += [
        # K = V: one head of D per key, read once for all Hq heads
        Op("attend", p.model_key, 4.0 * Hq * keys * D, 0.0, keys * D * p.act),
        elementwise("out_rope", p, Hq * D),
        Op("wo_a", p.model_key, 2.0 * Hq * D * ro, Hq * D * ro * p.act, (Hq * D + g * ro) * p.act),
        gemm("wo_b", p, g * ro, H),
    ]
    return [replace(op, share=share) for op in ops]


def attention_pieces(cfg: DeepseekV4Config, p: Precision, context: int, tp: int) -> dict[str, list[Op]]:
    """pre: mHC collapse, attention, expand, the FFN block's collapse and norm (its input crosses); window: the
    shared expert; post: the expand with the routed experts' output. Every V4 layer is an MoE layer."""
    if tp > 1:
        raise ValueError("attention TP: afd cuts MLA families only (DeepSeek-V4's attention half has no TP)")
    N, H, inter = cfg.hc_mult, cfg.hidden_size, cfg.moe_intermediate_size
    L = cfg.num_hidden_layers
    attention = [
        op
        for kind in (SWA, CSA, HCA)
        for op in _attention(cfg, p, context, kind, cfg.layer_types.count(kind) / L)
        if op.share
    ]
    pre = [
        hyper("hc_attn", p, cfg, (2 + N) * N),
        *attention,
        _mix("attn_expand", p, cfg),
        hyper("hc_ffn", p, cfg, (2 + N) * N),
        _mix("ffn_mix", p, cfg),
        elementwise("ffn_norm", p, H),
    ]
    shared = [
        gemm("shared_gate_up", p, H, 2 * inter),
        elementwise("shared_act", p, 1.5 * inter),
        gemm("shared_down", p, inter, H),
    ]
    return {"attn_pre": pre, "attn_window": shared, "attn_post": [_mix("combine", p, cfg)], "dense": []}


def step_ops(cfg: DeepseekV4Config, p: Precision) -> list[Op]:
    """Beyond the families' step ops: the embedding copied into N streams, and the final collapse (hc_head)."""
    return [
        elementwise("embed_streams", p, cfg.hc_mult * cfg.hidden_size, passes=1),
        hyper("hc_head", p, cfg, cfg.hc_mult),
    ]
