"""CUDA's quantized GEMMs (afd/backend/cuda_quant.py) on CPU: each gate against the constraint it cites, the
fallbacks and refusals, and the CUDA code paths run on CPU where torch can (torch._int_mm runs on CPU; the
block-scaled F.scaled_mm does not, so its call is checked by torch's CUDA meta function under FakeTensorMode
and its numerics by an emulation of the documented scale semantics). The last tests need a GPU."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from afd.backend import cuda_quant as cq
from afd.backend.cuda import CudaBackend
from afd.quant import reference
from afd.quant.formats import expand_block_scale, quantize_fp8_block, quantize_int8_channel, quantize_rows_fp8
from afd.quant.scheme import FP8_BLOCK, INT8_CHANNEL, CheckpointQuant, QuantConfigError, QuantSpec

FP8_SPEC = QuantSpec("fp8", FP8_BLOCK, (128, 128))
W8A8 = QuantSpec("w8a8", INT8_CHANNEL, (128, 128))
W8A16 = QuantSpec("w8a16", FP8_BLOCK, (128, 128))
H100 = cq.CudaQuantEnv((9, 0), False, "12.9", True)


def env(cap=(9, 0), hip=False, cuda="12.9", v2=True):
    return cq.CudaQuantEnv(cap, hip, cuda, v2)


@pytest.mark.parametrize(
    "e,spec,refused",
    [
        (env((8, 0)), FP8_SPEC, True),  # A100: no FP8 (ScaledBlas.cpp: ">= 9.0 or 8.9")
        (env((8, 6)), FP8_SPEC, True),
        (env((7, 5)), FP8_SPEC, True),
        (env(None), FP8_SPEC, True),
        (env((8, 9)), FP8_SPEC, False),  # Ada: FP8, run dequantized (no block recipe) but not refused
        (env((9, 0)), FP8_SPEC, False),
        (env((10, 0)), FP8_SPEC, False),
        (env((12, 0)), FP8_SPEC, False),
        (env((9, 4), hip=True), FP8_SPEC, False),  # ROCm: not gated by CUDA capability
        (env((8, 0)), W8A16, False),  # w8a16 is the way out on Ampere
        (env((8, 0)), W8A8, False),
        (env((9, 0)), QuantSpec("fp8", FP8_BLOCK, (128, 64)), True),  # 1x128 groups only
        (env((9, 0)), QuantSpec("fp8", FP8_BLOCK, (64, 128)), False),  # row blocks: any (per-row scales)
    ],
)
def test_fp8_refusal(e, spec, refused):
    assert (cq.fp8_refusal(e, spec) is not None) is refused


def test_fp8_refusal_names_the_setting_and_suggests_w8a16():
    flag = cq.fp8_refusal(env((8, 0)), FP8_SPEC)
    assert "--quantization fp8" in flag and "w8a16" in flag and "sm_80" in flag and "8.9" in flag
    ckpt = QuantSpec("fp8", FP8_BLOCK, (128, 128), CheckpointQuant((128, 128)))
    assert "FP8 checkpoint" in cq.fp8_refusal(env((8, 6)), ckpt)
    block = cq.fp8_refusal(env(), QuantSpec("fp8", FP8_BLOCK, (128, 64), CheckpointQuant((128, 64))))
    assert "weight_block_size [128, 64]" in block and "w8a16" in block


@pytest.mark.parametrize(
    "e,block,k,n,fast",
    [
        (H100, (128, 128), 256, 256, True),
        (env(cuda="13.0"), (128, 128), 256, 256, True),
        (env(cuda="12.8"), (128, 128), 256, 256, False),  # _check_deepseek_support: cublasLt >= 12.9
        (env(cuda=None), (128, 128), 256, 256, False),
        (env((8, 9)), (128, 128), 256, 256, False),  # "only supported in CUDA for SM90"
        (env((10, 0)), (128, 128), 256, 256, False),
        (env((12, 0)), (128, 128), 256, 256, False),
        (env(hip=True), (128, 128), 256, 256, False),  # "not available with ROCm"
        (env(v2=False), (128, 128), 256, 256, False),  # no F.scaled_mm in this torch
        (H100, (128, 64), 256, 256, False),  # 1x128 groups only
        (H100, (64, 128), 256, 256, True),  # row blocks do not matter with 1x128 weight scales
        (H100, (128, 128), 192, 256, False),  # scales sized by K // 128: whole blocks only
        (H100, (128, 128), 0, 256, False),
        (H100, (128, 128), 256, 24, False),  # mat2 dims % 16 (_scaled_mm_out_cuda)
        (H100, (128, 128), 256, 16, True),
        (H100, (128, 128), 128, 4096, True),
    ],
)
def test_fp8_blockwise_gate(e, block, k, n, fast):
    assert (cq.why_not_fp8_blockwise(e, block, k, n) is None) is fast


@pytest.mark.parametrize(
    "hip,k,n,fast",
    [(False, 64, 48, True), (False, 8, 8, True), (False, 60, 48, False), (False, 64, 36, False)]
    + [(False, 0, 8, False), (True, 64, 48, False)],  # Blas.cpp _int_mm_out_cuda: K, N > 0 and % 8
)
def test_int_mm_gate(hip, k, n, fast):
    assert (cq.why_not_int_mm(env(hip=hip), k, n) is None) is fast


def test_kernel_choice_and_fallbacks():
    assert cq.kernel_for(H100, FP8_SPEC, 256, 256) == ("F.scaled_mm BlockWise1x128 x BlockWise1x128", None)
    name, why = cq.kernel_for(env((8, 9)), FP8_SPEC, 256, 256)
    assert name == "FP8 dequantized + mm" and "sm90" in why
    assert cq.kernel_for(H100, W8A8, 64, 48)[0] == "torch._int_mm (int8 -> int32)"
    name, why = cq.kernel_for(H100, W8A8, 60, 48)
    assert name == "int8 dequantized + mm" and "K = 60" in why
    assert cq.kernel_for(H100, W8A16, 256, 256) == ("dequantized to the model dtype + mm", None)


def _close(got, want, dtype):
    # fp32: the same exact products (8-bit x 8-bit) summed in another order, ~1e-7 relative per add over a few
    # hundred terms; bf16: the same fp32 sum rounded once more, at most one ulp (2^-8 relative) apart
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=8e-3, atol=8e-3)
    torch.testing.assert_close(got.float(), want.float(), **tol)


def _near(got, want, rel):
    """Normwise: max |got - want| <= rel * max |want| (for GEMMs whose inputs are rounded to bf16 first, where
    an output that cancels to near zero keeps the error of its large terms)."""
    err = (got.float() - want.float()).abs().max().item()
    assert err <= rel * want.float().abs().max().item(), (err, want.float().abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [0, 1, 5, 16, 17, 33])
def test_int8_matmul_is_the_reference_on_cpu(monkeypatch, dtype, T):
    """The CUDA w8a8 code path with CPU tensors: torch._int_mm as CUDA would be called (>= 17 rows, mat2
    column-major), numerics those of afd.quant.reference."""
    seen = []
    real = torch._int_mm

    def int_mm(a, b):
        seen.append((a.shape[0], b.stride()))
        return real(a, b)

    monkeypatch.setattr(torch, "_int_mm", int_mm)
    torch.manual_seed(T)
    x, w = torch.randn(T, 64, dtype=dtype), torch.randn(48, 64)
    q, s = quantize_int8_channel(w)
    got = cq.int8_matmul(x, q, s)
    assert got.shape == (T, 48) and got.dtype == dtype
    _close(got, reference.quant_matmul(x, q, s, W8A8), dtype)
    assert seen == [(max(T, 17), (1, 64))]


def _fp8_weight(n, k, block=(128, 128), seed=0):
    g = torch.Generator().manual_seed(seed)
    q, s = quantize_fp8_block(torch.randn(n, k, generator=g), block)
    return q, expand_block_scale(s, n, block[0])


def emulated_scaled_mm(a, b, sa, ra, sb, rb, output_dtype=torch.bfloat16, use_fast_accum=False):
    """F.scaled_mm's BlockWise1x128 x BlockWise1x128 as documented (ScaledBlas.cpp _scaled_block1x128_block1x128:
    As [M, K // 128] strides (1, M), Bs [N, K // 128] strides (1, N); out = sum over K-blocks of the block's
    products times both scales), with the CUDA layout rules asserted."""
    assert ra == rb == F.ScalingType.BlockWise1x128 and not use_fast_accum
    (M, K), N = a.shape, b.shape[1]
    Kb = K // 128
    assert a.stride(1) == 1 and b.stride(0) == 1 and K % 16 == 0 and N % 16 == 0
    assert sa.shape == (M, Kb) and sa.stride(0) == 1 and (sa.stride(1) == M or sa.stride(1) == 1 == Kb)
    assert sb.shape == (N, Kb) and sb.stride(0) == 1 and (sb.stride(1) == N or sb.stride(1) == 1 == Kb)
    blocks = torch.einsum("mkc,nkc->mnk", a.float().view(M, Kb, 128), b.float().t().reshape(N, Kb, 128))
    return (blocks * sa[:, None, :] * sb[None, :, :]).sum(-1).to(output_dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,N,rows_from", [(1, 256, 0), (7, 128, 0), (33, 192, 64), (16, 16, 0)])
def test_fp8_blockwise_matmul_is_the_reference(monkeypatch, dtype, T, N, rows_from):
    """rows_from: a TP shard / gate|up part starting mid-block, which 1x128 weight scales take as they are."""
    monkeypatch.setattr(F, "scaled_mm", emulated_scaled_mm)
    q, s = _fp8_weight(rows_from + N, 384)
    q, s = q[rows_from:], s[rows_from:]
    x = torch.randn(T, 384, generator=torch.Generator().manual_seed(T)).to(dtype)
    _close(cq.fp8_blockwise_matmul(x, q, s), reference.quant_matmul(x, q, s, FP8_SPEC), dtype)


@pytest.mark.parametrize("T,N", [(1, 256), (5, 16), (32, 4096)])
def test_fp8_blockwise_call_passes_torch_cuda_checks(monkeypatch, T, N):
    """The exact F.scaled_mm call, on fake CUDA tensors: torch's meta function for _scaled_mm_v2 applies the
    CUDA layout rules (row-major A, column-major B, dims % 16, the 1x128 scales' shapes and strides)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    # the CPU build cannot copy into a fake CUDA tensor (quantize_rows_fp8 does): its outputs stood in with the
    # layout it gives at K % 128 == 0 (checked on CPU below)
    xq, xs = quantize_rows_fp8(torch.randn(T, 512), 128)
    assert xq.is_contiguous() and xs.shape == (T, 4) and xs.is_contiguous()
    monkeypatch.setattr(
        cq,
        "quantize_rows_fp8",
        lambda x, g: (torch.empty(T, 512, device=x.device, dtype=xq.dtype), torch.empty(T, 4, device=x.device)),
    )
    with FakeTensorMode():
        x = torch.empty(T, 512, device="cuda", dtype=torch.bfloat16)
        q = torch.empty(N, 512, device="cuda", dtype=torch.float8_e4m3fn)
        out = cq.fp8_blockwise_matmul(x, q, torch.empty(N, 4, device="cuda"))
        assert out.shape == (T, N) and out.dtype == torch.bfloat16 and out.device.type == "cuda"
        with pytest.raises(RuntimeError, match="blockwise"):  # the meta check bites: a wrong scale layout
            cq.fp8_blockwise_matmul(x, q, torch.empty(N, 3, device="cuda"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_fallback_is_the_reference(dtype):
    q, s = _fp8_weight(96, 200, (128, 128))  # K not whole blocks: the fallback's case
    x = torch.randn(6, 200, generator=torch.Generator().manual_seed(1)).to(dtype)
    got = cq.fp8_dequant_matmul(x, q, s, 128)
    want = reference.quant_matmul(x, q, s, FP8_SPEC)
    if dtype == torch.float32:
        _close(got, want, dtype)
    else:  # activations and weight each rounded to bf16 (2^-9 relative) before the GEMM; the reference keeps fp32
        _near(got, want, 1e-2)


def test_quant_matmul_dispatches_and_says_the_kernel_once(monkeypatch, caplog):
    used = []
    monkeypatch.setattr(F, "scaled_mm", lambda *a, **k: used.append("scaled_mm") or emulated_scaled_mm(*a, **k))
    monkeypatch.setattr(cq, "_said", set())
    q, s = _fp8_weight(128, 256)
    x = torch.randn(3, 256)
    with caplog.at_level(logging.INFO, logger="afd.backend"):
        for e in (H100, H100, env((8, 9)), env((8, 9))):
            _close(cq.quant_matmul(x, q, s, FP8_SPEC, e), reference.quant_matmul(x, q, s, FP8_SPEC), x.dtype)
    assert used == ["scaled_mm", "scaled_mm"]  # sm89: the dequantized fallback
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "F.scaled_mm BlockWise1x128" in lines[0] and "[256 -> 128]" in lines[0]


def test_check_quantization_refuses_and_logs_the_plan(caplog):
    with pytest.raises(QuantConfigError, match="--quantization fp8.*w8a16"):
        cq.check_quantization(FP8_SPEC, env((8, 0)))
    with caplog.at_level(logging.INFO, logger="afd.backend"):
        cq.check_quantization(FP8_SPEC, H100)
        cq.check_quantization(FP8_SPEC, env((8, 9)))
        cq.check_quantization(W8A8, H100)
    a, b, c = (r.getMessage() for r in caplog.records)
    assert "sm_90" in a and "1x128 x 1x128" in a and "one GEMM per expert" in a
    assert "dequantized" in b and "sm90 only" in b
    assert "torch._int_mm" in c


def test_cuda_backend_delegates(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.version, "hip", None)
    be = object.__new__(CudaBackend)  # no GPU here: skip __init__, keep the real methods
    be._device = torch.device("cpu")
    with pytest.raises(QuantConfigError, match="sm_80"):
        be.check_quantization(FP8_SPEC)
    be.check_quantization(W8A8)
    q, s = quantize_int8_channel(torch.randn(48, 64))
    x = torch.randn(4, 64)
    _close(be.quant_matmul(x, q, s, W8A8), reference.quant_matmul(x, q, s, W8A8), x.dtype)
    sizes = torch.tensor([1, 0, 3])
    qs, ss = torch.stack([q, q, q]), torch.stack([s, s, s])
    _close(be.quant_grouped_matmul(x, qs, ss, sizes, W8A8), reference.quant_matmul(x, q, s, W8A8), x.dtype)


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU: torch.cuda.is_available() is False")


@needs_gpu
@pytest.mark.parametrize("T", [1, 16, 17, 100])
def test_gpu_int8_matmul(T):
    dev = torch.device("cuda")
    q, s = quantize_int8_channel(torch.randn(256, 512, device=dev))
    x = torch.randn(T, 512, device=dev, dtype=torch.bfloat16)
    _close(cq.int8_matmul(x, q, s), reference.quant_matmul(x, q, s, W8A8), torch.bfloat16)


@needs_gpu
@pytest.mark.parametrize("T", [1, 7, 130])
def test_gpu_fp8_matmul(T):
    dev = torch.device("cuda")
    e = cq.CudaQuantEnv.of(dev)
    if cq.fp8_refusal(e, FP8_SPEC) is not None:
        pytest.skip(f"this GPU has no FP8: {cq.fp8_refusal(e, FP8_SPEC)}")
    q, s = _fp8_weight(512, 1024)
    q, s = q.to(dev), s.to(dev)
    x = torch.randn(T, 1024, device=dev, dtype=torch.bfloat16)
    want = reference.quant_matmul(x, q, s, FP8_SPEC)
    # the fallback rounds its inputs to bf16 (see test_fp8_fallback_is_the_reference); cuBLASLt accumulates in
    # fp32 but in its own order and tiles, so the same normwise bound holds for both
    _near(cq.quant_matmul(x, q, s, FP8_SPEC, e), want, 1e-2)
    if cq.why_not_fp8_blockwise(e, (128, 128), 1024, 512) is None:  # the fused kernel itself, on sm90
        _near(cq.fp8_blockwise_matmul(x, q, s), want, 1e-2)
