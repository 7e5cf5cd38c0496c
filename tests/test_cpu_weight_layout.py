"""The CPU weight layout (afd.backend.cpu.column_major_linears): every nn.Linear of a loaded half holds its
weight column-major, with the same values, shape and Parameter; a tied lm_head keeps the embedding's table;
AFD_CPU_ROW_MAJOR_WEIGHTS=1 leaves weights as loaded. Tokens against HF with it on: every HF test."""

from __future__ import annotations

import torch
from torch import nn

from afd.backend.cpu import ROW_MAJOR_ENV, column_major_linears
from afd.model.checkpoint import build_attention_half, build_ffn_half, open_reader
from afd.model.registry import load_config


def _column_major(w: torch.Tensor) -> bool:
    return w.t().is_contiguous() and not w.is_contiguous()


def test_loaded_halves_are_column_major(tiny_checkpoint):
    cfg = load_config(tiny_checkpoint)
    attn = build_attention_half(cfg, open_reader(tiny_checkpoint, False, 0), torch.float32, torch.device("cpu"))
    ffn = build_ffn_half(cfg, open_reader(tiny_checkpoint, False, 0), torch.float32, torch.device("cpu"))
    linears = [m for half in (attn, ffn) for m in half.modules() if isinstance(m, nn.Linear)]
    assert linears and all(_column_major(m.weight) for m in linears)


def test_values_parameters_and_shared_weights_are_kept(monkeypatch):
    torch.manual_seed(0)
    emb, head, lin = nn.Embedding(16, 8), nn.Linear(8, 16, bias=False), nn.Linear(8, 12)
    head.weight = emb.weight  # tied
    model = nn.ModuleDict({"emb": emb, "head": head, "lin": lin})
    x = torch.randn(5, 8)
    before, param, ref = lin.weight.detach().clone(), lin.weight, lin(x)
    column_major_linears(model)
    assert lin.weight is param and _column_major(lin.weight) and torch.equal(lin.weight, before)
    torch.testing.assert_close(lin(x), ref)
    assert head.weight.is_contiguous() and head.weight is emb.weight  # the embedding gathers rows
    monkeypatch.setenv(ROW_MAJOR_ENV, "1")
    other = nn.Linear(8, 4)
    column_major_linears(other)
    assert other.weight.is_contiguous()


def test_tp_cut_weights_are_column_major_again(tiny_checkpoint):
    """A TP cut slices rows (shard._rows makes them contiguous again); laying out once more, as
    shard_attention_half does at its end, restores column-major."""
    from afd.model.tp import shard

    cfg = load_config(tiny_checkpoint)
    attn = build_attention_half(cfg, open_reader(tiny_checkpoint, False, 0), torch.float32, torch.device("cpu"))
    mlp = next(m for m in attn.modules() if type(m).__name__ == "DenseMLP")
    w = mlp.gate_proj.weight
    shard._rows(mlp.gate_proj, w[: w.shape[0] // 2])
    assert mlp.gate_proj.weight.is_contiguous()
    column_major_linears(attn)
    assert _column_major(mlp.gate_proj.weight)
