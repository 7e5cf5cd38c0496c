"""MLA decode through npu_fused_infer_attention_score: NpuBackend.paged_mla_decode (afd/backend/npu_attention.py)
on the fake op against the chunked path it replaces, its fallbacks, and afd's MLA decode through it (in process,
and on the fake Ascend device)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from test_npu_fia import FAKES, C, R, _case, ops


class _Op:
    """torch_npu.npu_fused_infer_attention_score as the backend sees it, counting calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return ops.npu_fused_infer_attention_score(*args, **kwargs)


def _backend(op=None):
    from types import SimpleNamespace

    from test_npu_mla_prolog import formats
    from test_npu_mla_prolog import ops as prolog_ops

    from afd.backend.npu import NpuBackend

    be = object.__new__(NpuBackend)  # no device here: skip __init__, keep the real methods
    be._torch_npu = SimpleNamespace(
        npu_fused_infer_attention_score=op or _Op(),
        npu_mla_prolog_v3=prolog_ops.npu_mla_prolog_v3,  # whose shapes none of these layers has
        npu_format_cast=formats.npu_format_cast,
    )
    return be


def _hook_args(case_args):
    a = case_args
    B, N = a["query"].shape[0], a["num_heads"]
    q, qr = a["query"].reshape(B, N, C), a["query_rope"].reshape(B, N, R)
    return q, qr, a["key"], a["key_rope"], a["block_table"].long(), a["actual_seq_lengths_kv"], a["scale"]


def test_backend_fia_equals_the_chunked_path():
    from afd.model import paged_attention

    args, _ = _case(lens=(70, 17, 3))
    q, qr, kv_c, kv_r, tables, lens, scale = _hook_args(args)
    be = _backend()
    o = be.paged_mla_decode(q, qr, kv_c, kv_r, tables, lens, scale)
    assert be._torch_npu.npu_fused_infer_attention_score.calls == 1 and o.shape == q.shape

    def read(blocks):  # MLAttention._attend_latent's read (keys [c, k_rot], values c), in fp32
        kv = torch.cat([paged_attention.gather(kv_c, blocks), paged_attention.gather(kv_r, blocks)], dim=-1)
        return kv.float(), kv[..., :C].float()

    q_full = torch.cat([q, qr], dim=-1).float()
    ref, _ = paged_attention.attend(
        q_full, tables, torch.tensor(lens), 16, read, ("bhd,bld->bhl", "bhl,blc->bhc"), scale
    )
    # the same bf16 inputs, the path in fp32: the fake computes in fp32 and rounds its output to bf16 once, so
    # they are a bf16 rounding apart (2^-8 relative; atol for outputs near 0, whose ulp is smaller than that)
    torch.testing.assert_close(o.double(), ref.double(), rtol=2**-8, atol=1e-3)


def _refused():
    args, _ = _case()
    q, qr, kv_c, kv_r, tables, lens, scale = _hook_args(args)
    wide = torch.cat([kv_c, kv_r], dim=-1)  # interleaved rows: both parts strided
    return [
        ((q, qr, wide[..., :C], wide[..., C:], tables, lens, scale), "two contiguous"),
        ((q[..., :32], qr, kv_c[..., :32], kv_r, tables, lens, scale), "widths 32/64"),  # a tiny model
        ((q[:, :16], qr[:, :16], kv_c, kv_r, tables, lens, scale), "16 heads"),  # 128 heads at attention TP 8
        ((q, qr, kv_c.view(-1, 32, C), kv_r.view(-1, 32, R), tables, lens, scale), "block size 32"),
        ((q.float(), qr.float(), kv_c.float(), kv_r.float(), tables, lens, scale), "float16 or bfloat16"),
        ((q, qr, kv_c, kv_r, tables, None, scale), "compiled graph"),
    ]


@pytest.mark.parametrize("i", range(len(_refused())))
def test_backend_falls_back_outside_the_documented_limits(i, caplog):
    inputs, why = _refused()[i]
    be = _backend()
    with caplog.at_level("INFO", logger="afd.backend"):
        assert be.paged_mla_decode(*inputs) is None
        assert be.paged_mla_decode(*inputs) is None
    assert be._torch_npu.npu_fused_infer_attention_score.calls == 0
    said = [r.getMessage() for r in caplog.records if "npu_fused_infer_attention_score" in r.getMessage()]
    assert len(said) == 1 and why in said[0]  # the reason, once


def _mla(lora_scales: bool, rope_interleave: bool, dtype=torch.bfloat16):
    """An MLA in FIA's shape (C 512, R 64, 32 heads) with small other widths, LongCat-Flash's options or
    DeepSeek-V3's (no LoRA scales, rope dims in halves, its own softmax scale)."""
    from types import SimpleNamespace

    from afd.model.mla import MLAttention

    cfg = SimpleNamespace(
        num_attention_heads=32, hidden_size=64, qk_nope_head_dim=16, qk_rope_head_dim=R, qk_head_dim=16 + R,
        v_head_dim=16, q_lora_rank=32, kv_lora_rank=C, attention_bias=False,
    )  # fmt: skip
    torch.manual_seed(0)
    scale = None if lora_scales else 0.11
    return MLAttention(cfg, lora_scales=lora_scales, softmax_scale=scale, rope_interleave=rope_interleave).to(dtype)


@pytest.mark.parametrize("family", ["longcat_flash", "deepseek_v3"])
def test_mla_decode_through_fia_equals_the_cpu_path(family):
    """One decode step of three sequences (with a prefill row beside them) on the CPU path and through the
    fake NPU backend: the cache's latent and rope planes (afd.model.latent_cache) are the contiguous paged
    tensors FIA's document asks for, so the step goes through FIA and matches the CPU's within bf16 rounding."""
    from afd.model.attention_metadata import AttentionMetadata
    from afd.model.mla import attach_backend

    attn = _mla(lora_scales=family == "longcat_flash", rope_interleave=family == "longcat_flash")
    bs, lens = 16, [70, 17, 3, 5]  # the last one prefills 5 tokens
    tables = [[4 * i + j for j in range(math.ceil(n / bs))] for i, n in enumerate(lens)]
    meta = AttentionMetadata.build([n - 1 for n in lens[:3]] + [0], [1, 1, 1, 5], tables, bs, torch.device("cpu"))
    cache = torch.randn(16, bs, C + R).bfloat16()
    x = torch.randn(8, 64).bfloat16()
    angle = torch.rand(8, R // 2) * 6
    cos, sin = angle.cos().bfloat16(), angle.sin().bfloat16()
    with torch.no_grad():
        want = attn(x, cos, sin, meta, cache.clone())
        be = _backend()
        attach_backend(attn, be)
        got = attn(x, cos, sin, meta, cache.clone())
    assert be._torch_npu.npu_fused_infer_attention_score.calls == 1
    assert torch.equal(got[3:], want[3:])  # the prefill rows never take the hook
    # the latents out of FIA differ from the chunked path's by a bf16 ulp (test above); W_UV and o_proj carry
    # that through two more bf16 products (measured: 2.4e-3 at most, on outputs of mean magnitude 0.07-0.14)
    torch.testing.assert_close(got.double(), want.double(), rtol=1.6e-2, atol=4e-3)


DEVICE_SCRIPT = """
import sys
sys.path.insert(0, {fakes!r})
import torch, torch_npu
from torch_npu.device import STATS
from afd.backend.npu import NpuBackend
from afd.model.attention_metadata import AttentionMetadata
from afd.model.mla import attach_backend
sys.path.insert(0, {tests!r})
from test_npu_mla_decode import _mla, C, R

# MLA decode on the fake Ascend device, npu:1: the step through FIA (the cache's planes, as they are) against the
# same step on the CPU
be = NpuBackend(1)
dev = be.device
attn = _mla(lora_scales=True, rope_interleave=True)
lens, bs = [70, 17, 3], 16
tables = [[4 * i + j for j in range(-(-n // bs))] for i, n in enumerate(lens)]
cache = torch.randn(16, bs, C + R).bfloat16()
x = torch.randn(3, 64).bfloat16()
angle = torch.rand(3, R // 2) * 6
cos, sin = angle.cos().bfloat16(), angle.sin().bfloat16()
with torch.no_grad():
    cpu_meta = AttentionMetadata.build([n - 1 for n in lens], [1] * 3, tables, bs, torch.device("cpu"))
    want = attn(x, cos, sin, cpu_meta, cache.clone())
    attn.to(dev)
    attach_backend(attn, be)
    meta = AttentionMetadata.build([n - 1 for n in lens], [1] * 3, tables, bs, dev)
    xs, cs, ss, dc = x.to(dev), cos.to(dev), sin.to(dev), cache.to(dev)
    torch.npu.synchronize()
    before = (STATS["host_syncs"], STATS["host_reads"])
    got = attn(xs, cs, ss, meta, dc)
    after = (STATS["host_syncs"], STATS["host_reads"])
    got = got.cpu()
assert torch.ops.fake_npu.calls[-1][0] == "npu_fused_infer_attention_score", torch.ops.fake_npu.calls
assert after == before, (before, after)  # the lengths are host ints afd already holds: no device read
assert not STATS["hazards"], STATS["hazards"]
torch.testing.assert_close(got.double(), want.double(), rtol=1.6e-2, atol=4e-3)
print("ok")
"""


def test_mla_decode_through_fia_on_the_fake_device():
    """On the fake Ascend device (a process of its own: the fake renames PyTorch's PrivateUse1 backend), the
    FIA step reads nothing back on the host and orders every access on the stream."""
    from rank_processes import run

    tests = str(Path(__file__).resolve().parent)
    (ran,) = run(DEVICE_SCRIPT.format(fakes=str(FAKES), tests=tests), [[]], timeout=120)
    assert ran.returncode == 0 and "ok" in ran.stdout, ran.stderr[-3000:]


@pytest.mark.parametrize("family", ["longcat_flash", "deepseek_v3"])
def test_tiny_families_offer_decode_to_the_backend_and_keep_hfs_tokens(families, family, caplog):
    """The real models reach the hook on every decode step (each MLA of each layer) and, outside FIA's limits
    (a tiny model's latent widths), keep HF's greedy tokens on the chunked path, the reason said once."""
    from conftest import REF_TOKENS
    from hf_families import FAMILIES
    from hf_reference import PROMPTS
    from test_families import _assert_matches_hf

    import afd
    from afd.model.mla import attach_backend

    name = next(iter(FAMILIES[family].configs))
    llm = afd.LLM(families.path(family, name), dtype="float32", block_size=4)
    be = _backend()
    offered = []
    real = be.paged_mla_decode
    be.paged_mla_decode = lambda *a: offered.append(a[0].shape) or real(*a)
    logits: list = []
    with caplog.at_level("INFO", logger="afd.backend"):
        attach_backend(llm.attn, be)
        ids = llm.generate_ids(PROMPTS, REF_TOKENS, logits_out=logits)
    _assert_matches_hf(family, ids, logits, families.ref(family, name))
    assert offered and be._torch_npu.npu_fused_infer_attention_score.calls == 0
    said = [r.getMessage() for r in caplog.records if "npu_fused_infer_attention_score" in r.getMessage()]
    assert len(said) == 1 and "latent/rope widths" in said[0], said
    said = [r.getMessage() for r in caplog.records if "npu_mla_prolog_v3" in r.getMessage()]
    assert len(said) == 1 and "hidden size" in said[0], said  # checked at load, every layer alike


def test_a_compiled_graph_does_not_offer_decode_to_the_backend():
    """FIA 7.1.0 takes the context lengths as host ints, which a static graph would freeze: traced (fullgraph,
    no graph break), MLA never asks the backend and reads the cache itself."""
    from afd.model.attention_metadata import AttentionMetadata
    from afd.model.mla import attach_backend

    attn = _mla(lora_scales=True, rope_interleave=True)
    meta = AttentionMetadata.build([69, 16], [1, 1], [[0, 1, 2, 3, 4], [5, 6]], 16, torch.device("cpu"))
    x, cos, sin = torch.randn(2, 64).bfloat16(), torch.ones(2, R // 2), torch.zeros(2, R // 2)
    cache = torch.randn(8, 16, C + R).bfloat16()
    be = _backend()
    attach_backend(attn, be)
    offered = []
    be.paged_mla_decode = lambda *a: offered.append(1)
    with torch.no_grad():
        want = attn(x, cos.bfloat16(), sin.bfloat16(), meta, cache.clone())
        assert offered == [1]  # eager: offered (and, here, declined)
        got = torch.compile(attn, backend="eager", fullgraph=True)(x, cos.bfloat16(), sin.bfloat16(), meta, cache)
    assert offered == [1] and torch.equal(got, want)
