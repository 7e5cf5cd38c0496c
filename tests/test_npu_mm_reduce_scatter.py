"""NpuBackend.mm_reduce_scatter (attention TP's fused row-parallel matmul) on the fake torch_npu.

In process: where the documented limits of npu_mm_reduce_scatter_base do not hold, the backend returns None
(TPComm then runs F.linear and reduce_scatter) without calling the op. In two processes on the fake Ascend
device with a fake HCCL group: the fused result equals matmul + reduce_scatter in bf16 and fp16, through the
backend and through TPComm.row_parallel, and the fake op refuses the wrong arguments a caller could pass.
"""

from __future__ import annotations

import importlib.util
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch
from cluster_helpers import free_ports
from rank_processes import run

from afd.backend.npu import NpuBackend

ROOT = Path(__file__).resolve().parent.parent
FAKES = ROOT / "tests" / "fakes"


def _load_ops():
    # By path, as tests/fake_ops_helpers.py does: tests/fakes stays off sys.path in this process.
    spec = importlib.util.spec_from_file_location("afd_tests_fake_torch_npu_ops_mmrs", FAKES / "torch_npu" / "ops.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


ops = _load_ops()


class _Spy:
    """torch_npu.npu_mm_reduce_scatter_base as the backend sees it (an op packet: callable, with .default),
    recording whether it was called."""

    def __init__(self, default):
        self.default = default
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        raise AssertionError("the op was called where the backend should have fallen back")


def _backend(op) -> NpuBackend:
    be = object.__new__(NpuBackend)  # no device here: skip __init__, keep the real methods
    be._torch_npu = types.SimpleNamespace() if op is None else types.SimpleNamespace(npu_mm_reduce_scatter_base=op)
    return be


def _args(m=8, k=256, n=64, dtype=torch.bfloat16, wdtype=None):
    return torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=wdtype or dtype)


FALLBACKS = [
    # (x, weight, world_size): each breaks one documented limit, everything else fits
    ("fp32", *_args(dtype=torch.float32), 2),
    ("weight-dtype", *_args(wdtype=torch.float16), 2),
    ("world-size-16", *_args(m=16), 16),  # A3 takes 16, the "aiv" kernel and vllm-ascend's mmrs_fusion do not
    ("world-size-3", *_args(m=6), 3),
    ("k-below-256", *_args(k=128), 2),
    ("k-65535", *_args(m=2, k=65535, n=2), 2),
    ("m-not-divisible", *_args(m=5), 2),
    ("no-rows", *_args(m=0), 2),
    ("no-columns", *_args(n=0), 2),
    ("x-3d", torch.randn(2, 4, 256, dtype=torch.bfloat16), torch.randn(64, 256, dtype=torch.bfloat16), 2),
    ("k-mismatch", torch.randn(8, 256, dtype=torch.bfloat16), torch.randn(64, 512, dtype=torch.bfloat16), 2),
    (
        "weight-strided",
        torch.randn(8, 256, dtype=torch.bfloat16),
        torch.randn(64, 512, dtype=torch.bfloat16)[:, ::2],
        2,
    ),
]


@pytest.mark.parametrize("case,x,weight,world_size", FALLBACKS, ids=[c[0] for c in FALLBACKS])
def test_outside_the_documented_limits_the_backend_falls_back(case, x, weight, world_size):
    spy = _Spy(ops.npu_mm_reduce_scatter_base.default)
    assert _backend(spy).mm_reduce_scatter(x, weight, object(), world_size) is None
    assert spy.calls == 0


def test_torch_npu_7_1_0_falls_back():
    # op-plugin 7.1.0's op has no comm_mode and is documented for training only: never used for inference.
    old = _Spy(types.SimpleNamespace(_schema=torch._C.parse_schema(ops.MM_REDUCE_SCATTER_SCHEMA_7_1_0)))
    x, w = _args()
    assert _backend(old).mm_reduce_scatter(x, w, object(), 2) is None and old.calls == 0
    assert _backend(None).mm_reduce_scatter(x, w, object(), 2) is None  # a torch_npu without the op


TWO_RANKS = textwrap.dedent("""
    import sys
    sys.path.insert(0, {fakes!r})
    import torch, torch_npu
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch_npu.device import STATS
    from afd.backend.npu import NpuBackend
    from afd.model.tp.comm import TPComm
    from afd.config.tp import TPConfig, plan

    rank, port = int(sys.argv[1]), int(sys.argv[2])
    dist.init_process_group("hccl", init_method=f"tcp://127.0.0.1:{{port}}", rank=rank, world_size=2)
    be = NpuBackend(rank + 1)  # npu:1 and npu:2: no rank on the device a forgotten binding would use
    npu = torch.device("npu")
    group = dist.new_group([0, 1], use_local_synchronization=True)
    TOL = {{torch.bfloat16: 1.6e-2, torch.float16: 2e-3}}

    def inputs(dtype, m, k=256, n=64):
        # Both ranks' operands, from one seed: each rank computes the reference over both.
        g = torch.Generator().manual_seed(7)
        xs = [torch.randn(m, k, generator=g).to(dtype) for _ in range(2)]
        ws = [(torch.randn(n, k, generator=g) / k ** 0.5).to(dtype) for _ in range(2)]
        return xs, ws

    def block(full, rows):
        return full[rank * rows:(rank + 1) * rows]

    def close(y, ref, tol):
        torch.testing.assert_close(y.cpu().double(), ref.double(), rtol=tol, atol=2 * tol)

    def raises(fn, match):
        try:
            fn()
        except RuntimeError as e:
            assert match in str(e), e
            return
        raise AssertionError(f"no error, expected {{match!r}}")

    # the communicator name, the documented way, and the fake's init_comm rule
    hcom = group._get_backend(npu).get_hccl_comm_name(rank)
    assert hcom and be._hcom_name(group) == hcom == group._get_backend(npu).get_hccl_comm_name(rank)
    fresh = dist.new_group([0, 1], use_local_synchronization=True)
    assert fresh._get_backend(npu).get_hccl_comm_name(rank, init_comm=False) == ""
    assert fresh._get_backend(npu).get_hccl_comm_name(rank) not in ("", hcom)
    raises(lambda: group._get_backend(torch.device("cpu")), "No backend type associated with device type cpu")

    used = []  # the communicators the fused op ran on, in order
    for dtype in (torch.bfloat16, torch.float16):
        xs, ws = inputs(dtype, 8)
        y = be.mm_reduce_scatter(xs[rank].to(be.device), ws[rank].to(be.device), group, 2)
        assert y is not None and y.device == be.device and y.dtype == dtype and y.shape == (4, 64), y
        # the exact sum, and what the fallback computes: F.linear in dtype on each rank, then the reduce-scatter
        close(y, block(sum(x.double() @ w.double().T for x, w in zip(xs, ws)), 4), TOL[dtype])
        close(y, block(sum(F.linear(x, w).float() for x, w in zip(xs, ws)).to(dtype), 4), 2 * TOL[dtype])

        # through TPComm: 7 tokens padded to 8, this rank's 4 rows, the bias added after the fused op
        comm = TPComm(TPConfig(size=2, mode="sp"), rank=rank, ranks=[0, 1], backend=be)
        bias = torch.randn(64, generator=torch.Generator().manual_seed(1)).to(dtype)
        with comm.plan(plan(comm.cfg, 7)):
            out = comm.row_parallel(xs[rank][:7].to(be.device), ws[rank].to(be.device), bias.to(be.device))
        padded = [F.pad(x[:7], (0, 0, 0, 1)) for x in xs]
        close(out, block(sum(x.double() @ w.double().T for x, w in zip(padded, ws)), 4) + bias.double(), TOL[dtype])
        assert comm.bytes["reduce_scatter"] == 8 * 64 * 2 // 2, comm.bytes
        used += [hcom, be._hcom_name(comm.group)]
    calls = [c for c in torch.ops.fake_npu.calls if c[0] == "npu_mm_reduce_scatter_base"]
    assert calls == [("npu_mm_reduce_scatter_base", h, 2) for h in used], calls

    # outside the limits on the device too: no fused op, the caller's matmul and reduce_scatter run
    x32, w32 = torch.randn(8, 256, device=be.device), torch.randn(64, 256, device=be.device)
    assert be.mm_reduce_scatter(x32, w32, group, 2) is None

    # what the fake op refuses (before any communication, so the ranks stay in step)
    x, w = xs[rank].to(be.device), ws[rank].to(be.device)
    op = torch_npu.npu_mm_reduce_scatter_base
    raises(lambda: op(x, w, hcom, 2, comm_mode="aiv"), "K-axis in the two inputs")  # weight not transposed
    raises(lambda: op(x, w.t(), "no_such_comm", 2, comm_mode="aiv"), "unknown hcom")
    raises(lambda: op(x, w.t(), hcom, 4, comm_mode="aiv"), "world_size 4 != size 2")
    raises(lambda: op(x, w.t(), hcom, 2), "training only")  # comm_mode left at its default, "ai_cpu"
    raises(lambda: op(x.t().contiguous().t(), w.t(), hcom, 2, comm_mode="aiv"), "must not be transposed")

    assert STATS["hazards"] == [] and STATS["unbound"] == [], STATS
    dist.destroy_process_group()
    print("OK", flush=True)
""")


@pytest.mark.multiprocess
def test_fused_op_equals_matmul_and_reduce_scatter_on_two_fake_ranks():
    code = TWO_RANKS.format(fakes=str(FAKES))
    port = str(free_ports(1)[0])
    for r, ran in enumerate(run(code, [[str(r), port] for r in (0, 1)])):
        assert ran.returncode == 0 and ran.stdout.strip().endswith("OK"), f"rank {r}:\n{ran.output}"
