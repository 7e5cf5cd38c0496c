"""Routing on the device: the fake torch_npu.npu_moe_gating_top_k (tests/fakes/torch_npu/ops_gating.py) against
its documented program and limits, and NpuBackend.moe_gating_top_k under the DeepSeek-V3, LongCat-Flash and
Qwen3-MoE routers, against the same routers in plain torch.

Shapes: T tokens, E experts, G groups, K top-k.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from dataclasses import replace

import pytest
import torch
from test_npu_fakes import FAKES, _fresh, torchair  # noqa: F401  (_fresh, torchair: fixtures)
from torch._subclasses.fake_tensor import FakeTensorMode

from afd.backend.npu import NpuBackend


def _load():
    path = FAKES / "torch_npu" / "ops_gating.py"
    spec = importlib.util.spec_from_file_location("afd_tests_fake_torch_npu_ops_gating", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


gating = _load()
op = gating.npu_moe_gating_top_k


def _backend() -> NpuBackend:
    be = object.__new__(NpuBackend)  # no device here: skip __init__, keep the real methods
    be._torch_npu = types.SimpleNamespace(npu_moe_gating_top_k=op)
    return be


def _reference(x, k, bias, k_group, group_count, group_select_mode, norm_type, scale, eps=1e-20):
    """The documented program, one row at a time with Python sorts (written apart from the fake's tensor code)."""
    ys, ids = [], []
    for row in x.float():
        norm = row.sigmoid() if norm_type == 1 else row.softmax(dim=0)  # [E]
        choice = (norm + bias.float() if bias is not None else norm).tolist()
        n = len(choice) // group_count
        groups = [sorted(choice[g * n : (g + 1) * n], reverse=True) for g in range(group_count)]
        score = [gr[0] + gr[1] if group_select_mode == 1 else gr[0] for gr in groups]
        kept = sorted(range(group_count), key=lambda g: (-score[g], g))[:k_group]
        pool = [e for e in range(len(choice)) if e // n in kept]
        best = sorted(pool, key=lambda e: (-choice[e], e))[:k]  # ties: the lower index
        y = norm[best]
        if norm_type == 1:
            y = y / (y.sum() + eps)
        ys.append(y * scale)
        ids.append(best)
    return torch.stack(ys), torch.tensor(ids, dtype=torch.int32)


CASES = {
    # name: (E, G, k_group, K, group_select_mode, norm_type, bias, dtype, routed_scaling_factor)
    "deepseek-v3": (256, 8, 4, 8, 1, 1, True, torch.float32, 2.5),
    "longcat-like": (24, 1, 1, 6, 0, 0, True, torch.float32, 6.0),
    "softmax-max-groups": (64, 4, 2, 5, 0, 0, False, torch.bfloat16, 1.0),
    "sigmoid-max-groups": (48, 6, 3, 4, 0, 1, True, torch.float16, 1.0),
    "one-group-sigmoid": (40, 1, 1, 40, 1, 1, False, torch.float32, 1.5),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_fake_gating_is_the_documented_program(case):
    E, G, kg, K, mode, norm_type, with_bias, dtype, scale = case
    torch.manual_seed(0)
    x = torch.randn(33, E).to(dtype)
    bias = (torch.randn(E) * 0.2).to(dtype) if with_bias else None
    y, idx, out = op(
        x, K, bias=bias, k_group=kg, group_count=G, group_select_mode=mode, norm_type=norm_type,
        out_flag=True, routed_scaling_factor=scale,
    )  # fmt: skip
    ref_y, ref_idx = _reference(x, K, bias, kg, G, mode, norm_type, scale)
    assert y.dtype == dtype and idx.dtype == torch.int32 and out.dtype == torch.float32 and out.shape == (33, E)
    assert torch.equal(idx, ref_idx)  # best first (the doc's TopK), ties to the lower index (its stable sort)
    torch.testing.assert_close(y, ref_y.to(dtype))  # one rounding to x's dtype, after fp32 math
    norm = x.float().sigmoid() if norm_type == 1 else x.float().softmax(dim=-1)
    torch.testing.assert_close(out, norm)  # out_flag: the scores without the bias


def test_fake_gating_weights_are_unbiased_and_softmax_not_renormalised():
    # What the formula images leave open, as the documented program and the kernel settle it.
    x, bias = torch.tensor([[0.0, 1.0, 2.0, 3.0]]), torch.tensor([10.0, 0.0, 0.0, 0.0])
    y, idx, out = op(x, 2, bias=bias, norm_type=0, routed_scaling_factor=2.0)
    p = x.softmax(dim=-1)[0]
    assert idx.tolist() == [[0, 3]] and torch.allclose(y, torch.stack([p[0], p[3]]).unsqueeze(0) * 2)
    assert out.isnan().all()  # out_flag False: not written
    y, _, _ = op(x, 2, bias=bias, norm_type=1)
    assert torch.allclose(y.sum(), torch.tensor(1.0))


def _args(**change):
    """A valid DeepSeek-V3 call, then `change` applied."""
    return dict(x=torch.randn(4, 256), k=8, bias=torch.zeros(256), k_group=4, group_count=8,
                group_select_mode=1, norm_type=1) | change  # fmt: skip


REFUSALS = [
    # (what the call changes, what the error says): op-plugin's TORCH_CHECKs, then doc 7.2.0+'s limits
    (dict(x=torch.randn(2, 4, 256)), "The x should be 2D"),
    (dict(x=torch.randn(4, 256, dtype=torch.float64)), "bfloat16 tensor expected but got a tensor with dtype: Double"),
    (dict(bias=torch.zeros(256, dtype=torch.float16)), "The dtype of x and bias should be same"),
    (dict(bias=torch.zeros(1, 256)), "The bias should be 1D"),
    (dict(bias=torch.zeros(128)), "The bias first dim should be same as x second dim"),
    (dict(x=torch.randn(4, 2056), bias=None, group_count=8), "at most 2048, got 2056"),
    (dict(group_count=0), "group_count must be > 0"),
    (dict(group_count=3), "divide the 256 experts"),
    (dict(x=torch.randn(4, 16), bias=None, group_count=8, k_group=4, k=2), "must be > 2, got 2"),
    (dict(x=torch.randn(4, 1320), bias=None, group_count=40, k_group=4), "aligned to 32"),  # 33 -> 64, x 40
    (dict(k_group=0), r"k_group must be in \[1, group_count=8\]"),
    (dict(k_group=9), r"k_group must be in \[1, group_count=8\]"),
    (dict(k=0), "k must be in"),
    (dict(k=129), r"k must be in \[1, E / group_count \* k_group = 128\], got 129"),
    (dict(group_select_mode=2), "group_select_mode must be 0"),
    (dict(renorm=1), "renorm supports only 0"),
    (dict(norm_type=2), "norm_type must be 0"),
]


@pytest.mark.parametrize("change,match", REFUSALS, ids=[m for _, m in REFUSALS])
def test_fake_gating_refuses_what_the_docs_rule_out(change, match):
    a = _args(**change)
    with pytest.raises(RuntimeError, match=match):
        op(a.pop("x"), a.pop("k"), **a)
    with FakeTensorMode(allow_non_fake_inputs=True), pytest.raises(RuntimeError, match=match):  # the meta kernel too
        a = _args(**change)
        op(a.pop("x"), a.pop("k"), **a)


def test_fake_gating_keyword_only_and_meta_shapes():
    with pytest.raises(RuntimeError):  # the schema's `*`: bias and the rest by keyword only
        op(torch.randn(4, 256), 8, torch.zeros(256))
    with FakeTensorMode():
        y, idx, out = op(torch.randn(5, 256, dtype=torch.bfloat16), 8, bias=torch.zeros(256, dtype=torch.bfloat16))
    assert (y.shape, y.dtype, idx.shape, idx.dtype) == ((5, 8), torch.bfloat16, (5, 8), torch.int32)
    assert (out.shape, out.dtype) == ((5, 256), torch.float32)


# ---- the routers through NpuBackend.moe_gating_top_k ------------------------------------------------------


def _deepseek_router(**over):
    from afd.model.deepseek_v3.config import DeepseekV3Config
    from afd.model.deepseek_v3.ffn import Router

    router = Router(replace(DeepseekV3Config(), hidden_size=32, **over))
    with torch.no_grad():
        router.classifier.weight.normal_(0, 0.3)
        router.e_score_correction_bias.normal_(0, 0.2)  # large enough to change the choice
    return router


def _same_routing(fused, plain):
    """ids equal as sets per token (the op returns them best first, torch.topk(sorted=False) in any order), and
    weights equal per expert: the same fp32 formula, summed in another order for the renormalisation."""
    (w, ids), (pw, pids) = fused, plain
    assert ids.dtype == torch.int64 and w.dtype == pw.dtype == torch.float32
    order, porder = ids.argsort(dim=-1), pids.argsort(dim=-1)
    assert torch.equal(ids.gather(1, order), pids.gather(1, porder))
    torch.testing.assert_close(w.gather(1, order), pw.gather(1, porder), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "over", [{}, dict(n_routed_experts=12, n_group=4, topk_group=2, num_experts_per_tok=5)], ids=["v3", "tiny"]
)
def test_deepseek_router_on_the_fake_npu_is_the_cpu_router(over):
    torch.manual_seed(0)
    router, x = _deepseek_router(**over), torch.randn(64, 32)
    _same_routing(router(x, _backend()), router(x))
    assert gating.calls and all(c == ("npu_moe_gating_top_k", 1, router.groups) for c in gating.calls)


def test_deepseek_router_without_norm_topk_prob_stays_plain():
    # The op renormalises sigmoid weights always: a router that does not is not this op.
    torch.manual_seed(0)
    router, x = _deepseek_router(norm_topk_prob=False), torch.randn(8, 32)
    assert torch.equal(router(x, _backend())[1], router(x)[1]) and not gating.calls


def test_longcat_router_on_the_fake_npu_is_the_cpu_router():
    from afd.model.longcat_flash.config import LongcatFlashConfig
    from afd.model.longcat_flash.ffn import Router

    torch.manual_seed(0)
    router = Router(replace(LongcatFlashConfig(), hidden_size=32, n_routed_experts=16, zero_expert_num=8, moe_topk=4))
    with torch.no_grad():
        router.classifier.weight.normal_(0, 0.3)
        router.e_score_correction_bias.normal_(0, 0.05)
    x = torch.randn(64, 32)
    _same_routing(router(x, _backend()), router(x))
    assert gating.calls == [("npu_moe_gating_top_k", 0, 1)]


def test_backend_declines_what_the_op_does_not_compute():
    be, logits, bias = _backend(), torch.randn(4, 64), torch.zeros(64)
    kw = dict(bias=bias, sigmoid=False, renormalise=False, scale=1.0)
    assert be.moe_gating_top_k(logits, 4, **kw) is not None
    assert be.moe_gating_top_k(logits, 4, **(kw | dict(renormalise=True))) is None  # softmax + renorm (Qwen3)
    assert be.moe_gating_top_k(logits, 4, **(kw | dict(bias=bias.half()))) is None  # bias dtype != logits'
    assert be.moe_gating_top_k(torch.randn(4, 4096), 4, **(kw | dict(bias=None))) is None  # E > 2048
    assert be.moe_gating_top_k(logits, 4, **(kw | dict(groups=32, keep_groups=4))) is None  # 2 experts a group
    assert be.moe_gating_top_k(logits[:0], 4, **kw) is None  # no rows: not documented
    assert be.moe_gating_top_k(logits, 4, **(kw | dict(groups=8, keep_groups=9))) is None
    be._torch_npu = types.SimpleNamespace()  # a torch_npu without the op
    assert be.moe_gating_top_k(logits, 4, **kw) is None


def test_deepseek_router_inside_a_torchair_graph(torchair):  # noqa: F811
    torch.manual_seed(0)
    router, x, be = _deepseek_router(), torch.randn(16, 32), _backend()
    fused = be.compile(lambda t: router(t, be))(x)  # NpuBackend.compile: the fake torchair, fullgraph
    _same_routing(fused, router(x))
    assert gating.calls == [("npu_moe_gating_top_k", 1, 8)]
