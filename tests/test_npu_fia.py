"""npu_fused_infer_attention_score (FIA), MLA's paged decode on Ascend: the fake op (tests/fakes/torch_npu/
ops_attention.py) against the formula and rules of its document, op-plugin 7.1.0, and each rule refused; then
NpuBackend.paged_mla_decode on it (afd/backend/npu_attention.py) against the chunked path it replaces."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

FAKES = Path(__file__).resolve().parent / "fakes"


def _load_ops():
    # By path, as tests/test_npu_fakes.py loads ops.py: tests/fakes stays off sys.path.
    path = FAKES / "torch_npu" / "ops_attention.py"
    spec = importlib.util.spec_from_file_location("afd_tests_fake_npu_attention", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


ops = _load_ops()
C, R = 512, 64  # FIA's MLA mode: latent and rope widths (doc)


def _case(B=3, N=32, bs=16, lens=(40, 17, 3), dtype=torch.bfloat16, layout="BSND", seed=0):
    """FIA's arguments for one decode step and the unshaped inputs the reference reads. Blocks are handed
    out shuffled (a busy pool), tables padded with block 0 as afd pads them."""
    g = torch.Generator().manual_seed(seed)
    need = [math.ceil(n / bs) for n in lens]
    nb = sum(need) + 2
    order = torch.randperm(nb, generator=g).tolist()
    rows, at = [], 0
    for k in need:
        rows.append(order[at : at + k] + [0] * (max(need) - k))
        at += k
    q, qr = torch.randn(B, N, C, generator=g).to(dtype), torch.randn(B, N, R, generator=g).to(dtype)
    key, kr = torch.randn(nb, bs, C, generator=g).to(dtype), torch.randn(nb, bs, R, generator=g).to(dtype)
    shape = {"BSND": (B, 1, N), "BNSD": (B, N, 1), "BSH": (B, 1)}[layout]
    args = dict(
        query=q.reshape(*shape, -1), key=key, value=key, query_rope=qr.reshape(*shape, -1), key_rope=kr,
        block_table=torch.tensor(rows, dtype=torch.int32), actual_seq_lengths_kv=list(lens), num_heads=N,
        num_key_value_heads=1, scale=0.07, input_layout=layout, block_size=bs,
    )  # fmt: skip
    return args, (q, qr, key, kr)


def _reference(q, qr, key, kr, table, lens, scale):
    """The doc's formula in float64: softmax((q k^T + q_rope k_rope^T) * scale) v, v = k (the latents)."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    bs = key.shape[1]
    for b, n in enumerate(lens):
        blocks = table[b, : math.ceil(n / bs)].long()
        k, r = key[blocks].reshape(-1, C)[:n].double(), kr[blocks].reshape(-1, R)[:n].double()
        s = (q[b].double() @ k.T + qr[b].double() @ r.T) * scale
        out[b] = torch.softmax(s, dim=-1) @ k
    return out


def _fia(args: dict, **change):
    a = args | change
    return ops.npu_fused_infer_attention_score(a.pop("query"), a.pop("key"), a.pop("value"), **a)


# The fake accumulates in fp32 and rounds once to the output dtype: within an output ulp of the fp64 reference.
TOL = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


@pytest.mark.parametrize(
    "layout,dtype,N,bs",
    [("BSND", torch.bfloat16, 32, 16), ("BNSD", torch.float16, 64, 128), ("BSH", torch.bfloat16, 128, 16)],
)
def test_fake_fia_is_the_documented_formula(layout, dtype, N, bs):
    lens = (2 * bs + 5, bs, 1)  # a partial last block, exactly one block, one key
    args, (q, qr, key, kr) = _case(N=N, bs=bs, lens=lens, dtype=dtype, layout=layout)
    out, lse = _fia(args)
    assert out.shape == args["query"].shape and out.dtype == dtype
    assert lse.shape == (1,) and lse.item() == 0  # source code: a [1] zero without softmax_lse_flag
    ref = _reference(q, qr, key, kr, args["block_table"], lens, 0.07)
    tol = TOL[dtype]
    torch.testing.assert_close(out.reshape(ref.shape).double(), ref, rtol=tol, atol=tol)


def test_one_length_serves_every_batch_and_meta_gives_the_shape():
    args, (q, qr, key, kr) = _case(lens=(17, 17, 17))
    torch.testing.assert_close(_fia(args, actual_seq_lengths_kv=[17])[0], _fia(args)[0])  # doc: length 1
    meta = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    out, lse = _fia(meta)
    assert out.shape == args["query"].shape and lse.shape == (1,)


def _refusals():
    a, _ = _case()
    wide = torch.randn(a["key"].shape[0], 16, C + R, dtype=torch.bfloat16)  # afd's combined cache
    q16 = a["query"][:, :, :16].contiguous()
    return [
        (dict(query_rope=None), "given together"),
        (dict(key=wide[..., :C], value=wide[..., :C], block_size=16), "contiguous"),
        (dict(query=a["query"].transpose(0, 2).contiguous().transpose(0, 2)), "query must be contiguous"),
        (dict(query=a["query"].float(), query_rope=a["query_rope"].float()), "float16 or bfloat16"),
        (dict(query_rope=a["query_rope"].half()), "dtype must equal"),
        (dict(num_heads=64), "num_heads 64"),
        (dict(query=a["query"][..., :256].contiguous()), "D must be 512"),
        (dict(query=q16, query_rope=a["query_rope"][:, :, :16].contiguous(), num_heads=16), "32, 64 or 128"),
        (dict(query_rope=a["query_rope"][..., :32].contiguous()), "query_rope must be"),
        (dict(softmax_lse_flag=True), "softmax_lse_flag"),
        (dict(kv_padding_size=torch.zeros(3, dtype=torch.int64)), "kv_padding_size"),
        (dict(pse_shift=torch.zeros(1)), "pse_shift"),
        (dict(sparse_mode=3), "sparse_mode 0"),
        (dict(atten_mask=torch.zeros(3, 48, dtype=torch.bool)), "sparse_mode 0"),
        (dict(inner_precise=2), "inner_precise"),
        (dict(block_table=None), "requires page attention"),
        (dict(block_size=64), "block_size 16 or 128"),
        (dict(block_table=a["block_table"].long()), "int32"),
        (dict(block_table=a["block_table"][:2]), "int32 \\[B=3"),
        (dict(key=a["key"][:, :8].contiguous(), value=a["key"][:, :8].contiguous()), "block_size=16"),
        (dict(value=a["key"][:-1].contiguous()), "same shape"),
        (dict(num_key_value_heads=0), "N 1 and D 512"),
        (dict(key_rope=a["key_rope"][:, :, :32].contiguous()), "key_rope must be"),
        (dict(actual_seq_lengths_kv=None), "requires actual_seq_lengths_kv"),
        (dict(actual_seq_lengths_kv=[40, 17]), "1 or >= 3"),
        (dict(actual_seq_lengths_kv=[40, 17, 49]), "columns hold <"),
        (dict(key=a["key"][:4].contiguous(), value=a["key"][:4].contiguous(), key_rope=a["key_rope"][:4].contiguous()),
         "fewer than the batches"),
    ]  # fmt: skip


@pytest.mark.parametrize("i", range(len(_refusals())))
def test_fake_fia_refuses_what_the_doc_rules_out(i):
    change, match = _refusals()[i]
    args, _ = _case()
    with pytest.raises(RuntimeError, match=match):
        _fia(args, **change)


def test_fake_fia_does_not_compute_other_modes():
    """Modes outside MLA paged decode are not modelled: they raise, so no test passes on them by accident."""
    args, _ = _case()
    for change in (
        dict(query_rope=None, key_rope=None),  # GQA
        dict(query=torch.randn(3, 2, 32, C, dtype=torch.bfloat16), query_rope=torch.randn(3, 2, 32, R).bfloat16()),
        dict(input_layout="TND", query=args["query"][:, 0], query_rope=args["query_rope"][:, 0]),
        dict(key=args["key"].to(torch.int8), value=args["key"].to(torch.int8)),
    ):
        with pytest.raises(NotImplementedError):
            _fia(args, **change)


# ---------------------------------------------------------------------------------------------------------
# NpuBackend.paged_mla_decode and MLA decode on the fake op
# ---------------------------------------------------------------------------------------------------------


class _Op:
    """torch_npu.npu_fused_infer_attention_score as the backend sees it, counting calls; `split`: hand the op
    contiguous copies of the latent and rope caches, what a split cache layout would pass (see
    test_mla_decode_through_fia_equals_the_cpu_path)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return ops.npu_fused_infer_attention_score(*args, **kwargs)


def _backend(op=None):
    from types import SimpleNamespace

    from afd.backend.npu import NpuBackend

    be = object.__new__(NpuBackend)  # no device here: skip __init__, keep the real methods
    be._torch_npu = SimpleNamespace(npu_fused_infer_attention_score=op or _Op())
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

    def read(blocks):  # MLAttention._attend_latent's read: keys [c, k_rot], values c
        kv = torch.cat([paged_attention.gather(kv_c, blocks), paged_attention.gather(kv_r, blocks)], dim=-1)
        return kv, kv[..., :C]

    ref, _ = paged_attention.attend(
        torch.cat([q, qr], dim=-1), tables, torch.tensor(lens), 16, read, ("bhd,bld->bhl", "bhl,blc->bhc"), scale
    )
    # bf16 inputs either way; the chunked path rounds p to bf16 before the value product, the fake does not:
    # a bf16 ulp apart
    torch.testing.assert_close(o.double(), ref.double(), rtol=1.6e-2, atol=1.6e-2)


def _refused():
    args, _ = _case()
    q, qr, kv_c, kv_r, tables, lens, scale = _hook_args(args)
    wide = torch.cat([kv_c, kv_r], dim=-1)  # afd's MLA cache today: [nb, bs, C + R]
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
    fake NPU backend: with afd's one-tensor cache FIA is refused (its key must be contiguous) and the step
    is the CPU's bit for bit; with the latent and rope caches split, as a split layout would hand them
    over, the step goes through FIA and matches the CPU's within bf16 rounding."""
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
        assert attn(x, cos, sin, meta, cache.clone()).equal(want)
        assert be._torch_npu.npu_fused_infer_attention_score.calls == 0

        real = be.paged_mla_decode

        def split(q, qr, kv_c, kv_r, *rest):
            return real(q, qr, kv_c.contiguous(), kv_r.contiguous(), *rest)

        be.paged_mla_decode = split
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
from test_npu_fia import _mla, C, R

# MLA decode on the fake Ascend device, npu:1: the step through FIA (split caches) against the same step on the CPU
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
    real = be.paged_mla_decode
    be.paged_mla_decode = lambda q, qr, kc, kr, *rest: real(q, qr, kc.contiguous(), kr.contiguous(), *rest)
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
