"""One DeepSeek-V4 attention block (HF's DeepseekV4Attention) over its paged state kinds
(afd.model.deepseek_v4.state: the window's per-token planes, the compressed entries): shared-KV MQA (one K=V
head of head_dim), partial interleaved rope, per-head sinks, a sliding window in every layer, compressed entries
on CSA / HCA layers (CSA: the indexer's top-k), and the grouped low-rank output projection. The checkpoint's
names (`attn.wq_a`, `attn.wkv`, ...).

Shapes: T tokens of the micro-batch, n of one sequence, Hq heads of D dims, C compressed entries."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from afd.backend.base import to_device
from afd.model.attention_metadata import AttentionMetadata
from afd.model.deepseek_v4.compressor import Compressor, Indexer
from afd.model.deepseek_v4.config import CSA, SWA, DeepseekV4Config
from afd.model.deepseek_v4.layers import RMSNorm, rope, unweighted_norm
from afd.model.deepseek_v4.state import entry_kind, layer_planes
from afd.model.layers import read_directly
from afd.model.state_spec import PagedLayer, kind_table


class Attention(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, i: int):
        super().__init__()
        D, H = cfg.head_dim, cfg.hidden_size
        self.cfg, self.heads, self.dim = cfg, cfg.num_attention_heads, D
        self.window, self.groups = cfg.sliding_window, cfg.o_groups
        self.planes, self.entry_kind = layer_planes(cfg, i), entry_kind(cfg, i)
        self.rope_kind = "main" if cfg.layer_types[i] == SWA else "compress"
        self.wq_a = nn.Linear(H, cfg.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.heads * D, bias=False)
        self.wkv = nn.Linear(H, D, bias=False)
        self.norm = RMSNorm(D, cfg.rms_norm_eps)
        self.wo_a = read_directly(nn.Linear(self.heads * D // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, bias=False))
        self.wo_b = nn.Linear(cfg.o_groups * cfg.o_lora_rank, H, bias=False)
        self.attn_sink = nn.Parameter(torch.empty(self.heads))
        rate = cfg.compress_rate(i)
        self.rate = rate
        if rate:
            series = 2 if cfg.layer_types[i] == CSA else 1
            self.compressor = Compressor(H, D, rate, series, cfg.rms_norm_eps)
        if cfg.layer_types[i] == CSA:
            self.indexer = Indexer(
                H, cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim, rate, cfg.index_topk, cfg.rms_norm_eps
            )

    def forward(
        self, x: torch.Tensor, rope_: tuple, meta: AttentionMetadata, kv: PagedLayer | torch.Tensor, comp
    ) -> torch.Tensor:
        """x [T, H] (normed block input) -> [T, H]. rope_: (main cos, sin, compress cos, sin) at the step's
        positions; comp: the compressed layers' Rotary (entries and indexer queries at other positions).
        Writes this step's planes into kv, the layer's state (afd.model.deepseek_v4.state), or, for a sliding-
        window-only layer with a cache of its own (an MTP block's), its token plane [pages, >= block_size * Wt]."""
        T, Hq, D, P, bs = x.shape[0], self.heads, self.dim, self.planes, meta.block_size
        cos, sin = rope_[:2] if self.rope_kind == "main" else rope_[2:]
        q_res = self.q_norm(self.wq_a(x))  # [T, q_lora]
        q = unweighted_norm(self.wq_b(q_res).view(T, Hq, D), self.cfg.rms_norm_eps)
        q = rope(q, cos, sin)  # [T, Hq, D]
        k = rope(self.norm(self.wkv(x)), cos, sin)  # [T, D]: K = V
        entries = None
        if isinstance(kv, PagedLayer):
            tokens = kv.view("window")  # [pages, bs, Wt]
            entries = kv.view(self.entry_kind) if self.rate else None  # [pages, slots, We]
        else:  # one plain plane (the MTP block's window-only layer)
            tokens = kv[:, : bs * P.token_width].view(kv.shape[0], bs, P.token_width)  # [pages, bs, Wt]
        page, off = meta.slot_mapping // bs, meta.slot_mapping % bs  # each new token's
        tokens[page, off, P.kv] = k.to(tokens.dtype)
        if self.rate:
            tokens[page, off, P.ckv] = self.compressor.wkv(x).to(tokens.dtype)
            tokens[page, off, P.cgate] = self.compressor.wgate(x).to(tokens.dtype)
        if self.rate and P.index_dim:
            tokens[page, off, P.ikv] = self.indexer.compressor.wkv(x).to(tokens.dtype)
            tokens[page, off, P.igate] = self.indexer.compressor.wgate(x).to(tokens.dtype)
        out = torch.empty(T, Hq, D, dtype=x.dtype, device=x.device)
        for s in meta.seqs:
            rows = slice(s.q_start, s.q_start + s.q_len)
            out[rows] = self._sequence(tokens, entries, s, x[rows], q_res[rows], q[rows], comp, bs)
        out = rope(out, cos, -sin)  # K = V carried rope: undo it on the output's rope dims, at the query position
        g = self.groups
        grouped = out.reshape(T, g, -1).transpose(0, 1)  # [g, T, Hq*D/g]
        w = self.wo_a.weight.reshape(g, -1, grouped.shape[-1]).transpose(1, 2)  # [g, Hq*D/g, o_lora]
        return self.wo_b(torch.bmm(grouped, w).transpose(0, 1).reshape(T, -1))

    def _sequence(self, tokens, entries, s, x, q_res, q, comp, bs: int) -> torch.Tensor:
        """One sequence's new queries q [n, Hq, D] over its window and compressed entries -> [n, Hq, D]."""
        dev, P = q.device, self.planes
        p0, end = s.ctx_len - s.q_len, s.ctx_len  # new positions [p0, end)
        # staged through pinned memory: a plain torch.tensor(..., device=) copy would wait for the device, per
        # sequence and layer
        table = to_device(torch.tensor(s.block_table, dtype=torch.long), dev)  # NULL_BLOCK before the lookback
        positions = torch.arange(p0, end, device=dev)  # [n]
        kpos = torch.arange(max(0, p0 - self.window + 1), end, device=dev)  # the window's keys [Lw]
        keys = tokens[table[kpos // bs], kpos % bs, P.kv].to(q.dtype)
        dist = positions[:, None] - kpos[None, :]  # [n, Lw]
        visible = (dist >= 0) & (dist < self.window)
        if self.rate:
            etable = to_device(torch.tensor(kind_table(s.block_table, self.entry_kind), dtype=torch.long), dev)
            made, seen = self._compressed(tokens, (entries, etable), table, bs, (p0, end), positions, x, q_res, comp)
            keys = torch.cat([keys, made.to(q.dtype)], dim=0)
            visible = torch.cat([visible, seen], dim=1)
        bias = torch.zeros(visible.shape, dtype=q.dtype, device=dev).masked_fill(~visible, float("-inf"))
        scores = torch.einsum("nhd,kd->hnk", q, keys) * self.dim**-0.5 + bias  # [Hq, n, K]
        sinks = self.attn_sink.view(-1, 1, 1).expand(-1, scores.shape[1], 1)  # fp32: bf16 scores widen, as HF's
        logits = torch.cat([scores, sinks], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1].to(keys.dtype)  # the sink takes its share
        return torch.einsum("hnk,kd->nhd", probs, keys)

    def _compressed(self, tokens, entries, table, bs, span, positions, x, q_res, comp):
        """Make the entries whose window closes in this chunk, then read all C complete ones: (entries [C, D],
        visible [n, C]). span: the new positions [p0, end), known on the host (positions holds them on the
        device, where reading one would wait for it)."""
        P, r = self.planes, self.rate

        def comp_rot(pos: torch.Tensor):
            return comp.cos_sin(pos, x.dtype)

        p0, end = span
        first, last = p0 // r, end // r  # entries first .. last - 1 close in this chunk
        if last > first:
            made = (tokens, entries, table, bs, first, last, comp_rot)
            self._make(*made, self.compressor, P.ckv, P.cgate, P.entry)
            if P.index_dim:
                self._make(*made, self.indexer.compressor, P.ikv, P.igate, P.ientry)
        C = last
        block, slot = P.entry_at(entries[1], entries[0].shape[1], torch.arange(C, device=x.device))
        entries = entries[0]
        if not P.index_dim:
            seen = torch.arange(C, device=x.device)[None, :] < ((positions + 1) // r)[:, None]  # [n, C]
            return entries[block, slot, P.entry], seen
        keys = entries[block, slot, P.ientry].to(x.dtype)
        seen = self.indexer.select(x, q_res, keys, positions, *comp_rot(positions))
        return entries[block, slot, P.entry], seen

    def _make(self, tokens, entries, table, bs, first, last, rot, comp: Compressor, kv_cols, gate_cols, out_cols):
        """Entries first .. last - 1 from the token planes' projections, into their compressed slots."""
        r, n, dev = comp.rate, last - first, tokens.device
        start = first * r if comp.series == 1 else max(0, (first - 1) * r)
        src = torch.arange(start, last * r, device=dev)
        page, off = table[src // bs], src % bs
        ckv, cgate = tokens[page, off, kv_cols], tokens[page, off, gate_cols]
        if comp.series == 2 and first == 0:  # no window before the first: placeholder rows, weighed at zero
            ckv = torch.cat([ckv.new_zeros(r, ckv.shape[1]), ckv])
            cgate = torch.cat([cgate.new_zeros(r, cgate.shape[1]), cgate])
        out = comp.entries(ckv, cgate, first, n, rot)
        view, etable = entries  # [pages, slots, We], the entry kind's block table
        block, slot = self.planes.entry_at(etable, view.shape[1], torch.arange(first, last, device=dev))
        view[block, slot, out_cols] = out.to(view.dtype)
