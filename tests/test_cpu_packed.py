"""Weights held in oneDNN's blocked layout where timing says it pays (afd/backend/cpu_packed.py): the same
numbers as the plain layout up to the order of the sums, no plain copy kept, the plain weight readable, and the
layout a choice like any kernel's (timed, forced by AFD_KERNELS, left out where the CPU cannot run it)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from afd.backend import cpu_packed, kernel_choice
from afd.backend.base import grouped_matmul_by_slices
from afd.backend.cpu import CpuBackend
from afd.backend.kernel_choice import FORCE_ENV, KernelChoice

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")

# fp32 sums of 64-512 products in another order: a few ulps of the largest partial sums, relative to the output.
FP32_REL = 1e-5


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.parametrize("rows", [0, 1, 5, 40])
def test_a_packed_linear_computes_the_plain_ones_numbers_and_keeps_no_plain_copy(rows, fresh, monkeypatch):
    monkeypatch.setenv(FORCE_ENV, "linear_layout=packed")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(96, 48), nn.Linear(48, 80, bias=False))
    x = torch.randn(rows, 96)
    with torch.no_grad():
        want = model(x)
        plain = [m.weight.clone() for m in model]
        assert cpu_packed.pack_linears(model) == 2
        got = model(x)
    assert all(type(m) is cpu_packed.PackedLinear for m in model)
    assert [n for n, _ in model.named_parameters()] == ["0.bias"]  # the packed buffer replaces the weight
    assert all(torch.equal(m.weight, w) for m, w in zip(model, plain))  # unpacked exactly
    assert got.shape == want.shape
    if rows:
        assert rel(got, want) < FP32_REL


def test_a_shared_weight_stays_plain(fresh, monkeypatch):
    """A tied lm_head: the embedding gathers the weight's rows, so it cannot move to a blocked layout."""
    monkeypatch.setenv(FORCE_ENV, "linear_layout=packed")
    emb, head = nn.Embedding(64, 32), nn.Linear(32, 64, bias=False)
    head.weight = emb.weight
    assert cpu_packed.pack_linears(nn.ModuleList([emb, head])) == 0 and type(head) is nn.Linear


def test_packed_groups_compute_the_grouped_gemms_numbers(fresh, monkeypatch):
    monkeypatch.setenv(FORCE_ENV, "grouped_layout=packed")
    torch.manual_seed(0)
    holder = nn.Module()
    holder.w13 = nn.Parameter(torch.randn(5, 64, 96), requires_grad=False)  # [G, K, N]
    holder.w2 = nn.Parameter(torch.randn(5, 48, 64), requires_grad=False)
    plain = holder.w13.detach().clone()
    sizes = torch.tensor([3, 0, 1, 7, 2])
    x = torch.randn(15, 64)  # the last 2 rows belong to no group: left as they come
    want = grouped_matmul_by_slices(x, plain, sizes)[:13]
    assert cpu_packed.pack_grouped(holder, ("w13", "w2"))
    assert isinstance(holder.w13, cpu_packed.PackedGroups) and list(holder.parameters()) == []
    assert holder.w13.shape == plain.shape and holder.w13.dtype == torch.float32
    assert all(torch.equal(holder.w13[g], plain[g]) for g in range(5))
    got = CpuBackend().grouped_matmul(x, holder.w13, sizes)[:13]
    assert rel(got, want) < FP32_REL
    assert CpuBackend().prefetch(holder.w13, 1 << 20) == 0  # blocks are not at a plain weight's offsets


def test_the_layout_is_a_timed_choice_left_out_where_the_cpu_cannot_run_it(fresh, monkeypatch):
    w = torch.randn(64, 32)
    assert cpu_packed._linear_packs(w) in (True, False)
    (case,) = fresh.choices()
    choice = fresh.choices()[case]
    assert case.op == "linear_layout" and set(choice.medians_ms) == {"plain", "packed"}
    monkeypatch.setattr(cpu_packed, "unsupported", lambda dtype: "no kernel here")
    monkeypatch.setattr(kernel_choice, "_PROCESS", KernelChoice(path=""))
    monkeypatch.setenv(FORCE_ENV, "linear_layout=packed")  # named, yet not offered: the plain layout
    assert not cpu_packed._linear_packs(w)


def test_fp16_is_never_packed():
    assert cpu_packed.unsupported(torch.float16) and cpu_packed.unsupported(torch.int8)


@pytest.mark.parametrize("layout", ["packed", "plain"])
def test_an_fp32_model_gives_hfs_greedy_tokens_in_either_layout(layout, tiny_checkpoints, fresh, monkeypatch):
    """Both halves loaded with every layout named: the packed one really serves (no nn.Linear left in the
    attention half, the experts held as PackedGroups), and greedy tokens equal HF's, logits close."""
    import afd
    from afd.model.experts import Experts
    from tests.hf_reference import PROMPTS, hf_greedy, max_rel_err

    monkeypatch.setenv(FORCE_ENV, f"linear_layout={layout},grouped_layout={layout}")
    path = tiny_checkpoints["no_zero_experts"]
    llm = afd.LLM(path)
    experts = [m for m in llm.ffn.modules() if isinstance(m, Experts)]
    packed = [isinstance(e.w13, cpu_packed.PackedGroups) for e in experts]
    linears = [m for m in llm.attn.modules() if isinstance(m, nn.Linear) and not hasattr(m, "reads_weight")]
    kinds = {type(m) for m in linears}
    assert kinds == ({cpu_packed.PackedLinear} if layout == "packed" else {nn.Linear}), kinds
    assert all(packed) if layout == "packed" else not any(packed)
    # read by their modules (MLA's absorbed kv_b_proj, every router's classifier): plain in either layout
    kept = [m for m in (*llm.attn.modules(), *llm.ffn.modules()) if hasattr(m, "reads_weight")]
    assert len(kept) >= 2 and all(type(m) is nn.Linear for m in kept)
    logits: list = []
    ours = llm.generate_ids(PROMPTS, 4, logits_out=logits)
    for ids, steps, (ref_ids, ref_logits) in zip(ours, logits, hf_greedy(path, PROMPTS, 4)):
        assert ids == ref_ids
        assert max_rel_err(steps, ref_logits) < 1e-4  # fp32, summed in another order than HF's


def test_a_tp_cut_and_a_graph_take_the_packed_weights_plain(tiny_checkpoints, fresh, monkeypatch):
    """Attention TP slices plain weights, then lays them out again; graph mode traces plain weights: both unpack
    first (afd.model.tp.shard, afd.engine.graph), and serve HF's greedy tokens."""
    import afd
    from afd.backend.cpu import CpuBackend
    from tests.hf_reference import PROMPTS, hf_greedy

    monkeypatch.setenv(FORCE_ENV, "linear_layout=packed,grouped_layout=packed")
    monkeypatch.setattr(CpuBackend, "graph_compiler", "aot_eager")  # the same trace, no C++ compile
    path = tiny_checkpoints["no_zero_experts"]
    ref = [ids for ids, _ in hf_greedy(path, PROMPTS, 5)]
    tp = afd.LLM(path, block_size=4, attention_tp=2, colocated=True)
    assert tp.generate_ids(PROMPTS, 5) == ref
    graph = afd.LLM(path, block_size=16, graph_mode="compile", graph_batch_sizes=(4,))
    assert graph.generate_ids(PROMPTS, 5) == ref  # step 2 compiles (eager), a later one runs the graph
    assert graph.graph_report["steps"]["graph"] >= 1, graph.graph_report
    assert not any(isinstance(m, cpu_packed.PackedLinear) for m in graph.attn.modules())
