"""CudaBackend.grouped_matmul's gate for torch._grouped_mm, on CPU: the pure rule, and the method with the
torch version, GPU capability and torch._grouped_mm itself stood in for."""

from __future__ import annotations

import pytest
import torch

from afd.backend.cuda import CudaBackend

BF16 = torch.bfloat16


@pytest.mark.parametrize(
    "version,cap,hip,dtype,k,n,fast",
    [
        ("2.8.0+cu128", (9, 0), False, BF16, 64, 32, True),  # Hopper: the fused kernel since 2.8
        ("2.8.0+cu128", (8, 0), False, BF16, 64, 32, False),  # 2.8 raises off sm90
        ("2.8.0+cu128", (10, 0), False, BF16, 64, 32, False),  # 2.8: major == 9 only
        ("2.8.0+cu128", (12, 0), False, BF16, 64, 32, False),  # consumer Blackwell
        ("2.9.0+cu128", (10, 0), False, BF16, 64, 32, True),  # 2.9 on: major 9 or 10
        ("2.9.0a0+git1234", (10, 0), False, BF16, 64, 32, False),  # a 2.9 pre-release counts as 2.8
        ("2.13.0+cu130", (8, 0), False, BF16, 64, 32, False),  # Ampere: host-synced fallback, use slices
        ("2.13.0+cu130", (12, 0), False, BF16, 64, 32, False),
        ("2.7.1+cu126", (9, 0), False, BF16, 64, 32, False),  # no torch._grouped_mm before 2.8
        ("2.4.0", (9, 0), False, BF16, 64, 32, False),
        ("2.13.0+cu130", (9, 0), False, torch.float16, 64, 32, False),  # fused kernel is bf16 only
        ("2.13.0+cu130", (9, 0), False, torch.float32, 64, 32, False),
        ("2.13.0+cu130", (9, 0), False, BF16, 60, 32, False),  # K * 2 bytes not a multiple of 16
        ("2.13.0+cu130", (9, 0), False, BF16, 64, 36, False),  # N likewise
        ("2.13.0+cu130", (9, 0), False, BF16, 8, 8, True),
        ("2.13.0+rocm6.4", (9, 4), True, BF16, 64, 32, False),  # ROCm
        ("2.13.0+cu130", None, False, BF16, 64, 32, False),
    ],
)
def test_grouped_mm_fast_path_rule(version, cap, hip, dtype, k, n, fast):
    assert CudaBackend.grouped_mm_fast_path(version, cap, hip, dtype, k, n) is fast


def _reference(x, w, sizes):
    out, start = [], 0
    for g, m in enumerate(sizes.tolist()):
        out.append(x[start : start + m].float() @ w[g].float())
        start += m
    return torch.cat(out)


@pytest.mark.parametrize(
    "version,cap,fused",
    [
        ("2.8.0+cu128", (8, 0), False),
        ("2.8.0+cu128", (9, 0), True),
        ("2.10.0+cu128", (10, 0), True),
        ("2.10.0+cu128", (12, 0), False),
    ],
)
def test_cuda_grouped_matmul_uses_grouped_mm_only_where_fused(monkeypatch, version, cap, fused):
    # Failed before the gate for ("2.8.0", (8, 0)): bf16 with aligned K and N went to torch._grouped_mm, which
    # torch 2.8 refuses below compute capability 9.0.
    used = []

    def grouped_mm_28(x, w, offs):  # torch 2.8's behaviour, stood in: sm90 only
        if cap[0] != 9 and version.startswith("2.8"):
            raise RuntimeError("torch._grouped_mm is only supported on CUDA devices with compute capability = 9.0")
        used.append(offs)
        starts = torch.cat([offs.new_zeros(1), offs[:-1]])
        return torch.cat([x[s:e] @ w[g] for g, (s, e) in enumerate(zip(starts.tolist(), offs.tolist()))])

    monkeypatch.setattr(torch, "__version__", version)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    monkeypatch.setattr(torch, "_grouped_mm", grouped_mm_28, raising=False)
    be = object.__new__(CudaBackend)  # no GPU here: skip __init__, keep the real method
    torch.manual_seed(0)
    sizes = torch.tensor([3, 0, 5])
    x, w = torch.randn(8, 16, dtype=BF16), torch.randn(3, 16, 8, dtype=BF16)
    y = be.grouped_matmul(x, w, sizes)
    torch.testing.assert_close(y.float(), _reference(x, w, sizes), rtol=2e-2, atol=2e-2)
    assert bool(used) is fused
    if fused:
        assert used[0].dtype == torch.int32 and used[0].tolist() == [3, 3, 8]  # int32 end rows
