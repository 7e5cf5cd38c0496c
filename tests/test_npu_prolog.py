"""MLA decode through npu_mla_prolog_v3 and FIA on the fake torch_npu: NpuBackend.mla_prolog (afd/backend/npu_prolog.py)
against afd's CPU path for a DeepSeek-V3-shaped layer, the rope order it writes into the cache against HF's pairs,
what it refuses and why, and the documented argument names and weight formats it is called with."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from test_npu_fia import ops as fia_ops
from test_npu_mla_prolog import formats
from test_npu_mla_prolog import ops as prolog_ops

from afd.backend import npu_prolog
from afd.model import latent_cache
from afd.model.attention_metadata import AttentionMetadata
from afd.model.layers import apply_rotary, apply_rotary_halves
from afd.model.mla import MLAttention, attach_backend

HE, HCQ, C, D, R, N = 7168, 1536, 512, 128, 64, 32  # the op's fixed widths (DeepSeek-V3's); FIA's MLA mode: 32 heads
BS = 16
HISTORY = [39, 16, 2]  # tokens each sequence has cached before the decode step
NB = 16  # cache blocks


def _backend(**ops):
    """NpuBackend over the fake ops (no device here: skip __init__, keep the real methods)."""
    from afd.backend.npu import NpuBackend

    be = object.__new__(NpuBackend)
    fakes = dict(
        npu_fused_infer_attention_score=fia_ops.npu_fused_infer_attention_score,
        npu_mla_prolog_v3=prolog_ops.npu_mla_prolog_v3,
        npu_format_cast=formats.npu_format_cast,
    )
    be._torch_npu = SimpleNamespace(**(fakes | ops))
    return be


@pytest.fixture(scope="module")
def layer():
    """DeepSeek-V3's MLA widths (hidden 7168, q LoRA 1536, kv LoRA 512, D 128, Dr 64) with 32 heads, bf16. v_head_dim
    is 16, not 128: W_UV and o_proj are outside the prolog, and this keeps the layer at 31M parameters."""
    cfg = SimpleNamespace(
        num_attention_heads=N, hidden_size=HE, qk_nope_head_dim=D, qk_rope_head_dim=R, qk_head_dim=D + R,
        v_head_dim=16, q_lora_rank=HCQ, kv_lora_rank=C, attention_bias=False,
    )  # fmt: skip
    torch.manual_seed(0)
    attn = MLAttention(cfg).bfloat16()
    with torch.no_grad():  # gammas away from 1, so that a gamma left out would show
        for norm in (attn.q_a_layernorm, attn.kv_a_layernorm):
            norm.weight.copy_(1 + 0.2 * torch.randn_like(norm.weight))
    return attn


def _family(attn: MLAttention, family: str) -> MLAttention:
    """The layer with one family's options: DeepSeek-V3's interleaved rope, its `rope_interleave: false` (halves),
    or LongCat-Flash's LoRA scales (with its interleaved rope)."""
    attn.rotate = apply_rotary_halves if family == "deepseek_v3_halves" else apply_rotary
    scales = family == "longcat_scales"
    attn.q_lora_scale = (HE / HCQ) ** 0.5 if scales else 1.0
    attn.kv_lora_scale = (HE / C) ** 0.5 if scales else 1.0
    attn.backend = attn.prolog = None
    return attn


INV_FREQ = 1.0 / (10000 ** (torch.arange(0, R, 2).float() / R))


def _step(starts, lens, tables, bs=BS):
    meta = AttentionMetadata.build(starts, lens, tables, bs, torch.device("cpu"))
    angle = meta.positions.float()[:, None] * INV_FREQ
    x = torch.randn(meta.num_tokens, HE, generator=torch.Generator().manual_seed(sum(lens))).bfloat16()
    return x, angle.cos().bfloat16(), angle.sin().bfloat16(), meta


TABLES = [[4 * i + j for j in range(math.ceil((n + 1) / BS))] for i, n in enumerate(HISTORY)]


def _prefilled(attn: MLAttention):
    """A cache whose history afd's own prefill wrote (the CPU path: MLA's rotation, its order), the history's
    inputs, and the decode step after it: one token per sequence."""
    cache = torch.zeros(NB, BS, C + R).bfloat16()
    history = _step([0] * 3, HISTORY, TABLES)
    with torch.no_grad():
        attn(*history, cache)
    return cache, history, _step(HISTORY, [1] * 3, TABLES)


class _Spy:
    """The layer's prolog, keeping what it returns."""

    def __init__(self, prolog):
        self.prolog, self.out = prolog, []

    def takes(self, kv_c, kv_r):
        return self.prolog.takes(kv_c, kv_r)

    def __call__(self, *args):
        self.out.append(self.prolog(*args))
        return self.out[-1]


def _hf_rope_scores(attn: MLAttention, x_q, pos_q, x_k, pos_k, interleave: bool) -> torch.Tensor:
    """q_rope . k_rope [N, L] as HF defines it, in fp32, from the unrotated projections: rope dim pairs (2j, 2j + 1)
    with rope_interleave, else (j, j + Dr/2), pair j turned by position x INV_FREQ[j]. As complex numbers the score
    is sum_j Re(q_j conj(k_j) e^{i (pos_q - pos_k) w_j}): independent of the order the pairs are written in."""

    def rms(v, gamma):
        return gamma.float() * v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)

    cq = rms(F.linear(x_q.float(), attn.q_a_proj.weight.float()), attn.q_a_layernorm.weight)
    q = F.linear(cq, attn.q_b_proj.weight.float()).view(N, D + R)[:, D:] * attn.q_lora_scale  # [N, Dr]
    k = F.linear(x_k.float(), attn.kv_a_proj_with_mqa.weight.float())[:, C:]  # [L, Dr]

    def pairs(v):
        v = v.view(*v.shape[:-1], R // 2, 2) if interleave else v.view(*v.shape[:-1], 2, R // 2).transpose(-1, -2)
        return torch.view_as_complex(v.contiguous())

    turn = torch.polar(torch.ones(len(pos_k), R // 2), (pos_q - pos_k.float())[:, None] * INV_FREQ)  # [L, Dr/2]
    return (pairs(q)[:, None, :] * pairs(k).conj()[None] * turn[None]).real.sum(-1)


@pytest.mark.parametrize(
    "family", ["deepseek_v3", "deepseek_v3_halves", pytest.param("longcat_scales", marks=pytest.mark.slow)]
)
def test_decode_through_the_prolog_and_fia_equals_the_cpu_path(layer, family):
    """The decode step through npu_mla_prolog_v3 + FIA over a history afd's prefill wrote, against the CPU path:
    called with the documented argument names and NZ weights, writing only the new tokens' slots, in the order
    afd's prefill writes (its rope query against afd's cached keys scores as HF's pairs do)."""
    attn = _family(layer, family)
    cache, (x_hist, _, _, hist_meta), (x, cos, sin, meta) = _prefilled(attn)
    with torch.no_grad():
        want_cache = cache.clone()
        want = attn(x, cos, sin, meta, want_cache)
        ref = attn.float()(x.float(), cos.float(), sin.float(), meta, cache.float())  # fp32, the same bf16 weights
        attn.bfloat16()
        before = len(torch.ops.fake_npu.calls)
        attach_backend(attn, _backend())
        assert attn.prolog is not None
        spy = attn.prolog = _Spy(attn.prolog)
        got = attn(x, cos, sin, meta, cache)
    calls = torch.ops.fake_npu.calls[before:]
    shapes = [(HE, HCQ), (HCQ, N * (D + R)), (HE, C + R)]  # weight_dq, weight_uq_qr, weight_dkv_kr: cast at load
    assert [c for c in calls if c[0] == "npu_format_cast"] == [("npu_format_cast", 29, s) for s in shapes]
    (prolog,) = [c for c in calls if c[0] == "npu_mla_prolog_v3"]
    # every argument by its documented name (the doc's prototype; an unknown keyword fails the op's schema)
    options = ("cache_index", "rmsnorm_epsilon_cq", "rmsnorm_epsilon_ckv", "cache_mode", "qc_qr_scale", "kc_scale")
    assert prolog[1:] == (3, N, prolog_ops.INPUTS + options), prolog
    ran = [c[0] for c in calls if c[0] != "npu_format_cast"]
    assert ran == ["npu_mla_prolog_v3", "npu_fused_infer_attention_score"], ran

    # Each path against the fp32 computation: the op projects in fp32 and rounds each output once, afd's bf16 path
    # rounds after every product and norm (as HF's eager bf16), so the fused path is to be at least as close
    # (measured: 0.3x-0.8x afd's error; 1.25x leaves room for where roundings fall). A rope order apart from the
    # cache's would put it orders of magnitude off.
    err_got, err_want = (got.float() - ref).abs(), (want.float() - ref).abs()
    assert err_got.max() <= 1.25 * err_want.max() and err_got.mean() <= 1.25 * err_want.mean(), (err_got, err_want)

    # The cache: the new tokens' latents and rotated keys as afd writes them, within two bf16 ulps (one rounding
    # each, of values computed in a different order); every other slot untouched.
    (c_new, r_new), (c_old, r_old) = latent_cache.planes(cache, C), latent_cache.planes(want_cache, C)
    slots = meta.slot_mapping
    for new, old in ((c_new, c_old), (r_new, r_old)):
        new, old = new.flatten(0, 1), old.flatten(0, 1)
        torch.testing.assert_close(new[slots].float(), old[slots].float(), rtol=2**-7, atol=2**-8 * old.abs().max())
        rest = torch.ones(new.shape[0], dtype=torch.bool)
        rest[slots] = False
        assert torch.equal(new[rest], old[rest])

    # HF's q_rope . k_rope: the op's rope query for sequence 0 against the keys afd's prefill cached for it
    (_, q_rot), seq = spy.out[0], hist_meta.seqs[0]
    k_rot = r_new.flatten(0, 1)[hist_meta.slot_mapping[seq.q_start : seq.q_start + seq.q_len]]
    scores = q_rot[0].float() @ k_rot.float().T  # [N, 39]
    hf = _hf_rope_scores(
        attn, x[0], HISTORY[0], x_hist[: seq.q_len], torch.arange(seq.q_len), family != "deepseek_v3_halves"
    )
    # bf16 q and k (a 2^-8 rounding each) over 64 products: within 2^-6 of the largest score
    torch.testing.assert_close(scores, hf, rtol=0, atol=2**-6 * hf.abs().max().item())


def _refused(w):
    weights = ("q_a", "q_b", "q_norm", "kv_a", "kv_norm", "w_uk")
    return [
        ({"q_a": None}, {}, "without a LoRA"),  # DeepSeek-V3's q_lora_rank: null
        ({"bias": True}, {}, "have a bias"),
        ({k: getattr(w, k).float() for k in weights}, {}, "dtype torch.float32"),  # an fp32 model
        ({"kv_a": w.kv_a[:, :4096]}, {}, "hidden size 4096"),  # every tiny test model's kind of width
        ({"q_a": w.q_a[:1024]}, {}, "LoRA ranks 1024/512"),
        ({"w_uk": w.w_uk[:3]}, {}, "3 heads"),  # N must be a power of two
        ({}, {"npu_mla_prolog_v3": None}, "no npu_mla_prolog_v3"),  # op-plugin before 7.3.0
    ]


@pytest.mark.parametrize("i", range(7))
def test_layers_outside_the_documented_shapes_keep_afds_projections(layer, i, caplog):
    """Checked at load, against the layer's shapes and dtype: refused, nothing prepared, the reason said once."""
    w = _family(layer, "deepseek_v3").prolog_weights()
    change, ops, why = _refused(w)[i]
    be = _backend(**ops)
    before = len(torch.ops.fake_npu.calls)
    with caplog.at_level("INFO", logger="afd.backend"):
        assert be.mla_prolog(dataclasses.replace(w, **change)) is None
        assert be.mla_prolog(dataclasses.replace(w, **change)) is None  # the next layer: said already
    assert len(torch.ops.fake_npu.calls) == before  # no weight cast, no call
    said = [r.getMessage() for r in caplog.records if "npu_mla_prolog_v3" in r.getMessage()]
    assert len(said) == 1 and why in said[0], said
    assert npu_prolog.refusal(_backend()._torch_npu, w) is None  # unchanged, the layer fits


def test_steps_the_prolog_does_not_take_run_afds_path(layer, caplog):
    """A cache outside the op's paged layout (block size 8) is refused at the step, the reason said once, and the
    step is afd's own, bit for bit; a step with a prefill row (its q must stay unabsorbed) never calls the op."""
    attn = _family(layer, "deepseek_v3")
    be = _backend()
    tables8 = [[8 * i + j for j in range(math.ceil((n + 1) / 8))] for i, n in enumerate(HISTORY)]
    x, cos, sin, meta = _step(HISTORY, [1] * 3, tables8, bs=8)
    cache8 = torch.randn(2 * NB, 8, C + R, generator=torch.Generator().manual_seed(3)).bfloat16()
    mixed = _step([HISTORY[0], HISTORY[1], 0], [1, 1, 5], TABLES)
    cache16 = torch.randn(NB, BS, C + R, generator=torch.Generator().manual_seed(4)).bfloat16()
    with torch.no_grad():
        want8, want_mixed = attn(x, cos, sin, meta, cache8.clone()), attn(*mixed, cache16.clone())
        attach_backend(attn, be)
        before = len(torch.ops.fake_npu.calls)
        with caplog.at_level("INFO", logger="afd.backend"):
            got8 = [attn(x, cos, sin, meta, cache8.clone()) for _ in range(2)]
            got_mixed = attn(*mixed, cache16.clone())
    assert all(torch.equal(g, want8) for g in got8)
    assert torch.equal(got_mixed[2:], want_mixed[2:])  # the prefill rows; the decode rows went through FIA
    assert [c[0] for c in torch.ops.fake_npu.calls[before:]] == ["npu_fused_infer_attention_score"]
    said = [r.getMessage() for r in caplog.records if "npu_mla_prolog_v3" in r.getMessage()]
    assert len(said) == 1 and "block size 8" in said[0], said


DEVICE_SCRIPT = """
import sys
sys.path.insert(0, {fakes!r})
import torch, torch_npu
from torch_npu.device import STATS
from afd.backend.npu import NpuBackend
from afd.model.mla import attach_backend
sys.path.insert(0, {tests!r})
import test_npu_prolog as t

# The prolog + FIA decode step on the fake Ascend device, npu:1, against the CPU path
attn = t._family(t.layer.__wrapped__(), "deepseek_v3")
cache, _, (x, cos, sin, meta) = t._prefilled(attn)
with torch.no_grad():
    want = attn(x, cos, sin, meta, cache.clone())
    be = NpuBackend(1)
    dev = be.device
    attn.to(dev)
    attach_backend(attn, be)
    assert attn.prolog is not None
    dmeta = t.AttentionMetadata.build(t.HISTORY, [1] * 3, t.TABLES, t.BS, dev)
    xs, cs, ss, dc = x.to(dev), cos.to(dev), sin.to(dev), cache.to(dev)
    torch.npu.synchronize()
    before = (STATS["host_syncs"], STATS["host_reads"])
    got = attn(xs, cs, ss, dmeta, dc)
    after = (STATS["host_syncs"], STATS["host_reads"])
    got = got.cpu()
names = [c[0] for c in torch.ops.fake_npu.calls[-2:]]
assert names == ["npu_mla_prolog_v3", "npu_fused_infer_attention_score"], torch.ops.fake_npu.calls
assert after == before, (before, after)  # nothing read back on the host
assert not STATS["hazards"], STATS["hazards"]
# each path is within 3.7e-3 of the fp32 computation (measured by the CPU test above): within 8e-3 of each other
torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=8e-3)
print("ok")
"""


@pytest.mark.slow
def test_decode_through_the_prolog_on_the_fake_device():
    """On the fake Ascend device (a process of its own): the prolog's cache write and FIA's read of it are ordered
    on the stream, and the step reads nothing back on the host."""
    from pathlib import Path

    from rank_processes import run
    from test_npu_fia import FAKES

    tests = str(Path(__file__).resolve().parent)
    (ran,) = run(DEVICE_SCRIPT.format(fakes=str(FAKES), tests=tests), [[]], timeout=240)
    assert ran.returncode == 0 and "ok" in ran.stdout, ran.stderr[-3000:]
