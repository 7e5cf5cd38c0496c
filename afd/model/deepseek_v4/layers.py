"""DeepSeek-V4's building blocks on the attention side, each the float math of its transformers counterpart
(models/deepseek_v4/modeling_deepseek_v4.py): norms, interleaved partial rope, mHC, the clipped shared MLP.

Shapes: T tokens, N = hc_mult streams, D hidden."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from afd.model import layers
from afd.model.deepseek_v4.config import DeepseekV4Config
from afd.model.layers import Rotary, YarnRotary


class RMSNorm(layers.RMSNorm):
    """HF's DeepseekV4RMSNorm: the weight (kept fp32) multiplies the fp32 normed input, one cast at the end."""

    weight_in_fp32 = True


def unweighted_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's DeepseekV4UnweightedRMSNorm."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def rotaries(cfg: DeepseekV4Config) -> tuple[Rotary, Rotary]:
    """(main, compress): the sliding layers' plain rope, and the compressed layers' (YaRN where configured;
    HF forces its attention_factor to 1 unless given)."""
    main = Rotary(cfg.rope_dim, cfg.rope_theta)
    if cfg.rope_type == "default":
        return main, Rotary(cfg.rope_dim, cfg.compress_rope_theta)
    assert cfg.rope_factor is not None and cfg.rope_original_max_position_embeddings is not None
    comp = YarnRotary(
        cfg.rope_dim,
        cfg.compress_rope_theta,
        cfg.rope_factor,
        cfg.rope_original_max_position_embeddings,
        cfg.rope_beta_fast or 32,
        cfg.rope_beta_slow or 1,
        cfg.rope_attention_factor if cfg.rope_attention_factor is not None else 1.0,
        True,
    )
    return main, comp


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's V4 apply_rotary_pos_emb: x [T, ..., d] with its last 2 * cos.shape[-1] dims rotated as interleaved
    pairs (x0, x1), (x2, x3), ... in place of layout, in fp32; cos / sin [T, d_rope / 2]."""
    R = 2 * cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (R,)
    c = cos.repeat_interleave(2, dim=-1).view(shape)
    s = sin.repeat_interleave(2, dim=-1).view(shape)
    nope, r = x[..., :-R], x[..., -R:]
    half = torch.stack((-r[..., 1::2], r[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat([nope, ((r.float() * c) + (half.float() * s)).to(x.dtype)], dim=-1)


class HyperConnection(nn.Module):
    """mHC around one block (HF's DeepseekV4HyperConnection): from the N streams [T, N, D], the collapse
    weights `pre`, the expand weights `post` [T, N] and the Sinkhorn-projected mixing `comb` [T, N, N]."""

    def __init__(self, cfg: DeepseekV4Config):
        super().__init__()
        N = cfg.hc_mult
        self.n, self.iters, self.eps, self.norm_eps = N, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps
        self.fn = nn.Parameter(torch.empty((2 + N) * N, N * cfg.hidden_size))
        self.base = nn.Parameter(torch.empty((2 + N) * N))
        self.scale = nn.Parameter(torch.empty(3))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, N, D] -> (post [T, N], comb [T, N, N], collapsed [T, D]); post and comb fp32."""
        N = self.n
        flat = unweighted_norm(streams.flatten(1).float(), self.norm_eps)
        mixes = F.linear(flat, self.fn.float())  # [T, (2 + N) * N]
        pre_w, post_w, comb_w = mixes.split([N, N, N * N], dim=-1)
        pre_b, post_b, comb_b = self.base.split([N, N, N * N])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.view(-1, N, N) * comb_s + comb_b.view(N, N), dim=-1) + self.eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.iters - 1):  # Sinkhorn-Knopp: rows, then columns, towards doubly stochastic
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed


def expand(post: torch.Tensor, out: torch.Tensor, comb: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """The block's output out [T, D] back into N streams, plus the mixed input streams (HF's decoder layer:
    post * out + comb^T @ streams) -> [T, N, D]."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


class HyperHead(nn.Module):
    """The final collapse of the streams before the norm and head (HF's DeepseekV4HyperHead)."""

    def __init__(self, cfg: DeepseekV4Config):
        super().__init__()
        N = cfg.hc_mult
        self.eps, self.norm_eps = cfg.hc_eps, cfg.rms_norm_eps
        self.hc_fn = nn.Parameter(torch.empty(N, N * cfg.hidden_size))
        self.hc_base = nn.Parameter(torch.empty(N))
        self.hc_scale = nn.Parameter(torch.empty(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = unweighted_norm(x.flatten(1).float(), self.norm_eps)
        mixes = F.linear(flat, self.hc_fn.float())  # [T, N]
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.eps
        return (pre.unsqueeze(-1) * x).sum(dim=1).to(x.dtype)


class ClippedMLP(nn.Module):
    """The shared expert (HF's DeepseekV4MLP), under the checkpoint's names: w1 gate, w3 up, w2 down; gate
    clipped above and up on both sides at swiglu_limit."""

    def __init__(self, cfg: DeepseekV4Config):
        super().__init__()
        D, inter = cfg.hidden_size, cfg.moe_intermediate_size
        self.w1 = nn.Linear(D, inter, bias=False)
        self.w3 = nn.Linear(D, inter, bias=False)
        self.w2 = nn.Linear(inter, D, bias=False)
        self.limit = cfg.swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.w1(x).clamp(max=self.limit)
        up = self.w3(x).clamp(min=-self.limit, max=self.limit)
        return self.w2(F.silu(gate) * up)
