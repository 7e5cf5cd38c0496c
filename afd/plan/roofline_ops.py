"""One decode layer's kernels as a roofline sees them: FLOPs and bytes per token, per family and attention kind.

Each kernel is an `Op`: FLOPs and bytes as x grows (x: tokens on the attention side, token-expert rows on
the FFN side). A linear's weight is read once per call (per micro-batch); its input and output rows cross
memory once each; the KV cache is read once per decoding sequence (one token of the micro-batch is one
sequence). Norms, rotary, residual adds and activations are memory-bound elementwise kernels. Counts follow
afd's own kernels: MLA decodes in the absorbed form (afd/model/mla.py), the FFN side routes (broadcast) and
runs every expert it holds that a row picked (afd/model/experts.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from afd.model.config import ModelConfig
from afd.model.deepseek_v3.config import DeepseekV3Config
from afd.model.longcat_flash.config import LongcatFlashConfig


@dataclass(frozen=True)
class Precision:
    """Bytes and compute peaks of a model at some dtype and quantization."""

    act: int
    """Bytes of an activation and of a KV cache element (the model dtype)."""
    weight: int
    """Bytes of a quantized linear's weight (= act unquantized); embeddings, routers, lm_head stay at `act`,
    as afd.quant.scheme keeps them. Block scales (4 bytes per 128 x 128) are left out: under 0.1 %."""
    model_key: str
    """The spec's compute key of the model dtype (bf16, fp16): attention cores, unquantized GEMMs."""
    gemm_key: str
    """The compute key quantized GEMMs run at (fp8, int8, or the model's under w8a16)."""


@dataclass(frozen=True)
class Op:
    """One kernel: time(x) = max(flops(x) / compute, nbytes(x) / bandwidth) + one launch."""

    name: str
    compute: str
    flops_per_x: float = 0.0
    weight_bytes: float = 0.0
    """Weights it holds; read whole per call, or only the touched experts' share when `experts` > 0."""
    bytes_per_x: float = 0.0
    """Activations in and out, KV cache reads: per token (or row)."""
    experts: int = 0
    """The experts `weight_bytes` is spread over (0: a dense weight)."""
    link_bytes_per_x: float = 0.0
    """Bytes one rank sends over the intra-node fabric per token: a TP collective (then flops and bytes 0)."""
    link_hops: int = 0
    """Latencies the collective pays in sequence (a ring all-reduce over G ranks: 2 (G - 1))."""
    share: float = 1.0
    """The fraction of the model's MoE layers that run it, where their attention differs by layer
    (DeepSeek-V4's layer_types): a piece is then the mean layer, its weights and launches included."""

    def flops(self, x: float) -> float:
        return self.flops_per_x * x

    def nbytes(self, x: float) -> float:
        w = self.weight_bytes * (experts_touched(x, self.experts) / self.experts if self.experts else 1.0)
        return w + self.bytes_per_x * x


def experts_touched(rows: float, experts: int) -> float:
    """Expected distinct experts among `experts` that `rows` rows pick, each row one expert uniformly:
    E_local * (1 - (1 - 1/E_local) ** rows). With rows counted on the node, this is the issue's
    E_local * (1 - (1 - 1/E) ** rows_total) for rows_total = rows * E / E_local (both ~ E_local * (1 - exp(-rows /
    E_local))). A skewed router touches fewer (and loads the nodes unevenly: the simulator's part)."""
    if experts <= 0 or rows <= 0:
        return 0.0
    return experts * (1.0 - (1.0 - 1.0 / experts) ** rows)


def gemm(name: str, p: Precision, k: float, n: float, quantized: bool = True) -> Op:
    """x rows [x, k] through a [n, k] weight (this rank's part of it under TP): 2·k·n FLOPs a row."""
    wb, key = (p.weight, p.gemm_key) if quantized else (p.act, p.model_key)
    return Op(name, key, 2.0 * k * n, k * n * wb, (k + n) * p.act)


def elementwise(name: str, p: Precision, width: float, passes: int = 2) -> Op:
    """A memory-bound kernel over x rows of `width` values: `passes` reads and writes of each."""
    return Op(name, p.model_key, 0.0, 0.0, width * passes * p.act)


def all_reduce(name: str, p: Precision, width: float, tp: int) -> list[Op]:
    """TP's all-reduce of [x, width] after a row-parallel GEMM (tp_comm allreduce, afd's default): a ring
    sends 2 (G - 1) / G of it per rank, afd.model.tp.volume's 2 * share(T*H*b, G). None without TP."""
    if tp <= 1:
        return []
    return [Op(name, p.model_key, link_bytes_per_x=2 * (tp - 1) / tp * width * p.act, link_hops=2 * (tp - 1))]


def all_gather(name: str, p: Precision, width: float, tp: int) -> list[Op]:
    """TP's all-gather of [x, width] rows: (G - 1) / G of it per rank (share(Tp*X*b, G))."""
    if tp <= 1:
        return []
    return [Op(name, p.model_key, link_bytes_per_x=(tp - 1) / tp * width * p.act, link_hops=tp - 1)]


def mla(cfg, p: Precision, context: int, tp: int) -> list[Op]:
    """Multi-head latent attention, decode, absorbed (DeepSeek-V3, LongCat-Flash): heads split over `tp`
    ranks, the latent down-projections replicated. Per token: q_lat = q_nope @ W_UK (NH/tp x nope x C),
    scores over context positions of C + R, values over C, then W_UV and o_proj. The cache holds C + R
    values per position, read whole by every rank (each attends its heads over the same latents)."""
    H, nh = cfg.hidden_size, cfg.num_attention_heads / tp
    nope, rope, v, C, rq = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank, cfg.q_lora_rank
    ops = [elementwise("attn_norm", p, H)]
    if rq:
        ops += [gemm("q_a", p, H, rq), elementwise("q_norm", p, rq), gemm("q_b", p, rq, nh * (nope + rope))]
    else:
        ops.append(gemm("q_proj", p, H, nh * (nope + rope)))
    ops += [gemm("kv_a", p, H, C + rope), elementwise("kv_norm_rope", p, C + rope + nh * rope)]
    ops.append(Op("absorb_uk", p.model_key, 2 * nh * nope * C, nh * nope * C * p.act, nh * (nope + C) * p.act))
    ops.append(Op("attend", p.model_key, 2 * nh * context * (2 * C + rope), 0.0, context * (C + rope) * p.act))
    ops.append(Op("absorb_uv", p.model_key, 2 * nh * C * v, nh * C * v * p.act, nh * (C + v) * p.act))
    ops.append(gemm("o_proj", p, nh * v, H))
    return ops + all_reduce("o_proj_all_reduce", p, H, tp)


def gqa(cfg, p: Precision, context: int, tp: int) -> list[Op]:
    """Grouped-query attention, decode (Qwen3-MoE): q, k, v in one GEMM, q/k norms and rotary, then scores
    and values over context positions of NKV heads of D each (K and V). afd's GQA half has no TP."""
    if tp > 1:
        raise ValueError("attention TP: afd cuts MLA families only (Qwen3-MoE's GQA half has no TP)")
    H, D = cfg.hidden_size, cfg.head_dim
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    return [
        elementwise("attn_norm", p, H),
        gemm("qkv", p, H, (nh + 2 * nkv) * D),
        elementwise("qk_norm_rope", p, (nh + nkv) * D),
        Op("attend", p.model_key, 4 * nh * context * D, 0.0, context * 2 * nkv * D * p.act),
        gemm("o_proj", p, nh * D, H),
    ]


def mlp(name: str, p: Precision, H: int, inter: int, tp: int = 1) -> list[Op]:
    """A dense SwiGLU MLP (gate and up fused), intermediate split over `tp` ranks."""
    i = inter / tp
    return [
        elementwise(f"{name}_norm", p, H),
        gemm(f"{name}_gate_up", p, H, 2 * i),
        elementwise(f"{name}_act", p, 1.5 * i),
        gemm(f"{name}_down", p, i, H),
        *all_reduce(f"{name}_all_reduce", p, H, tp),
    ]


ATTENTION = {"deepseek_v3": mla, "longcat_flash": mla, "qwen3_moe": gqa}
"""The attention kind of each family afd serves (afd/model/registry.py)."""


def attention_pieces(cfg: ModelConfig, p: Precision, context: int, tp: int) -> dict[str, list[Op]]:
    """The attention side of one MoE layer cut as LayerCosts is (pre, window, post), and a dense layer."""
    kind = ATTENTION.get(cfg.model_type)
    if kind is None:
        raise ValueError(f"no roofline for model_type {cfg.model_type!r}; it knows {', '.join(ATTENTION)}")
    H = cfg.hidden_size
    attn = kind(cfg, p, context, tp)
    # allreduce mode: each rank sent its slice of the MoE rows; the ranks gather the results
    post = all_gather("moe_all_gather", p, H, tp) + [elementwise("residual_add", p, H, passes=3)]
    if isinstance(cfg, LongcatFlashConfig):
        # pre: attn0, ln_post0 (the MoE input); window: mlp0, attn1, mlp1 (afd/model/longcat_flash/attention.py)
        win = (
            mlp("mlp0", p, H, cfg.ffn_hidden_size, tp)[1:]
            + kind(cfg, p, context, tp)
            + mlp("mlp1", p, H, cfg.ffn_hidden_size, tp)
        )
        return {"attn_pre": attn + [elementwise("moe_norm", p, H)], "attn_window": win, "attn_post": post, "dense": []}
    if isinstance(cfg, DeepseekV3Config):
        shared = mlp("shared", p, H, cfg.n_shared_experts * cfg.moe_intermediate_size, tp)[1:]
        dense = attn + mlp("mlp", p, H, cfg.intermediate_size, tp)
        return {
            "attn_pre": attn + [elementwise("moe_norm", p, H)],
            "attn_window": shared,
            "attn_post": post,
            "dense": dense,
        }
    q: Any = cfg  # Qwen3MoeConfig
    dense = attn + mlp("mlp", p, H, q.intermediate_size, tp)
    return {"attn_pre": attn + [elementwise("moe_norm", p, H)], "attn_window": [], "attn_post": post, "dense": dense}


def router(cfg: ModelConfig, p: Precision, tokens_per_x: float = 1.0) -> Op:
    """Scores of every router output for each token (in the model dtype, as afd.quant.scheme keeps it)."""
    H = cfg.hidden_size
    # LongCat-Flash scores its identity experts too
    E = cfg.num_experts_total if isinstance(cfg, LongcatFlashConfig) else cfg.n_routed_experts
    t = tokens_per_x
    return Op("router", p.model_key, 2.0 * H * E * t, H * E * p.act, (H + E) * p.act * t)


def ffn_ops(cfg: ModelConfig, p: Precision, e_local: int, tokens_per_row: float | None) -> list[Op]:
    """One FFN node's MoE layer for x token-expert rows over its `e_local` experts: under routing ffn
    (`tokens_per_row` given) the router, as every node scores every token it is sent; the experts' gate/up
    and down GEMMs (weights of the experts touched only), SwiGLU, and the weighted combine."""
    H = cfg.hidden_size
    inter = cfg.expert_intermediate_size
    ops = [] if tokens_per_row is None else [router(cfg, p, tokens_per_row)]
    return ops + [
        Op(
            "experts_gate_up",
            p.gemm_key,
            2.0 * H * 2 * inter,
            e_local * H * 2 * inter * p.weight,
            (H + 2 * inter) * p.act,
            experts=e_local,
        ),
        elementwise("experts_act", p, 1.5 * inter),
        Op(
            "experts_down",
            p.gemm_key,
            2.0 * inter * H,
            e_local * inter * H * p.weight,
            (inter + H) * p.act,
            experts=e_local,
        ),
        elementwise("combine", p, H, passes=2),
    ]


def step_ops(cfg: ModelConfig, p: Precision, tp: int) -> list[Op]:
    """Per decode step outside the layers, x = sequences: embedding rows (the vocabulary-parallel
    embedding's reduce under TP), final norm, lm_head (kept in the model dtype, vocabulary split over tp,
    the slices gathered), and the sampler's pass over fp32 logits."""
    H, V = cfg.hidden_size, cfg.vocab_size
    return [
        elementwise("embed", p, H, passes=2),
        *all_reduce("embed_all_reduce", p, H, tp),
        elementwise("final_norm", p, H),
        gemm("lm_head", p, H, V / tp, quantized=False),
        *all_gather("logits_all_gather", p, V, tp),
        Op("sample", p.model_key, 0.0, 0.0, V * 4 * 3),
    ]
