"""Multi-head Latent Attention over a paged cache of compressed latents.

The cache keeps, per token, c = kv_a_layernorm(c_kv) * s_kv (kv_lora_rank values) and the rotated shared
key k_rot (qk_rope_head_dim values), in two planes of the layer's tensor (afd/model/latent_cache.py says
why). Decode uses the absorbed form, attending in latent space:

    q_lat[h] = q_nope[h] @ W_UK[h]            score = [q_lat, q_rot] . [c, k_rot] * scale
    o[h]     = (softmax(score) @ c) @ W_UV[h]^T

Decode reads the cache in place, a chunk of blocks at a time (afd/model/paged_attention.py says why), unless
the node's backend has a fused kernel for it (`Backend.paged_mla_decode`: FIA on Ascend, within its documented
limits); the chunked path is the CPU's and every fallback. A decode-only step may also hand its projections,
rope, absorption and cache write to the backend's fused prolog (`Backend.mla_prolog`: npu_mla_prolog_v3 on
Ascend, for layers within its documented shapes), which writes the cache in the order MLA's own path does.
Prefill expands the latents to per-head keys and values (cheaper when many queries share them).

Families differ in small ways, chosen by the constructor's options: LongCat-Flash scales the LoRA
latents by sqrt(hidden / rank) (`lora_scales`); DeepSeek-V3 may project q without a LoRA
(`q_lora_rank: null`), stretches the softmax scale under YaRN (`softmax_scale`) and may lay rope dims
out in halves rather than interleaved pairs (`rope_interleave`).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from afd.backend.base import Backend, to_device
from afd.backend.mla_prolog import MLAProlog, MLAPrologWeights
from afd.model import kvp, latent_cache, paged_attention
from afd.model.attention_metadata import AttentionMetadata
from afd.model.config import ModelConfig
from afd.model.layers import RMSNorm, apply_rotary, apply_rotary_halves, read_directly
from afd.model.tp.comm import SINGLE

# HF's q_a_layernorm / kv_a_layernorm are built without the config's eps.
_LATENT_NORM_EPS = 1e-6


class MLAConfig(ModelConfig, Protocol):
    """What MLA reads of a family's config (LongCat-Flash's and DeepSeek-V3's have it)."""

    @property
    def qk_nope_head_dim(self) -> int: ...
    @property
    def qk_rope_head_dim(self) -> int: ...
    @property
    def qk_head_dim(self) -> int: ...
    @property
    def v_head_dim(self) -> int: ...
    @property
    def q_lora_rank(self) -> int | None: ...
    @property
    def kv_lora_rank(self) -> int: ...
    @property
    def attention_bias(self) -> bool: ...


class MLAttention(nn.Module):
    def __init__(
        self,
        cfg: MLAConfig,
        lora_scales: bool = True,
        softmax_scale: float | None = None,
        rope_interleave: bool = True,
    ):
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora = cfg.kv_lora_rank
        bias = cfg.attention_bias
        q_lora = cfg.q_lora_rank
        self.q_proj: nn.Linear | None
        if q_lora is None:  # a plain projection, as HF builds it (without attention_bias)
            self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * cfg.qk_head_dim, bias=False)
        else:
            self.q_proj = None
            self.q_a_proj = nn.Linear(cfg.hidden_size, q_lora, bias=bias)
            self.q_a_layernorm = RMSNorm(q_lora, _LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(q_lora, self.n_heads * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, cfg.kv_lora_rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, _LATENT_NORM_EPS)
        self.kv_b_proj = read_directly(nn.Linear(cfg.kv_lora_rank, self.n_heads * (self.nope + self.v_dim), bias=False))
        self.o_proj = nn.Linear(self.n_heads * self.v_dim, cfg.hidden_size, bias=bias)
        self.scale = cfg.qk_head_dim**-0.5 if softmax_scale is None else softmax_scale
        # x * 1.0 is exact: without lora_scales the products below change nothing.
        self.q_lora_scale = (cfg.hidden_size / q_lora) ** 0.5 if lora_scales and q_lora else 1.0
        self.kv_lora_scale = (cfg.hidden_size / cfg.kv_lora_rank) ** 0.5 if lora_scales else 1.0
        self.rotate = apply_rotary if rope_interleave else apply_rotary_halves
        self.tp = SINGLE
        """The TP group (afd.model.tp.shard cuts the heads): x comes in the residual stream's layout, and
        o_proj hands its result back in that layout."""
        self.kvp: tuple[int, int] | None = None
        """(N, k) under KV parallelism: this rank stores KV blocks k, k + N, ... and attends with the heads
        of its head group, merging with its N - 1 peers (afd/model/kvp.py)."""
        self.backend: Backend | None = None
        """The node's backend, whose fused decode attention is tried first (attach_backend sets it)."""
        self.prolog: MLAProlog | None = None
        """The backend's fused decode prolog for this layer, prepared at load (attach_backend), or None."""

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The stream -> (q [T, NH, qk_head_dim], q_a_proj | kv_a_proj_with_mqa latents [T, C + R]) of
        every token. flashcomm1 runs the replicated down-projections on this rank's token shard and
        gathers their (narrower) output instead of the hidden state."""
        tp = self.tp
        if tp.active.latents and self.q_proj is None:
            q_lora = self.q_a_proj.out_features
            lat = tp.gather(torch.cat([self.q_a_proj(x), self.kv_a_proj_with_mqa(x)], dim=-1))
            qa, kva = lat.split([q_lora, lat.shape[-1] - q_lora], dim=-1)
        else:
            x = tp.gather(x)
            kva = self.kv_a_proj_with_mqa(x)
            if self.q_proj is not None:
                return self.q_proj(x).view(x.shape[0], self.n_heads, -1), kva
            qa = self.q_a_proj(x)
        return self.q_b_proj(self.q_a_layernorm(qa)).view(qa.shape[0], self.n_heads, -1), kva

    def _w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.kv_b_proj.weight.view(self.n_heads, self.nope + self.v_dim, self.kv_lora)
        return w[:, : self.nope], w[:, self.nope :]  # [NH, nope, C], [NH, v, C]

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata, cache: torch.Tensor
    ) -> torch.Tensor:
        """x [T, H] (a token shard [s, H] under a sharded TP mode); cache [num_blocks, block_size, C + R]
        for this layer (two planes: afd.model.latent_cache). Returns o_proj's output in x's layout."""
        fused = self._prolog_decode(x, cos, sin, meta, cache)
        if fused is not None:
            return fused
        q, kva = self._project(x)
        T = q.shape[0]
        q_nope, q_rot = q.split([self.nope, self.rope], dim=-1)
        c, k_rot = kva.split([self.kv_lora, self.rope], dim=-1)
        c = self.kv_a_layernorm(c) * self.kv_lora_scale  # [T, C]
        q_nope = q_nope * self.q_lora_scale
        q_rot = self.rotate(q_rot * self.q_lora_scale, cos, sin)  # [T, NH, R]
        k_rot = self.rotate(k_rot, cos, sin)  # [T, R]
        if self.kvp is not None:
            return self.o_proj(self._kvp_attend(q_nope, q_rot, c, k_rot, meta, cache))
        latent_cache.store(cache, meta.slot_mapping, c, k_rot)

        out = q.new_empty(T, self.n_heads, self.v_dim)
        if meta.decode_rows.numel():
            dec = meta.decode_rows
            out[dec] = self._decode_absorbed(q_nope[dec], q_rot[dec], meta, cache)
        for s in meta.prefill_seqs:
            rows = slice(s.q_start, s.q_start + s.q_len)
            out[rows] = self._prefill_expanded(q_nope[rows], q_rot[rows], s.ctx_len, s.block_table, cache)
        return self.o_proj(out.view(T, -1))

    def _decode_absorbed(self, q_nope, q_rot, meta: AttentionMetadata, cache) -> torch.Tensor:
        """One query per sequence. q_nope [B, NH, nope], q_rot [B, NH, R] -> [B, NH, v]."""
        q_lat = torch.einsum("bhn,hnc->bhc", q_nope, self._w_uk_uv()[0])  # [B, NH, C]
        return self._decode_latent(q_lat, q_rot, meta, cache)

    def _decode_latent(self, q_lat, q_rot, meta: AttentionMetadata, cache) -> torch.Tensor:
        """Absorbed queries q_lat [B, NH, C], q_rot [B, NH, R] -> [B, NH, v]."""
        w_uv = self._w_uk_uv()[1]
        o_lat = self._fused_decode(q_lat, q_rot, meta, cache)
        if o_lat is not None:
            return torch.einsum("bhc,hvc->bhv", o_lat, w_uv)
        q_full = torch.cat([q_lat, q_rot], dim=-1)  # [B, NH, C + R]
        o_lat, _ = self._attend_latent(q_full, meta.decode_block_tables, meta.decode_ctx_lens, meta.block_size, cache)
        return torch.einsum("bhc,hvc->bhv", o_lat, w_uv)

    def _prolog_decode(self, x, cos, sin, meta: AttentionMetadata, cache) -> torch.Tensor | None:
        """A decode-only step with the backend's fused prolog (projections, norms, rope, absorption and the cache
        write in one op), then attention as `_decode_latent`; None where the prolog does not run: a prefill row
        (it needs q unabsorbed), KVP (each rank stores its share of the tokens), flashcomm1's latent gather (it
        shards the down-projections the prolog fuses), a compiled graph (decode there is traced as it stands)."""
        if self.prolog is None or self.kvp is not None or self.tp.active.latents or torch.compiler.is_compiling():
            return None
        if meta.prefill_seqs or not meta.num_tokens:  # else every row is one sequence's decode token
            return None
        c, k_rot = latent_cache.planes(cache, self.kv_lora)
        if not self.prolog.takes(c, k_rot):
            return None
        q_lat, q_rot = self.prolog(self.tp.gather(x), cos, sin, c, k_rot, meta.slot_mapping)
        return self.o_proj(self._decode_latent(q_lat, q_rot, meta, cache).flatten(1))

    def prolog_weights(self) -> MLAPrologWeights:
        """This layer's projections before attention, as a backend's fused prolog takes them (attach_backend)."""
        lora = self.q_proj is None
        return MLAPrologWeights(
            q_a=self.q_a_proj.weight.detach() if lora else None,
            q_b=self.q_b_proj.weight.detach() if lora else None,
            q_norm=self.q_a_layernorm.weight.detach() if lora else None,
            kv_a=self.kv_a_proj_with_mqa.weight.detach(),
            kv_norm=self.kv_a_layernorm.weight.detach(),
            w_uk=self._w_uk_uv()[0].detach(),
            eps=_LATENT_NORM_EPS,
            q_scale=self.q_lora_scale,
            kv_scale=self.kv_lora_scale,
            rope_interleave=self.rotate is apply_rotary,
            bias=self.kv_a_proj_with_mqa.bias is not None,
        )

    def _fused_decode(self, q_lat, q_rot, meta: AttentionMetadata, cache) -> torch.Tensor | None:
        """The backend's fused kernel over the latent and rope planes of the cache, or None where it has none
        for these inputs. Its context lengths are host ints, which the metadata already holds (no device read);
        inside a compiled graph they would be constants, so None."""
        if self.backend is None or torch.compiler.is_compiling():  # not traced: a graph would freeze the lengths
            return None
        lens = [s.ctx_len for s in meta.seqs if s.q_len == 1]  # the decode rows, in AttentionMetadata's order
        if len(lens) != q_lat.shape[0]:
            return None
        c, k_rot = latent_cache.planes(cache, self.kv_lora)
        return self.backend.paged_mla_decode(q_lat, q_rot, c, k_rot, meta.decode_block_tables, lens, self.scale)

    def _attend_latent(self, q_full, tables, ctx_lens, block_size: int, cache, positions=None):
        """Absorbed attention of q_full [B, NH, C + R] over the latents of the blocks in tables [B, nb], read
        from the paged cache a chunk at a time (afd/model/paged_attention.py). -> (o_lat [B, NH, C], lse)."""

        c, k_rot = latent_cache.planes(cache, self.kv_lora)

        def read(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            lat = paged_attention.gather(c, blocks)  # [B, l, C]: the values, and the keys' first C dims
            return torch.cat([lat, paged_attention.gather(k_rot, blocks)], dim=-1), lat  # keys [B, l, C + R]

        eqs = ("bhd,bld->bhl", "bhl,blc->bhc")
        return paged_attention.attend(q_full, tables, ctx_lens, block_size, read, eqs, self.scale, positions)

    def _prefill_expanded(self, q_nope, q_rot, ctx_len: int, table: list[int], cache) -> torch.Tensor:
        """n queries at positions [ctx_len - n, ctx_len). q_nope [n, NH, nope] -> [n, NH, v]."""
        n = q_nope.shape[0]
        bs = cache.shape[1]
        blocks = to_device(torch.tensor(table[: (ctx_len + bs - 1) // bs], dtype=torch.long), cache.device)
        c, k_rot = latent_cache.read(cache, self.kv_lora, blocks)
        c, k_rot = c[:ctx_len], k_rot[:ctx_len]  # [L, C], [L, R]
        kvb = self.kv_b_proj(c).view(ctx_len, self.n_heads, -1)
        k_nope, v = kvb.split([self.nope, self.v_dim], dim=-1)  # [L, NH, nope], [L, NH, v]
        q = torch.cat([q_nope, q_rot], dim=-1).transpose(0, 1)  # [NH, n, D]
        k = torch.cat([k_nope, k_rot[:, None, :].expand(-1, self.n_heads, -1)], dim=-1).transpose(0, 1)
        score = q @ k.transpose(1, 2) * self.scale  # [NH, n, L]
        q_pos = torch.arange(ctx_len - n, ctx_len, device=c.device)
        k_pos = torch.arange(ctx_len, device=c.device)
        score.masked_fill_(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        p = torch.softmax(score, dim=-1, dtype=torch.float32).to(q.dtype)
        return (p @ v.transpose(0, 1)).transpose(0, 1)  # [n, NH, v]

    def _kvp_attend(self, q_nope, q_rot, c_new, k_rot_new, meta: AttentionMetadata, cache) -> torch.Tensor:
        """KV-parallel attention: store this rank's share of the new latents, attend over this rank's blocks
        with the head group's heads, merge with the other KV ranks. Returns [T, n_own_heads * v]."""
        assert self.kvp is not None  # forward calls this only under KVP
        N, k = self.kvp
        view = kvp.local_view(meta, N, k)
        latent_cache.store(cache, view.write_slots, c_new[view.write_rows], k_rot_new[view.write_rows])
        T, bs = q_nope.shape[0], meta.block_size
        o = q_nope.new_zeros(T, self.n_heads, self.v_dim)
        lse = torch.full((T, self.n_heads), float("-inf"), device=o.device)
        w_uk, w_uv = self._w_uk_uv()
        if meta.decode_rows.numel():
            dec = meta.decode_rows
            q_full = torch.cat([torch.einsum("bhn,hnc->bhc", q_nope[dec], w_uk), q_rot[dec]], dim=-1)
            o_lat, lse[dec] = self._attend_latent(
                q_full, view.decode_tables, meta.decode_ctx_lens, bs, cache, view.decode_pos
            )  # a rank holding none of a row's keys: o_lat = 0, lse = -inf
            o[dec] = torch.einsum("bhc,hvc->bhv", o_lat, w_uv)
        for s, (blocks, pos) in zip(meta.prefill_seqs, view.prefill):
            rows = slice(s.q_start, s.q_start + s.q_len)
            c, k_rot = latent_cache.read(cache, self.kv_lora, blocks)  # [L/N, C], [L/N, R]: this rank's keys
            kvb = self.kv_b_proj(c).view(c.shape[0], self.n_heads, self.nope + self.v_dim)  # L/N may be 0
            k_nope, v = kvb.split([self.nope, self.v_dim], dim=-1)
            q = torch.cat([q_nope[rows], q_rot[rows]], dim=-1).transpose(0, 1)  # [h, n, D]
            key = torch.cat([k_nope, k_rot[:, None, :].expand(-1, self.n_heads, -1)], dim=-1).transpose(0, 1)
            score = q @ key.transpose(1, 2) * self.scale  # [h, n, L/N]
            q_pos = torch.arange(s.ctx_len - s.q_len, s.ctx_len, device=c.device)
            score.masked_fill_(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
            o_s, l_s = kvp.partial(score, v.transpose(0, 1))
            o[rows], lse[rows] = o_s.transpose(0, 1), l_s.transpose(0, 1)
        return self.tp.kvp_merge(o, lse).reshape(T, -1)


def attach_backend(model: object, backend: Backend) -> None:
    """Let every MLA of `model` try `backend`'s fused decode attention first, and its fused prolog where it has
    one for the layer, prepared now (afd.engine.factory calls it with the halves it holds, loaded and cut for
    TP, typed by the engine's Protocols: anything but an nn.Module holds no MLA)."""
    if not isinstance(model, nn.Module):
        return
    for mod in model.modules():
        if isinstance(mod, MLAttention):
            mod.backend = backend
            with torch.no_grad():
                mod.prolog = backend.mla_prolog(mod.prolog_weights())
