"""npu_mla_prolog_v3 on the fake torch_npu (tests/fakes/torch_npu/ops_prolog.py): its documented formula against
afd's own MLA projections (afd/model/mla.py) with afd's weights fed in the documented layout, which shows how
afd's MLA would call it (not wired: see docs/architecture/backends.md), and each documented rule refused."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from afd.model.mla import MLAttention

FAKES = Path(__file__).resolve().parent / "fakes"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"afd_tests_fake_npu_{name}", FAKES / "torch_npu" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


ops, formats = _load("ops_prolog"), _load("ops_format")
HE, HCQ, C, D, R, T = 7168, 1536, 512, 128, 64, 5  # the doc's fixed widths (DeepSeek-V3's); T tokens


@pytest.fixture(scope="module")
def mla():
    """DeepSeek-V3-shaped MLA with 2 heads, weights rounded to bf16 and kept fp32: afd's fp32 path and the
    fake (fp32 inside) then see the same numbers, and differ only by the fake's one rounding of its outputs."""
    cfg = SimpleNamespace(
        num_attention_heads=2, hidden_size=HE, qk_nope_head_dim=D, qk_rope_head_dim=R, qk_head_dim=D + R,
        v_head_dim=D, q_lora_rank=HCQ, kv_lora_rank=C, attention_bias=False,
    )  # fmt: skip
    torch.manual_seed(0)
    attn = MLAttention(cfg)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(p.bfloat16().float() if p.dim() > 1 else (1 + 0.1 * torch.randn_like(p)).bfloat16().float())
    return attn


def _inputs(attn: MLAttention, lora_scales: bool):
    """The op's arguments from afd's weights: nn.Linear's [out, in] weights transposed ([in, out], the doc's
    shapes; the three the doc wants in FRACTAL_NZ cast), W_UK as kv_b_proj's first rows per head, afd's [T, R/2]
    rotary tables doubled to [T, Dr]."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, HE, generator=g).bfloat16()
    angle = torch.rand(T, R // 2, generator=g) * 6
    cos, sin = angle.cos().bfloat16().float(), angle.sin().bfloat16().float()
    w_uk, _ = attn._w_uk_uv()

    def bf(t):
        return t.detach().bfloat16().contiguous()

    def nz(t):
        return formats.npu_format_cast(bf(t), formats.FRACTAL_NZ)

    args = [
        x, nz(attn.q_a_proj.weight.T), nz(attn.q_b_proj.weight.T), bf(w_uk), nz(attn.kv_a_proj_with_mqa.weight.T),
        bf(attn.q_a_layernorm.weight), bf(attn.kv_a_layernorm.weight), bf(torch.cat([sin, sin], -1)),
        bf(torch.cat([cos, cos], -1)), torch.zeros(4, 16, 1, C).bfloat16(), torch.zeros(4, 16, 1, R).bfloat16(),
    ]  # fmt: skip
    kw = dict(
        cache_index=torch.tensor([3, 17, 18, 40, 63]), rmsnorm_epsilon_cq=1e-6, rmsnorm_epsilon_ckv=1e-6,
        qc_qr_scale=attn.q_lora_scale if lora_scales else 1.0, kc_scale=attn.kv_lora_scale if lora_scales else 1.0,
    )  # fmt: skip
    return args, kw, (cos, sin)


@pytest.mark.parametrize("lora_scales", [False, True], ids=["deepseek_v3", "longcat_flash"])
def test_prolog_is_afds_mla_projection(mla, lora_scales):
    mla.q_lora_scale = (HE / HCQ) ** 0.5 if lora_scales else 1.0
    mla.kv_lora_scale = (HE / C) ** 0.5 if lora_scales else 1.0
    args, kw, (cos, sin) = _inputs(mla, lora_scales)
    q_n, q_r, deq, q_norm, deq_norm = ops.npu_mla_prolog_v3(*args, **kw)
    kv_cache, kr_cache = args[9], args[10]
    with torch.no_grad():  # afd's forward up to attention, in fp32 (mla.py's forward, step by step)
        q, kva = mla._project(args[0].float())
        q_nope, q_rot = q.split([D, R], dim=-1)
        c, k_rot = kva.split([C, R], dim=-1)
        c = mla.kv_a_layernorm(c) * mla.kv_lora_scale
        q_lat = torch.einsum("bhn,hnc->bhc", q_nope * mla.q_lora_scale, mla._w_uk_uv()[0])
        q_rot = mla.rotate(q_rot * mla.q_lora_scale, cos, sin)  # halves order: the op's too (its golden)
        k_rot = mla.rotate(k_rot, cos, sin)
    slots = kw["cache_index"]
    # one bf16 rounding of each output (the op's) against fp32
    for got, want in (
        (q_n, q_lat),
        (q_r, q_rot),
        (kv_cache.view(-1, C)[slots], c),
        (kr_cache.view(-1, R)[slots], k_rot),
    ):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, rtol=8e-3, atol=8e-3 * want.abs().max().item())
    others = torch.ones(kv_cache.view(-1, C).shape[0], dtype=torch.bool)
    others[slots] = False
    assert not kv_cache.view(-1, C)[others].any()  # only the indexed slots are written
    assert deq.shape == (0,) and q_norm.shape == (0,) and deq_norm.shape == (0,)  # doc: [0] in this scenario


def _refusal_cases(mla):
    args, kw, _ = _inputs(mla, False)
    return [
        ({0: args[0][:, :4096].contiguous()}, {}, "He 7168 or 7680"),
        ({0: args[0].float()}, {}, "bfloat16"),
        ({1: formats.npu_format_cast(args[1].T.contiguous().T, 29)}, {}, "weight_dq must be contiguous"),
        ({2: args[2].clone()}, {}, "weight_uq_qr must be FRACTAL_NZ"),  # never cast: ND
        ({4: formats.npu_format_cast(args[4], formats.ND)}, {}, "weight_dkv_kr must be FRACTAL_NZ"),
        ({3: args[3].repeat(2, 1, 1)[:3].contiguous()}, {}, "power of two"),
        ({3: args[3][:, :64].contiguous()}, {}, "\\[N, 128, 512\\]"),
        ({2: formats.npu_format_cast(args[2][:, :100], 29)}, {}, "weight_uq_qr must be"),
        ({7: args[7][:, :32].contiguous()}, {}, "rope_sin must be"),
        ({9: args[9].view(4, 16, C)}, {}, "kv_cache must be"),
        ({10: args[10][:2].contiguous()}, {}, "kr_cache must be"),
        ({9: args[9].view(8, 8, 1, C), 10: args[10].view(8, 8, 1, R)}, {}, "multiple of 16"),
        ({}, {"cache_index": None}, "needs cache_index"),
        ({}, {"cache_index": kw["cache_index"].int()}, "int64"),
    ]


def test_prolog_refuses_what_the_doc_rules_out(mla):
    for change, kw_change, match in _refusal_cases(mla):
        args, kw, _ = _inputs(mla, False)
        for i, v in change.items():
            args[i] = v
        with pytest.raises(RuntimeError, match=match):
            ops.npu_mla_prolog_v3(*args, **(kw | kw_change))
    for kw_change in ({"weight_quant_mode": 1}, {"quant_scale_ckv": torch.ones(1, C)}, {"cache_mode": "TND"}):
        args, kw, _ = _inputs(mla, False)
        with pytest.raises(NotImplementedError):
            ops.npu_mla_prolog_v3(*args, **(kw | kw_change))
