"""Ascend conformance without hardware: the fake torch_npu ops and fake torchair (tests/fakes) against the
rules their documents state, and NpuBackend.grouped_matmul / prefetch run on them.

The fakes load by path: tests/fakes is never put on sys.path, so find_spec("torch_npu") stays None for the
other tests (and tests/fakes/torch_npu/__init__.py, the fake device, is not needed here).
"""

from __future__ import annotations

import importlib.util
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

from afd.backend.npu import NpuBackend

FAKES = Path(__file__).resolve().parent / "fakes"


def _load_ops():
    spec = importlib.util.spec_from_file_location("afd_tests_fake_torch_npu_ops", FAKES / "torch_npu" / "ops.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # torch.compile looks traced functions' modules up by name
    spec.loader.exec_module(mod)
    return mod


ops = _load_ops()


@pytest.fixture(autouse=True)
def _fresh():
    ops.calls.clear()
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _fake_torch_npu() -> types.ModuleType:
    m = types.ModuleType("torch_npu")
    for name in ("npu_grouped_matmul", "npu_prefetch", "npu_mm_reduce_scatter_base"):
        setattr(m, name, getattr(ops, name))
    return m


def _load_torchair():
    spec = importlib.util.spec_from_file_location(
        "torchair", FAKES / "torchair" / "__init__.py", submodule_search_locations=[str(FAKES / "torchair")]
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules["torchair"] = mod  # its submodules import relative to it
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules["torchair"]
        raise
    return mod


@pytest.fixture
def torchair(monkeypatch):
    """The fake torchair as `import torchair` sees it, with the fake torch_npu imported first."""
    monkeypatch.setitem(sys.modules, "torch_npu", _fake_torch_npu())
    before = {k: v for k, v in sys.modules.items() if k == "torchair" or k.startswith("torchair.")}
    yield _load_torchair()
    for k in [k for k in sys.modules if k == "torchair" or k.startswith("torchair.")]:
        del sys.modules[k]
    sys.modules.update(before)


def _npu_backend() -> NpuBackend:
    be = object.__new__(NpuBackend)  # no device here: skip __init__, keep the real methods
    be._torch_npu = _fake_torch_npu()
    return be


def _per_expert(x, w, sizes) -> torch.Tensor:
    """The reference: one float64 matmul per expert over its row slice."""
    out, start = [], 0
    for g, n in enumerate(sizes.tolist()):
        out.append(x[start : start + n].double() @ w[g].double())
        start += n
    return torch.cat(out)


def _close(y, ref, dtype):
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    assert y.dtype == dtype and y.shape == ref.shape
    torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol)


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


def test_graph_mode_refuses_a_prefetch_without_dependency(torchair):
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


def test_npu_grouped_matmul_keeps_group_sizes_on_the_device(torchair):
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


def test_npu_prefetch_inside_a_torchair_graph(torchair):
    # Failed before the fix: prefetch passed dependency=None, which graph mode refuses.
    be = _npu_backend()
    w = torch.randn(64, 32)

    def step(x):
        be.prefetch(w, 4096)
        return x * 2

    out = be.compile(step)(torch.ones(3))  # NpuBackend.compile: `import torchair` finds the fake
    assert torch.equal(out, torch.full((3,), 2.0))
    assert ops.calls == [("npu_prefetch", 4096, 0)]


# ---- the fake torchair ---------------------------------------------------------------------------------


def test_torchair_needs_torch_npu_imported_first(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    with pytest.raises(ImportError, match="import torch_npu before torchair"):
        _load_torchair()


def test_compiler_config_takes_documented_values_only(torchair):
    config = torchair.CompilerConfig()
    config.mode = "reduce-overhead"
    config.experimental_config.frozen_parameter = True
    config.experimental_config.tiling_schedule_optimize = True
    config.debug.graph_dump.type = "pbtxt"
    assert config.mode == "reduce-overhead" and config.experimental_config.frozen_parameter is True
    for target, name, value in (
        (config, "mode", "fast"),
        (config.experimental_config, "frozen_parameter", "yes"),
        (config.experimental_config, "static_model_ops_lower_limit", -2),
        (config.debug.graph_dump, "type", "json"),
        (config, "no_such_option", 1),
        (config, "debug", None),
    ):
        with pytest.raises(ValueError):
            setattr(target, name, value)
    with pytest.warns(UserWarning, match="frozen_parameter"):
        torchair.get_npu_backend(compiler_config=config)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torchair.get_npu_backend(compiler_config=torchair.CompilerConfig())  # defaults: nothing to warn about
    with pytest.raises(TypeError, match="CompilerConfig"):
        torchair.get_npu_backend(compiler_config={"mode": "max-autotune"})
    assert torchair.CompilerConfig() == torchair.CompilerConfig() != config


class _Plain:
    def step(self, x):
        return x


class _Twice(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4), requires_grad=False)

    def step(self, x):
        return x @ self.w


def test_cache_compile_rules_and_layout(torchair, tmp_path):
    m = _Twice()
    config = torchair.CompilerConfig()
    with pytest.raises(ValueError, match="Only method"):
        torchair.inference.cache_compile(lambda x: x, config=config)
    with pytest.raises(ValueError, match="torch.nn.Module method"):
        torchair.inference.cache_compile(_Plain().step)
    other = torchair.CompilerConfig()
    other.experimental_config.frozen_parameter = True
    with pytest.raises(ValueError, match="different from the config"):
        torchair.inference.cache_compile(m.step, config=config, backend=torchair.get_npu_backend(compiler_config=other))
    ref_data = torchair.CompilerConfig()
    ref_data.experimental_config.enable_ref_data = True
    with pytest.raises(ValueError, match="enable_ref_data"):
        torchair.inference.cache_compile(m.step, config=ref_data)
    cached = torchair.inference.cache_compile(m.step, config=config, dynamic=False, cache_dir=str(tmp_path))
    x = torch.randn(2, 4)
    assert torch.equal(cached(x), m.step(x))
    (path,) = tmp_path.glob("_Twice_static_*/step/compiled_module")
    assert cached.cache_bin == str(path.resolve())


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
