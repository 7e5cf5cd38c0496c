"""Quantized serving on Ascend without hardware: the fake torch_npu quantized ops (tests/fakes/torch_npu/ops_quant.py)
against their documents, and NpuBackend's quant_matmul / quant_grouped_matmul / check_quantization on them, against
afd.quant.reference.

Shapes: T tokens, K in, N out, G experts. Weights in the checkpoint's orientation: q [N, K] / [G, N, K].
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import textwrap
import types

import pytest
import torch
from rank_processes import run
from test_npu_fakes import FAKES, _fresh, ops  # noqa: F401  (_fresh: fixture; ops: ops.py's op, loaded first)

from afd.backend.base import refuse_host_syncs
from afd.backend.npu import NpuBackend
from afd.quant import reference
from afd.quant.formats import FP8, dequantize, quantize_int8_channel, quantize_rows_int8
from afd.quant.scheme import CheckpointQuant, QuantConfigError, QuantSpec, resolve


def _load():
    path = FAKES / "torch_npu" / "ops_quant.py"
    spec = importlib.util.spec_from_file_location("afd_tests_fake_torch_npu_ops_quant", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # torch.compile looks traced functions' modules up by name
    spec.loader.exec_module(mod)
    return mod


fq = _load()
W8A8, W8A16 = resolve("w8a8", None), resolve("w8a16", None)
BF16, F16 = torch.bfloat16, torch.float16


def _backend() -> NpuBackend:
    be = object.__new__(NpuBackend)  # no device here: skip __init__, keep the real methods
    be._torch_npu = types.SimpleNamespace(
        npu_dynamic_quant=fq.npu_dynamic_quant,
        npu_quant_matmul=fq.npu_quant_matmul,
        npu_weight_quant_batchmatmul=fq.npu_weight_quant_batchmatmul,
        npu_grouped_matmul=fq.npu_grouped_matmul,
    )
    return be


def _weights(*lead: int, n: int = 24, k: int = 40, seed: int = 0):
    torch.manual_seed(seed)
    w = torch.randn(*lead, n, k)
    qs = [quantize_int8_channel(m) for m in w.reshape(-1, n, k)]
    q = torch.stack([a for a, _ in qs]).reshape(*lead, n, k)
    return q, torch.stack([s for _, s in qs]).reshape(*lead, n, 1)


def _assert_near(y, ref, x, q, scale):
    """Both sides round once to x's dtype from fp32 values that differ only by fp32 rounding, by the expert scales
    rounded to bfloat16 (w8a8 grouped: 2^-9 relative) or by the fake-quantized weight rounded to x's dtype (w8a16:
    each weight element within one eps of the reference's). So |y - ref| <= 2 eps |ref| (the two output roundings)
    + eps * sum_k |x_k| |w_nk| (every term's error, cancellation included)."""
    eps = torch.finfo(x.dtype).eps
    assert y.dtype == x.dtype and y.shape == ref.shape
    bound = x.float().abs() @ dequantize(q, scale, q.shape[-1]).abs().t()  # [T, N]
    err = (y.float() - ref.float()).abs()
    assert (err <= 2 * eps * ref.float().abs() + eps * bound + 1e-6).all(), (err.max(), bound.max())


# ---- the fakes against their documents ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [BF16, F16])
def test_fake_dynamic_quant_is_the_documented_formula(dtype):
    torch.manual_seed(0)
    x = torch.randn(5, 33, dtype=dtype)
    x[2] = 0  # the formula's 0 / 0: y 0, scale 0 here (undocumented)
    y, s = fq.npu_dynamic_quant(x)
    q, ref_s = quantize_rows_int8(x)  # scale = rowMax(|x|) / 127, y = round(x / scale)
    assert y.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (5,)
    assert torch.equal(y, q) and torch.equal(s[[0, 1, 3, 4]], ref_s[[0, 1, 3, 4], 0]) and s[2] == 0


def test_fake_dynamic_quant_refuses_what_the_doc_does():
    with pytest.raises(RuntimeError, match="float16 or bfloat16"):
        fq.npu_dynamic_quant(torch.randn(2, 8))
    with pytest.raises(RuntimeError, match="more than 1 dim"):
        fq.npu_dynamic_quant(torch.randn(8, dtype=BF16))
    with pytest.raises(RuntimeError, match="dst_type"):
        fq.npu_dynamic_quant(torch.randn(2, 8, dtype=BF16), dst_type=torch.float16)


def _qmm_args(t=3, k=16, n=8):
    torch.manual_seed(1)
    x1 = torch.randint(-127, 128, (t, k), dtype=torch.int8)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    return x1, w.t(), torch.rand(n) + 0.5, torch.rand(t) + 0.5


@pytest.mark.parametrize("scale_dtype,out", [(torch.float32, BF16), (BF16, BF16), (torch.float32, F16)])
def test_fake_quant_matmul_sums_exactly_then_scales(scale_dtype, out):
    x1, x2, scale, pt = _qmm_args()
    y = fq.npu_quant_matmul(x1, x2, scale.to(scale_dtype), pertoken_scale=pt, output_dtype=out)
    exact = (x1.long() @ x2.long()).double() * scale.to(scale_dtype).double() * pt.double()[:, None]
    assert y.dtype == out
    torch.testing.assert_close(y.double(), exact, rtol=torch.finfo(out).eps, atol=0)


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(out=None), "output_dtype"),  # None is int8: not a pertoken row
        (dict(scale=torch.rand(8).to(BF16), out=F16), "output_dtype"),  # a bfloat16 scale outputs bfloat16 only
        (dict(scale=torch.ones(8, dtype=torch.int64)), "output_dtype"),  # int64 scales take no pertoken_scale
        (dict(scale=torch.rand(8, 1)), "scale must be 1-D"),
        (dict(scale=torch.rand(3)), "scale must be 1-D"),
        (dict(pertoken_scale=torch.rand(3).to(BF16)), "pertoken_scale must be float32"),
        (dict(pertoken_scale=torch.rand(3, 1)), "pertoken_scale must be float32"),
        (dict(offset=torch.zeros(8)), "offset must be None"),
        (dict(x2=torch.zeros(16, 8, dtype=F16)), "must be int8"),
        (dict(x2=torch.zeros(16, 16, dtype=torch.int8)[:, ::2]), "x2 must be a contiguous"),
        (dict(x1=torch.zeros(0, 16, dtype=torch.int8), pertoken_scale=torch.rand(0)), "must not be empty"),
    ],
)
def test_fake_quant_matmul_refuses_what_the_doc_does(change, match):
    x1, x2, scale, pt = _qmm_args()
    args = dict(x1=x1, x2=x2, scale=scale, pertoken_scale=pt, output_dtype=BF16) | change
    args["output_dtype"] = args.pop("out", args["output_dtype"])
    with pytest.raises(RuntimeError, match=match):
        fq.npu_quant_matmul(args.pop("x1"), args.pop("x2"), args.pop("scale"), **args)


def test_fake_quant_matmul_last_dim_limit():
    x1 = torch.zeros(1, 65536, dtype=torch.int8)
    x2 = torch.zeros(2, 65536, dtype=torch.int8).t()
    with pytest.raises(RuntimeError, match="at most 65535"):
        fq.npu_quant_matmul(x1, x2, torch.ones(2), pertoken_scale=torch.ones(1), output_dtype=BF16)


def test_fake_weight_quant_batchmatmul_refuses_what_the_doc_does():
    x, q, s = torch.randn(2, 16, dtype=BF16), torch.zeros(8, 16, dtype=torch.int8), torch.ones(8, dtype=BF16)
    assert fq.npu_weight_quant_batchmatmul(x, q.t(), s).shape == (2, 8)
    for args, match in [
        ((x, q.t(), s.float()), "antiquant_scale dtype"),  # the scale's dtype is x's
        ((x.float(), q.t(), s.float()), "float16 or bfloat16"),
        ((x[:, :8], q.t(), s), "K"),
        ((x[:0], q.t(), s), "empty"),
        ((x, q.t(), torch.ones(3, dtype=BF16)), "per-channel"),
    ]:
        with pytest.raises(RuntimeError, match=match):
            fq.npu_weight_quant_batchmatmul(*args)


def _gmm_kw(g=3, t=6, k=16, n=8, **over):
    torch.manual_seed(2)
    x = torch.randint(-127, 128, (t, k), dtype=torch.int8)
    w = torch.randint(-127, 128, (g, n, k), dtype=torch.int8).transpose(1, 2)
    kw = dict(
        scale=[torch.rand(g, n).to(BF16)], per_token_scale=[torch.rand(t)], group_list=torch.tensor([2, 0, t - 2]),
        split_item=2, group_type=0, group_list_type=1, output_dtype=BF16,
    )  # fmt: skip
    kw.update(over)
    return x, w, kw


def test_fake_gmm_per_token_matches_a_per_group_loop():
    x, w, kw = _gmm_kw()
    (y,) = fq.npu_grouped_matmul([x], [w], **kw)
    (s,), (pt,) = kw["scale"], kw["per_token_scale"]
    g = torch.tensor([0, 0, 2, 2, 2, 2])  # rows 0-1 in group 0, the rest in group 2
    exact = torch.stack([(x[i].long() @ w[g[i]].long()).double() for i in range(6)])
    exact = exact * s.double()[g] * pt.double()[:, None]
    torch.testing.assert_close(y.double(), exact, rtol=torch.finfo(BF16).eps, atol=0)
    assert ("npu_grouped_matmul", "pertoken", 1, 3) in ops.calls


@pytest.mark.parametrize(
    "over,match",
    [
        (dict(scale=[torch.rand(3, 8, 1).to(BF16)]), r"scale must be one tensor of shape \(3, 8\)"),
        (dict(scale=[torch.rand(3, 8)]), "output_dtype"),  # float32 scales output float16 only
        (dict(per_token_scale=[torch.rand(6, 1)]), "per_token_scale must be one 1-D"),
        (dict(group_list=torch.tensor([2, 0, 3])), "sums to 5"),
        (dict(group_list=torch.tensor([2, 0, 4], dtype=torch.int32)), "int64"),
        (dict(offset=[torch.zeros(8)]), "offset only supports None"),
        (dict(split_item=0), "split_item 2 or 3"),
    ],
)
def test_fake_gmm_per_token_refuses_what_the_doc_does(over, match):
    x, w, kw = _gmm_kw(**over)
    with pytest.raises(RuntimeError, match=match):
        fq.npu_grouped_matmul([x], [w], **kw)


def test_fake_gmm_one_group_of_counts_and_the_antiquant_offset():
    x, w, kw = _gmm_kw(g=1, scale=[torch.rand(1, 8).to(BF16)], group_list=torch.tensor([6]))
    with pytest.raises(RuntimeError, match="length cannot be 1"):
        fq.npu_grouped_matmul([x], [w], **kw)
    xf, s = torch.randn(6, 16, dtype=BF16), torch.rand(3, 8, dtype=BF16)
    _, w, _ = _gmm_kw()
    plain = dict(group_list=torch.tensor([2, 0, 4]), split_item=2, group_type=0, group_list_type=1)
    with pytest.raises(RuntimeError, match="antiquant_offset must be one tensor"):  # the kernel refuses a null one
        fq.npu_grouped_matmul([xf], [w], antiquant_scale=[s], **plain)
    with pytest.raises(RuntimeError, match="antiquant_scale must be"):
        fq.npu_grouped_matmul([xf], [w], antiquant_scale=[s.float()], antiquant_offset=[s.float()], **plain)


# ---- NpuBackend on the fakes, against afd.quant.reference ---------------------------------------------------------


@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("spec", [W8A8, W8A16], ids=["w8a8", "w8a16"])
def test_npu_quant_matmul_matches_the_reference(spec, dtype):
    q, scale = _weights()
    x = torch.randn(5, 40, dtype=dtype)
    y = _backend().quant_matmul(x, q, scale, spec)
    _assert_near(y, reference.quant_matmul(x, q, scale, spec), x, q, scale)
    names = [c[0] for c in ops.calls]
    want = ["npu_dynamic_quant", "npu_quant_matmul"] if spec is W8A8 else ["npu_weight_quant_batchmatmul"]
    assert names == want, ops.calls


@pytest.mark.parametrize("sizes", [[2, 0, 3, 1], [0, 4, 0, 0], [1, 1, 1, 0]], ids=["mixed", "one", "rows-past"])
@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("spec", [W8A8, W8A16], ids=["w8a8", "w8a16"])
def test_npu_quant_grouped_matmul_matches_the_reference(spec, dtype, sizes):
    q, scale = _weights(4)
    x = torch.randn(6, 40, dtype=dtype)  # "rows-past": 3 rows in groups, 3 past them (unspecified, not compared)
    sizes = torch.tensor(sizes)
    y = _backend().quant_grouped_matmul(x, q, scale, sizes, spec)
    start = 0
    for g, n in enumerate(sizes.tolist()):
        rows = x[start : start + n]
        _assert_near(y[start : start + n], reference.quant_matmul(rows, q[g], scale[g], spec), rows, q[g], scale[g])
        start += n
    assert [c for c in ops.calls if c[0] == "npu_grouped_matmul"] == [
        ("npu_grouped_matmul", "pertoken" if spec is W8A8 else "antiquant", 1, 4)
    ]


def test_npu_quant_grouped_matmul_one_expert_is_a_dense_gemm():
    q, scale = _weights(1)
    x = torch.randn(3, 40, dtype=BF16)
    y = _backend().quant_grouped_matmul(x, q, scale, torch.tensor([3]), W8A8)
    _assert_near(y, reference.quant_matmul(x, q[0], scale[0], W8A8), x, q[0], scale[0])
    assert [c[0] for c in ops.calls] == ["npu_dynamic_quant", "npu_quant_matmul"]


def test_npu_quant_float32_activations_take_the_reference(caplog):
    q, scale = _weights(2)
    x = torch.randn(3, 40)
    be = _backend()
    with caplog.at_level(logging.INFO, logger="afd.backend"):
        y = be.quant_grouped_matmul(x, q, scale, torch.tensor([1, 2]), W8A8)
        be.quant_grouped_matmul(x, q, scale, torch.tensor([1, 2]), W8A8)
    ref = torch.cat(
        [reference.quant_matmul(x[:1], q[0], scale[0], W8A8), reference.quant_matmul(x[1:], q[1], scale[1], W8A8)]
    )
    assert torch.equal(y, ref) and not ops.calls
    assert sum("reading the group sizes on the host" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("spec", [W8A8, W8A16], ids=["w8a8", "w8a16"])
def test_npu_quant_grouped_matmul_keeps_the_sizes_on_the_device(spec):
    # A host read of the sizes would break the graph (fullgraph) or show as .item()/.tolist() in it.
    q, scale = _weights(3)
    x, sizes = torch.randn(5, 40, dtype=BF16), torch.tensor([2, 0, 2])
    be = _backend()
    torch._dynamo.reset()
    fn = torch.compile(
        lambda a, b, c, d: be.quant_grouped_matmul(a, b, c, d, spec),
        fullgraph=True,
        dynamic=False,
        backend=refuse_host_syncs("eager"),
    )
    assert torch.equal(fn(x, q, scale, sizes), be.quant_grouped_matmul(x, q, scale, sizes, spec))


# ---- check_quantization -------------------------------------------------------------------------------------------


def test_npu_check_quantization_refuses_fp8_and_names_the_setting():
    be = _backend()
    with pytest.raises(QuantConfigError, match="--quantization fp8") as e:
        be.check_quantization(resolve("fp8", None))
    assert "w8a8" in str(e.value) and "w8a16" in str(e.value)
    fp8_ckpt = CheckpointQuant((128, 128))
    with pytest.raises(QuantConfigError, match="--quantization fp8") as e:
        be.check_quantization(resolve(None, fp8_ckpt))  # an FP8 checkpoint serves as fp8 by default
    assert "w8a8" in str(e.value) and "w8a16" not in str(e.value)  # w8a16 would keep its FP8 blocks
    with pytest.raises(QuantConfigError, match="--quantization w8a16 with an FP8 checkpoint") as e:
        be.check_quantization(resolve("w8a16", fp8_ckpt))
    assert "--quantization w8a8" in str(e.value)


def test_npu_check_quantization_logs_the_kernels(caplog):
    be = _backend()
    with caplog.at_level(logging.INFO, logger="afd.backend"):
        be.check_quantization(W8A8)
        be.check_quantization(resolve("w8a8", CheckpointQuant((128, 128))))  # re-quantized per channel: runs
        be.check_quantization(W8A16)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "npu_quant_matmul" in text and "npu_grouped_matmul per-token" in text
    assert "npu_weight_quant_batchmatmul" in text


def test_npu_quant_fp8_weights_never_reach_the_int8_ops():
    # check_quantization refuses them; called anyway, the GEMM is the reference's
    spec = QuantSpec("w8a16", "fp8_block", (128, 128))
    q, scale = torch.randn(8, 16).to(FP8), torch.ones(8, 1)
    x = torch.randn(2, 16, dtype=BF16)
    assert torch.equal(_backend().quant_matmul(x, q, scale, spec), reference.quant_matmul(x, q, scale, spec))
    assert not ops.calls


ON_DEVICE = textwrap.dedent("""
    import sys
    sys.path.insert(0, {fakes!r})
    import torch, torch_npu
    from torch_npu.device import STATS
    from afd.backend import host_syncs
    from afd.backend.npu import NpuBackend
    from afd.quant import reference
    from afd.quant.formats import quantize_int8_channel
    from afd.quant.scheme import resolve

    be = NpuBackend(0)
    torch.manual_seed(0)
    qs = [quantize_int8_channel(w) for w in torch.randn(4, 24, 40)]
    q, scale = torch.stack([a for a, _ in qs]), torch.stack([s for _, s in qs])
    x, sizes = torch.randn(7, 40, dtype=torch.bfloat16), torch.tensor([2, 0, 3, 1])
    dq, ds, dx, dsz = (t.to("npu:0") for t in (q, scale, x, sizes))
    for spec in (resolve("w8a8", None), resolve("w8a16", None)):
        before, counted = STATS["host_syncs"], host_syncs.total()
        y = be.quant_grouped_matmul(dx, dq, ds, dsz, spec)
        dense = be.quant_matmul(dx, dq[0], ds[0], spec)
        assert STATS["host_syncs"] == before and host_syncs.total() == counted, STATS["host_sync_sites"]
        ref = reference.quant_matmul(x[:2], q[0], scale[0], spec)
        assert (y.cpu()[:2].float() - ref.float()).abs().max() <= 0.05 * ref.float().abs().max()
        assert dense.device == dx.device and y.device == dx.device
    print("OK")
""")


def test_npu_quant_gemms_on_the_fake_device_wait_for_nothing():
    """On the fake device (its own process: it renames PrivateUse1), where every device-to-host read and wait
    counts: the quantized GEMMs, dense and grouped, add no host sync."""
    (out,) = run(ON_DEVICE.format(fakes=str(FAKES)), [[]], timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.output
