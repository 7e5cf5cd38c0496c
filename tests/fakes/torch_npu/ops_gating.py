"""Fake torch_npu.npu_moe_gating_top_k, for tests only: the real signature, the documented constraints, the
documented numerics in plain torch (fp32, as the kernel computes).

Shapes: T tokens (rows of x), E experts, G groups (group_count), K top-k (k).

What the op does (every release documents the same formulas; the newest document adds an equivalent Python
program, which settles what the formulas leave open):
  norm   = sigmoid(x) (norm_type 1) or softmax(x) over E (norm_type 0), in fp32          [T, E]
  choice = norm + bias (bias optional)                                                    [T, E]
  groups: choice split into G groups of E/G; each scored by its max (group_select_mode 0) or the sum of
  its top 2 (group_select_mode 1); the best k_group groups stay, the others' experts are -inf
  expert_idx = the K best of choice, best first, ties to the lower index (a stable sort)   [T, K] int32
  y = norm[expert_idx] (the unbiased scores: bias steers the choice only), divided by (sum_K y + eps) for
  sigmoid only, times routed_scaling_factor, in x's dtype                                  [T, K]
  out = norm (fp32) when out_flag, else unwritten (NaN here, so a caller that reads it fails)  [T, E]
The formula images alone read as if y were taken from norm + bias and renormalised for softmax too; the
equivalent program and the kernel both take y from norm and renormalise for sigmoid only, so this follows them.

sources (read 2026-12-02):
  doc 7.1.0: torch_npu.npu_moe_gating_top_k, https://github.com/Ascend/op-plugin/blob/7.1.0/docs/context/
    torch_npu-npu_moe_gating_top_k.md (op-plugin 7.1.0, 2025-11): on A2/A3 only E = 256, k in [1, 32], bias
    not None, k_group 4, group_count 8, out_flag False; norm_type only 0 when group_select_mode is 0.
  doc 7.2.0+: the same path @7.2.0 / @7.3.0 and .../blob/26.0.0/docs/zh/custom_APIs/torch_npu/
    torch_npu-npu_moe_gating_top_k.md (op-plugin 26.0.0): the general limits checked below.
  doc master: .../blob/master/docs/zh/custom_APIs/torch_npu/torch_npu-npu_moe_gating_top_k.md @517f2e7
    (2026-08): the "等价计算逻辑" (equivalent computation) program; its schema adds input_ids / tid2eid (hash
    routing), which no release modelled here has.
  schema: op_plugin/config/op_plugin_functions.yaml, the same line in 7.1.0 and 26.0.0 (norm_type=0: the
    7.1.0 doc's prototype says norm_type=1, its parameter text and the yaml say 0).
  source: op_plugin/ops/opapi/MoeGatingTopKKernelNpuOpApi.cpp, 7.1.0 = 26.0.0: the TORCH_CHECKs and their
    wording; output y [T, K] x's dtype, expert_idx [T, K] int32, out [T, E] float32 always allocated.
  meta: op_plugin/python/meta/_meta_registrations.py (npu_moe_gating_top_k_meta), 7.1.0.
  aclnnMoeGatingTopK (the CANN kernel the op calls), moe/moe_gating_top_k/docs/aclnnMoeGatingTopK.md, CANN
    ops-transformer (read at repo-mirror-test/ops-transformer @bfbbec8, 2025-12): the same limits as doc 7.2.0+;
    op_kernel/moe_gating_top_k_generalized.h (SelectTopKExpertScore): y gathered from the unbiased norm,
    renormalised only when normType == 1.
This fake checks doc 7.2.0+'s limits (afd's backend stays inside them); a 7.1.0 install takes DeepSeek-V3's
shape only (docs/architecture/backends.md).
"""

from __future__ import annotations

import torch

SCHEMA = (
    "npu_moe_gating_top_k(Tensor x, int k, *, Tensor? bias=None, int k_group=1, int group_count=1, "
    "int group_select_mode=0, int renorm=0, int norm_type=0, bool out_flag=False, "
    "float routed_scaling_factor=1.0, float eps=1e-20) -> (Tensor, Tensor, Tensor)"
)
MAX_EXPERTS = 2048  # doc 7.2.0+: x's last dim (the experts) at most 2048; also the group rule's bound
ALIGN = 32  # doc 7.2.0+: experts per group, aligned up to 32, times group_count at most 2048
_C10_NAMES = {torch.float64: "Double", torch.int64: "Long", torch.int32: "Int", torch.int8: "Char"}

if not hasattr(torch.ops.fake_npu, "calls"):  # shared with ops.py: whichever loads first makes it
    torch.ops.fake_npu.calls = []
calls: list[tuple] = torch.ops.fake_npu.calls
"""("npu_moe_gating_top_k", norm_type, group_count) per call, in order (see ops.py)."""


def _fail(msg: str) -> None:
    raise RuntimeError(msg)  # TORCH_CHECK raises RuntimeError; an aclnn refusal reaches Python as one too


def _checks(x, k, bias, k_group, group_count, group_select_mode, renorm, norm_type) -> None:
    # source code (7.1.0 = 26.0.0), in its order and words
    if x.dim() != 2:
        _fail("The x should be 2D")
    if x.dtype not in (torch.float16, torch.float32, torch.bfloat16):
        name = _C10_NAMES.get(x.dtype, x.dtype)
        _fail(f"float16、float32 or bfloat16 tensor expected but got a tensor with dtype: {name}")
    E = x.shape[1]
    if bias is not None:
        if bias.dtype != x.dtype:
            _fail("The dtype of x and bias should be same")
        if bias.dim() != 1:
            _fail("The bias should be 1D")
        if bias.shape[0] != E:
            _fail("The bias first dim should be same as x second dim")
    # doc 7.2.0+ and aclnnMoeGatingTopK (no wording published: these are the fake's)
    if E > MAX_EXPERTS:
        _fail(f"npu_moe_gating_top_k: x's last dim (experts) must be at most {MAX_EXPERTS}, got {E}")
    if group_count <= 0 or E % group_count:
        _fail(f"npu_moe_gating_top_k: group_count must be > 0 and divide the {E} experts, got {group_count}")
    per_group = E // group_count
    if per_group <= 2:
        _fail(f"npu_moe_gating_top_k: experts per group (E / group_count) must be > 2, got {per_group}")
    if -(-per_group // ALIGN) * ALIGN * group_count > MAX_EXPERTS:
        _fail(
            f"npu_moe_gating_top_k: experts per group aligned to {ALIGN}, times group_count, must be <= {MAX_EXPERTS}"
        )
    if not 1 <= k_group <= group_count:
        _fail(f"npu_moe_gating_top_k: k_group must be in [1, group_count={group_count}], got {k_group}")
    if not 1 <= k <= per_group * k_group:
        _fail(f"npu_moe_gating_top_k: k must be in [1, E / group_count * k_group = {per_group * k_group}], got {k}")
    if group_select_mode not in (0, 1):
        _fail(f"npu_moe_gating_top_k: group_select_mode must be 0 (max) or 1 (top-2 sum), got {group_select_mode}")
    if renorm != 0:  # doc: "当前仅支持0" (norm, then top-k)
        _fail(f"npu_moe_gating_top_k: renorm supports only 0, got {renorm}")
    if norm_type not in (0, 1):
        _fail(f"npu_moe_gating_top_k: norm_type must be 0 (softmax) or 1 (sigmoid), got {norm_type}")


def _kernel(
    x,
    k,
    *,
    bias=None,
    k_group=1,
    group_count=1,
    group_select_mode=0,
    renorm=0,
    norm_type=0,
    out_flag=False,
    routed_scaling_factor=1.0,
    eps=1e-20,
):
    _checks(x, k, bias, k_group, group_count, group_select_mode, renorm, norm_type)
    T, E = x.shape
    xf = x.float()
    norm = xf.sigmoid() if norm_type == 1 else xf.softmax(dim=-1)  # [T, E] fp32
    choice = norm if bias is None else norm + bias.float()  # [T, E]
    if group_count > 1:
        grouped = choice.view(T, group_count, E // group_count)  # [T, G, E/G]
        if group_select_mode == 1:
            score = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
        else:
            score = grouped.amax(dim=-1)  # [T, G]
        kept = torch.sort(score, dim=-1, descending=True, stable=True)[1][:, :k_group]  # [T, k_group]
        keep = torch.zeros_like(score, dtype=torch.bool).scatter_(1, kept, True)  # [T, G]
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(T, E)
    idx = torch.sort(choice, dim=-1, descending=True, stable=True)[1][:, :k]  # [T, K], ties: lower index
    y = norm.gather(1, idx)  # [T, K]: unbiased
    if norm_type == 1:
        y = y / (y.sum(dim=-1, keepdim=True) + eps)
    y = y * routed_scaling_factor
    out = norm if out_flag else torch.full_like(norm, float("nan"))
    calls.append(("npu_moe_gating_top_k", norm_type, group_count))
    return y.to(x.dtype), idx.to(torch.int32), out


def _meta(
    x,
    k,
    *,
    bias=None,
    k_group=1,
    group_count=1,
    group_select_mode=0,
    renorm=0,
    norm_type=0,
    out_flag=False,
    routed_scaling_factor=1.0,
    eps=1e-20,
):
    _checks(x, k, bias, k_group, group_count, group_select_mode, renorm, norm_type)  # all decided by shapes
    T, E = x.shape
    return x.new_empty((T, k)), x.new_empty((T, k), dtype=torch.int32), x.new_empty((T, E), dtype=torch.float32)


def _registered() -> bool:
    try:
        torch.ops.fake_npu.npu_moe_gating_top_k  # noqa: B018
    except (AttributeError, RuntimeError):
        return False
    return True


# Once per process (this file may load under two module names); the Library stays alive through the kernels.
if not _registered():
    _LIB = torch.library.Library("fake_npu", "FRAGMENT")
    _LIB.define(SCHEMA)
    _LIB.impl("npu_moe_gating_top_k", _kernel, "CompositeExplicitAutograd")
    _LIB.impl("npu_moe_gating_top_k", _meta, "Meta")

# torch_npu binds each torch.ops.npu name as torch_npu.<name> (see ops.py): the op packet itself.
npu_moe_gating_top_k = torch.ops.fake_npu.npu_moe_gating_top_k
