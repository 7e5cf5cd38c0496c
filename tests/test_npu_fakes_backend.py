"""NpuBackend.grouped_matmul and prefetch run on the fake torch_npu ops (tests/fakes): its results match a
per-expert loop, it splits more groups than one call takes, keeps group sizes on the device, handles
dimensions past the inner limit and no rows, and every prefetch it issues names a dependency and passes the fake's
checks, inside a torchair graph as well.
"""

from __future__ import annotations

import pytest
import torch
from fake_ops_helpers import _close, _fresh, _npu_backend, _per_expert, ops, torchair  # noqa: F401  (_fresh, torchair: fixtures)

# ---- NpuBackend on the fakes ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sizes", [[7], [3, 0, 4], [0, 0, 7, 0], [1, 2, 3, 1]], ids=["one-expert", "empty-middle", "all-in-one", "four"]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_npu_grouped_matmul_on_the_fake_op(sizes, dtype):
    # one-expert failed before the fix: group_list_type=1 with a group list of length 1.
    torch.manual_seed(0)
    sizes = torch.tensor(sizes)
    x, w = torch.randn(7, 16, dtype=dtype), torch.randn(len(sizes), 16, 8, dtype=dtype)
    _close(_npu_backend().grouped_matmul(x, w, sizes), _per_expert(x, w, sizes), dtype)


def test_npu_grouped_matmul_more_groups_than_one_call_takes():
    # Failed before the fix: 1030 groups in one call (the op takes at most 1024).
    torch.manual_seed(0)
    g = 1030
    sizes = torch.randint(0, 3, (g,))
    x, w = torch.randn(int(sizes.sum()), 8), torch.randn(g, 8, 4)
    _close(_npu_backend().grouped_matmul(x, w, sizes), _per_expert(x, w, sizes), torch.float32)
    assert not [c for c in ops.calls if c[0] == "npu_grouped_matmul"]


def test_npu_grouped_matmul_keeps_group_sizes_on_the_device(torchair):  # noqa: F811 (the fixture)
    torch.manual_seed(0)
    sizes = torch.tensor([2, 0, 3])
    x, w = torch.randn(5, 8), torch.randn(3, 8, 4)
    be = _npu_backend()
    config = torchair.CompilerConfig()
    for s, xx, ww in ((sizes, x, w), (torch.tensor([5]), x, w[:1])):
        torch._dynamo.reset()
        fn = torch.compile(
            lambda a, b, c: be.grouped_matmul(a, b, c),
            fullgraph=True,
            dynamic=False,
            backend=torchair.get_npu_backend(compiler_config=config),
        )
        _close(fn(xx, ww, s), _per_expert(xx, ww, s), torch.float32)


def test_npu_grouped_matmul_inner_limit():
    # Failed before the fix: K or N >= 65536 (InnerLimit) went to the op unsplit.
    torch.manual_seed(0)
    sizes = torch.tensor([1, 2])
    be = _npu_backend()
    x, w = torch.randn(3, 65544), torch.randn(2, 65544, 2)
    _close(be.grouped_matmul(x, w, sizes), _per_expert(x, w, sizes), torch.float32)
    x, w = torch.randn(3, 4), torch.randn(2, 4, 65540)
    _close(be.grouped_matmul(x, w, sizes), _per_expert(x, w, sizes), torch.float32)


def test_npu_grouped_matmul_no_rows():
    y = _npu_backend().grouped_matmul(torch.randn(0, 8), torch.randn(3, 8, 4), torch.zeros(3, dtype=torch.int64))
    assert y.shape == (0, 4)


def test_npu_prefetch_always_names_a_dependency():
    seen = []
    be = _npu_backend()
    be._torch_npu.npu_prefetch = lambda inp, dep, n, offset=0: (
        seen.append((inp, dep, n)),
        ops.npu_prefetch(inp, dep, n, offset),
    )
    w, dep = torch.zeros(256), torch.ones(1)
    assert be.prefetch(w, 512, dep) == 512 and be.prefetch(w, 1 << 20) == 1024 and be.prefetch(w[:0], 64) == 0
    assert seen[0][1] is dep and seen[1][1] is w  # none given: the weight itself
    assert [c[1] for c in ops.calls] == [512, 1024]


def test_npu_prefetch_of_routed_experts_passes_the_fake_checks():
    # The FFN node's schedule on Ascend: the router, then each chosen expert's w13 slice and then its w2
    # slice, as (whole stacked weight, max_size, offset) per torch_npu's npu_prefetch(input, dependency,
    # max_size, offset); the last expert's slice ends exactly at the tensor's end.
    from afd.backend.base import PrefetchSpec
    from afd.dataplane.prefetch import PrefetchConfig, PrefetchSchedule
    from afd.model.demo_config import DEMO_CONFIG
    from afd.model.longcat_flash.ffn import FFNHalf
    from afd.model.registry import config_from_hf

    ffn = FFNHalf(config_from_hf(DEMO_CONFIG))
    seen = []
    be = _npu_backend()
    be._torch_npu.npu_prefetch = lambda inp, dep, n, offset=0: (
        seen.append((inp, dep)),
        ops.npu_prefetch(inp, dep, n, offset),
    )
    spec = PrefetchSpec(1.6e12, 192 << 20, "test")
    sched = PrefetchSchedule(ffn, be, PrefetchConfig(True, next_layer=False), spec)
    ex = ffn.layer(0).experts
    last = ex.w13.shape[0] - 1
    assert ex.before_gemm is None  # the chosen ids stay on the device: nothing reads them per layer
    sched.known[0] = [1, last]  # what layer 0 chose last time the host learned it
    sched.observe_gap(0, 1e-3)  # 1.6 MB movable: every slice fits
    sched(0)
    s13, s2 = ex.w13[0].numel() * 4, ex.w2[0].numel() * 4
    router = ffn.layer(0).router.classifier.weight
    assert ops.calls == [
        ("npu_prefetch", router.numel() * 4, 0),
        ("npu_prefetch", s13, s13),
        ("npu_prefetch", s13, last * s13),
        ("npu_prefetch", s2, s2),
        ("npu_prefetch", s2, last * s2),
    ]
    assert [inp for inp, _ in seen[1:]] == [ex.w13, ex.w13, ex.w2, ex.w2] and all(d is not None for _, d in seen)


def test_npu_prefetch_inside_a_torchair_graph(torchair):  # noqa: F811 (the fixture)
    # Failed before the fix: prefetch passed dependency=None, which graph mode refuses.
    be = _npu_backend()
    w = torch.randn(64, 32)

    def step(x):
        be.prefetch(w, 4096)
        return x * 2

    out = be.compile(step)(torch.ones(3))  # NpuBackend.compile: `import torchair` finds the fake
    assert torch.equal(out, torch.full((3,), 2.0))
    assert ops.calls == [("npu_prefetch", 4096, 0)]
