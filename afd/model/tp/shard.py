"""Cuts a loaded attention half down to one TP rank's share.

    MLA          q_b_proj / q_proj and kv_b_proj column-parallel (this rank's n = NH/G heads), o_proj
                 row-parallel over the same heads (flashcomm2: the ODP group's columns); q_a_proj and
                 kv_a_proj_with_mqa replicated, and so is the latent KV cache they fill
    dense MLPs   gate_proj / up_proj column-parallel, down_proj row-parallel
    vocabulary   embed_tokens and lm_head by rows of the vocabulary padded to a multiple of G

The half is loaded whole and then cut (simple, and memory-hungry on the host for a large model: reading
only the slices from safetensors is a known next step, docs/architecture.md).
"""

from __future__ import annotations

import torch
from torch import nn

from afd.config.tp import TPConfigError
from afd.model.halves import AttentionHalf
from afd.model.layers import DenseMLP
from afd.model.mla import MLAttention
from afd.model.tp.comm import TPComm
from afd.model.tp.layers import FC2OProj, ParallelLMHead, RowParallelLinear, VocabParallelEmbedding

# (1) A TP layer takes nn.Linear's place: the same call on a slice of its weight (the attribute keeps
# nn.Linear's type for the unsharded model).


def _rows(lin: nn.Linear, w: torch.Tensor) -> None:
    lin.weight = nn.Parameter(w.contiguous(), requires_grad=False)
    lin.out_features = w.shape[0]


def _heads(w: torch.Tensor, n_heads: int, lo: int, n: int) -> torch.Tensor:
    """Rows of heads [lo, lo + n) of a per-head-major weight [NH * d, K]."""
    return w.view(n_heads, -1, w.shape[-1])[lo : lo + n].reshape(-1, w.shape[-1])


def shard_mla(attn: MLAttention, tp: TPComm) -> None:
    """Under KVP (N ranks) the rank attends with its head group's N*n heads (rank // N) over its KV share,
    and o_proj then takes its own n heads, as without KVP."""
    G, r, NH, N = tp.size, tp.rank, attn.n_heads, tp.cfg.kvp
    n = NH // G
    lo, hg = (r // N) * n * N, n * N  # this rank's heads while attending
    if attn.q_proj is not None:
        _rows(attn.q_proj, _heads(attn.q_proj.weight, NH, lo, hg))
    else:
        _rows(attn.q_b_proj, _heads(attn.q_b_proj.weight, NH, lo, hg))
    _rows(attn.kv_b_proj, _heads(attn.kv_b_proj.weight, NH, lo, hg))
    w, b = attn.o_proj.weight, attn.o_proj.bias  # [H, NH * v]
    cols = n * attn.v_dim
    if tp.cfg.mode == "flashcomm2":
        D = G // tp.cfg.fc2_otp
        g, j = divmod(r, D)
        block = w[:, g * D * cols : (g + 1) * D * cols]
        attn.o_proj = FC2OProj(block, slice(j * cols, (j + 1) * cols), b, tp)  # type: ignore[assignment]  # (1)
    else:
        attn.o_proj = RowParallelLinear(w[:, r * cols : (r + 1) * cols], b, tp)  # type: ignore[assignment]  # (1)
    attn.n_heads, attn.tp = hg, tp
    if N > 1:
        attn.kvp = (N, r % N)


def shard_mlp(mlp: DenseMLP, tp: TPComm, where: str) -> None:
    inter = mlp.gate_proj.weight.shape[0]
    if inter % tp.size:
        raise TPConfigError(f"layout.attention_tp: {tp.size} ranks do not divide {where}'s intermediate size {inter}")
    k = inter // tp.size
    rows = slice(tp.rank * k, (tp.rank + 1) * k)
    _rows(mlp.gate_proj, mlp.gate_proj.weight[rows])
    _rows(mlp.up_proj, mlp.up_proj.weight[rows])
    mlp.down_proj = RowParallelLinear(mlp.down_proj.weight[:, rows], None, tp)  # type: ignore[assignment]  # (1)
    mlp.tp = tp


def _vocab_rows(w: torch.Tensor, tp: TPComm) -> tuple[torch.Tensor, int]:
    """This rank's rows of a [V, H] table padded with zero rows to a multiple of G, and the first id."""
    V = w.shape[0]
    per = -(-V // tp.size)
    lo = tp.rank * per
    part = w.new_zeros(per, w.shape[1])
    have = max(0, min(V, lo + per) - lo)
    part[:have] = w[lo : lo + have]
    return part, lo


def shard_attention_half(model: AttentionHalf, tp: TPComm) -> AttentionHalf:
    """In place; returns the model. Raises TPConfigError when the model cannot be cut G ways."""
    if tp.size == 1:
        return model  # (KVP needs ranks: TPConfig refuses kvp > attention_tp)
    cfg = model.cfg
    if not model.supports_tp:
        raise TPConfigError(
            f"layout.attention_tp: {cfg.model_type}'s attention half has no TP layers yet "
            "(MLA families do: longcat_flash, deepseek_v3)"
        )
    tp.cfg.check_model(cfg.num_attention_heads)
    if model.lm_head.weight.device.type == "cpu":  # the cut slices plain weights
        from afd.backend.cpu_packed import unpack

        unpack(model)
    for name, mod in model.named_modules():
        if isinstance(mod, MLAttention):
            shard_mla(mod, tp)
        elif isinstance(mod, DenseMLP):
            shard_mlp(mod, tp, name)
    emb, lo = _vocab_rows(model.get_parameter("embed_tokens.weight"), tp)
    model.embed_tokens = VocabParallelEmbedding(emb, lo, tp)
    head, _ = _vocab_rows(model.get_parameter("lm_head.weight"), tp)
    model.lm_head = ParallelLMHead(head, cfg.vocab_size, tp)
    model.tp = tp
    if model.lm_head.weight.device.type == "cpu":  # the cut weights are row-major and plain again
        from afd.model.checkpoint import cpu_layouts

        cpu_layouts(model)
    return model
