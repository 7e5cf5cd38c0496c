"""Ascend conformance without hardware: the fake torch_npu ops (tests/fakes) against the rules their
documents state: npu_grouped_matmul, npu_prefetch and npu_mm_reduce_scatter_base. NpuBackend run on them:
test_npu_fakes_backend.py; the fake torchair: test_npu_fakes_torchair.py. How the fakes load, and the
fixtures these files share: fake_ops_helpers.py (other test files import them from here as well).
"""

from __future__ import annotations

import pytest
import torch
from fake_ops_helpers import (  # noqa: F401  (_fresh, torchair: fixtures; FAKES, _npu_backend: imported from here)
    FAKES,
    _close,
    _fresh,
    _npu_backend,
    _per_expert,
    ops,
    torchair,
)


def _gmm(x, w, gl, **kw):
    args = dict(group_list=gl, split_item=2, group_type=0, group_list_type=1) | kw
    return ops.npu_grouped_matmul([x], [w], **args)


# ---- the fake ops against their documents ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group_list_type", [0, 1])
def test_fake_gmm_matches_a_per_expert_loop(dtype, group_list_type):
    torch.manual_seed(0)
    sizes = torch.tensor([3, 0, 5, 1, 0])
    x, w = torch.randn(9, 16, dtype=dtype), torch.randn(5, 16, 8, dtype=dtype)
    gl = sizes if group_list_type == 1 else sizes.cumsum(0)
    (y,) = _gmm(x, w, gl, group_list_type=group_list_type)
    _close(y, _per_expert(x, w, sizes), dtype)


def test_fake_gmm_list_scenarios():
    torch.manual_seed(0)
    xs = [torch.randn(4, 8, dtype=torch.float16), torch.randn(2, 8, dtype=torch.float16)]
    ws = [torch.randn(8, 5, dtype=torch.float16), torch.randn(8, 5, dtype=torch.float16)]
    per = [(x.double() @ w.double()) for x, w in zip(xs, ws)]
    # group_type -1, split_item 0: one output per weight
    ys = ops.npu_grouped_matmul(xs, ws, group_type=-1)
    assert len(ys) == 2 and all(torch.allclose(y.double(), r, atol=2e-2) for y, r in zip(ys, per))
    # multi-multi-single, and single-multi-single with counts
    (y,) = ops.npu_grouped_matmul(xs, ws, group_type=0, split_item=2)
    assert torch.allclose(y.double(), torch.cat(per), atol=2e-2)
    (y,) = ops.npu_grouped_matmul(
        [torch.cat(xs)], ws, group_type=0, split_item=3, group_list=torch.tensor([4, 2]), group_list_type=1
    )
    assert torch.allclose(y.double(), torch.cat(per), atol=2e-2)


def _case(**change):
    """A valid single-single-single call (4 experts, 6 rows), then `change` applied."""
    base = dict(
        x=torch.randn(6, 8),
        w=torch.randn(4, 8, 4),
        group_list=torch.tensor([1, 2, 0, 3]),
        split_item=2,
        group_type=0,
        group_list_type=1,
    )
    return base | change


GMM_FAILURES = [
    # (what the call changes, what the error says); each is a rule of the op-plugin 7.1.0 document or source
    (dict(group_type=None), "Requires manual passing group_type"),
    (dict(group_type=2), "only support -1 and 0"),
    (dict(split_item=4), "one of 0/1/2/3"),
    (dict(w=torch.randn(1, 8, 4), group_list=torch.tensor([6])), "length cannot be 1"),
    (dict(w=torch.randn(1025, 8, 4), group_list=torch.tensor([6] + [0] * 1024)), "at most 1024 groups"),
    (dict(group_list=torch.tensor([1, 2, 0, 3], dtype=torch.int32)), "must be int64"),
    (dict(group_list=torch.tensor([[1, 2], [0, 3]])), "must be 1-D"),
    (dict(group_list=torch.tensor([1, 2, 3])), "!= number of weights"),
    (dict(group_list=torch.tensor([1, 2, 0, 2])), "sums to 5, x has 6 rows"),
    (dict(group_list=torch.tensor([1, 3, 2, 6]), group_list_type=0), "non-decreasing"),
    (dict(group_list=torch.tensor([1, 3, 3, 5]), group_list_type=0), "last value 5 != x rows 6"),
    (dict(group_list=torch.tensor([1, -2, 4, 3])), "non-negative"),
    (dict(group_list_type=2), "needs int8"),
    (
        dict(x=torch.randn(6, 8, dtype=torch.float64), w=torch.randn(4, 8, 4, dtype=torch.float64)),
        "float16, bfloat16 or float32",
    ),
    (dict(w=torch.randn(4, 8, 4, dtype=torch.float16)), "weight dtype must equal x dtype"),
    (dict(output_dtype=torch.float16), "output_dtype must be None"),
    (dict(act_type=5), "per-token quantization"),
    (dict(act_type=3), "act_type must be one of"),
    (dict(tuning_config=[8]), "quantization scenarios"),
    (dict(offset=[torch.zeros(4)]), "offset only supports None"),
    (dict(x=torch.randn(8, 6).t()), "must not be transposed"),
    (dict(w=torch.randn(4, 7, 4)), "x K 8 != weight K 7"),
    (dict(group_type=-1), "group_type -1 requires split_item 0 or 1"),
    (
        dict(split_item=0, x=torch.randn(6, 8, dtype=torch.float16), w=torch.randn(4, 8, 4, dtype=torch.float16)),
        "requires split_item 2 or 3",
    ),
    (
        dict(x=torch.randn(6, 65536, dtype=torch.float16), w=torch.randn(4, 65536, 1, dtype=torch.float16)),
        "below InnerLimit",
    ),
]


@pytest.mark.parametrize("change,match", GMM_FAILURES, ids=[m for _, m in GMM_FAILURES])
def test_fake_gmm_refuses_what_the_docs_rule_out(change, match):
    c = _case(**change)
    x, w = c.pop("x"), c.pop("w")
    with pytest.raises(RuntimeError, match=match):
        ops.npu_grouped_matmul([x], [w], **c)


def test_fake_gmm_further_refusals():
    x16 = [torch.randn(4, 8, dtype=torch.float16)] * 2
    w16 = [torch.randn(8, 4, dtype=torch.float16)] * 2
    with pytest.raises(RuntimeError, match="float32 is supported only when x, weight and y are single"):
        ops.npu_grouped_matmul([torch.randn(4, 8)] * 2, [torch.randn(8, 4)] * 2, group_type=-1)
    with pytest.raises(RuntimeError, match="bias for torch.bfloat16 x must be torch.float32"):
        ops.npu_grouped_matmul(
            [torch.randn(4, 8, dtype=torch.bfloat16)],
            [torch.randn(8, 4, dtype=torch.bfloat16)],
            bias=[torch.zeros(4, dtype=torch.bfloat16)],
            group_type=-1,
        )
    with pytest.raises(RuntimeError, match="at most 128"):
        ops.npu_grouped_matmul(x16 * 65, w16 * 65, group_type=-1)
    with pytest.raises(RuntimeError, match="takes no group_list"):
        ops.npu_grouped_matmul(x16, w16, group_type=-1, group_list=torch.tensor([4, 4]))
    # out of this fake's scope, refused rather than computed wrongly
    with pytest.raises(NotImplementedError, match="int8"):
        ops.npu_grouped_matmul(
            [torch.ones(4, 8, dtype=torch.int8)],
            [torch.ones(2, 8, 4, dtype=torch.int8)],
            group_list=torch.tensor([2, 2]),
            split_item=2,
            group_type=0,
        )
    with pytest.raises(NotImplementedError, match="scale"):
        ops.npu_grouped_matmul(x16, w16, group_type=-1, scale=[torch.ones(4, dtype=torch.int64)] * 2)
    with pytest.raises(NotImplementedError, match="List"):
        ops.npu_grouped_matmul(x16, w16, group_type=0, split_item=2, group_list=[4, 8])


def test_fake_prefetch_rules():
    w = torch.zeros(256)  # 1024 bytes
    assert ops.npu_prefetch(w, None, 4096) is None  # eager: no dependency needed
    ops.npu_prefetch(w, w, 100, 1000)
    assert ops.calls == [("npu_prefetch", 1024, 0), ("npu_prefetch", 24, 1000)]  # max_size clamped, not refused
    for args, match in (
        ((w, None, 0), "max_size should be greater than zero"),
        ((w, None, 8, -1), "offset should not be smaller than zero"),
        ((w, None, 8, 1024), "offset out of range"),
        ((torch.zeros(0), None, 8), "offset out of range"),
    ):
        with pytest.raises(RuntimeError, match=match):
            ops.npu_prefetch(*args)


def test_graph_mode_refuses_a_prefetch_without_dependency(torchair):  # noqa: F811 (the fixture)
    w = torch.zeros(256)

    def step(x):
        ops.npu_prefetch(w, None, 64)
        return x * 2

    backend = torchair.get_npu_backend(compiler_config=torchair.CompilerConfig())
    with pytest.raises(RuntimeError, match="dependency is None"):
        torch.compile(step, backend=backend, dynamic=False)(torch.ones(2))
    assert torch.equal(step(torch.ones(2)), torch.full((2,), 2.0))  # eager takes None
    # torchair's own converter check, on a graph that reaches the backend without tracing through the meta
    gm = torch.fx.symbolic_trace(lambda x: (torch.ops.fake_npu.npu_prefetch(x, None, 8), x)[1])
    with pytest.raises(NotImplementedError, match="dependency is None"):
        backend(gm, [torch.ones(2)])


# ---- npu_mm_reduce_scatter_base (attention TP; NpuBackend.mm_reduce_scatter: tests/test_npu_mm_reduce_scatter.py) --

RS_FAILURES = [
    # (what the call changes, what the error says): op-plugin 26.0.0's document and TORCH_CHECKs, and the V2 kernel's
    (dict(a=torch.randn(4, 256)), "float16 or bfloat16"),
    (dict(b=torch.randn(256, 8, dtype=torch.bfloat16)), "x2 dtype"),
    (dict(a=torch.randn(4, 128, dtype=torch.float16), b=torch.randn(128, 8, dtype=torch.float16)), r"k must be in"),
    (dict(world_size=3), r"world_size should be in \[2, 4, 8, 16, 32\]"),
    (dict(world_size=16, a=torch.randn(16, 256, dtype=torch.float16)), "'aiv' takes world_size 2, 4 or 8"),
    (dict(a=torch.randn(3, 256, dtype=torch.float16)), "divisible by world_size"),
    (dict(a=torch.randn(4, 256, 1, dtype=torch.float16)), "required to be 2D"),
    (dict(reduce_op="max"), "only 'sum'"),
    (dict(bias=torch.zeros(8, dtype=torch.float16)), "bias is not supported"),
    (dict(comm_turn=1), "comm_turn supports only 0"),
    (dict(a=torch.randn(256, 4, dtype=torch.float16).t()), "must not be transposed"),
    (dict(b=torch.randn(8, 256, dtype=torch.float16)), "K-axis in the two inputs"),  # an (n, k) weight, not .t()
    (dict(b=torch.randn(256, 16, dtype=torch.float16)[:, ::2]), "x2 must be contiguous"),
    (dict(a=torch.randn(0, 256, dtype=torch.float16)), "no empty tensor"),
    (dict(comm_mode=None), "training only"),
    (dict(comm_mode="ai_cpu"), "training only"),
    (dict(comm_mode="ccu"), "comm_mode must be 'ai_cpu' or 'aiv'"),
]


@pytest.mark.parametrize("change,match", RS_FAILURES, ids=[m for _, m in RS_FAILURES])
def test_fake_mm_reduce_scatter_base_rules(change, match):
    c = (
        dict(
            a=torch.randn(4, 256, dtype=torch.float16),
            b=torch.randn(256, 8, dtype=torch.float16),
            world_size=2,
            comm_mode="aiv",
        )
        | change
    )
    a, b, ws = c.pop("a"), c.pop("b"), c.pop("world_size")
    with pytest.raises(RuntimeError, match=match):
        ops.npu_mm_reduce_scatter_base(a, b, "hcom", ws, **c)


def test_fake_mm_reduce_scatter_base_refuses_the_quantized_scenario():
    a, b = torch.randn(4, 256, dtype=torch.float16), torch.randn(256, 8, dtype=torch.float16)
    with pytest.raises(NotImplementedError, match="quantized"):
        ops.npu_mm_reduce_scatter_base(a, b, "hcom", 2, x2_scale=torch.ones(1, 8), comm_mode="aiv")


def test_fake_mm_reduce_scatter_base_numerics():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a default process group exists in this process")
    # The "fake" backend's all_reduce leaves the data as it is: what is checked is the local product and
    # this rank's row block (rank 1 of 2), not the sum over ranks (tests/test_npu_mm_reduce_scatter.py has two).
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        ops.register_hcom("tp", dist.group.WORLD)
        a, b = torch.randn(4, 256, dtype=torch.bfloat16), torch.randn(256, 8, dtype=torch.bfloat16)
        y = ops.npu_mm_reduce_scatter_base(a, b, "tp", 2, comm_mode="aiv")
        torch.testing.assert_close(y.float(), (a.double() @ b.double())[2:].float(), rtol=2e-2, atol=5e-2)
        with pytest.raises(RuntimeError, match="unknown hcom"):
            ops.npu_mm_reduce_scatter_base(a, b, "nope", 2, comm_mode="aiv")
        with pytest.raises(RuntimeError, match="world_size 4 != size"):
            ops.npu_mm_reduce_scatter_base(a, b, "tp", 4, comm_mode="aiv")
    finally:
        dist.destroy_process_group()
