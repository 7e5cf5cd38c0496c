"""The Ascend backend's quantized GEMMs (--quantization w8a8 and w8a16), on torch_npu's documented ops.

Shapes: T tokens (rows of x), K in, N out, G groups (experts). Weights come in the checkpoint's orientation
(afd.quant.formats): q [N, K] int8, scale fp32 [N, 1]; stacked q [G, N, K], scale [G, N, 1]. The ops take the
weight as [K, N]: q.t() (q.transpose(1, 2)) is that, a transposed view, which every op below documents as allowed.

w8a8 (int8 weights per channel, int8 activations per token, dynamic):
  dense:   npu_dynamic_quant(x) -> (x8 [T, K] int8, xs [T] fp32); npu_quant_matmul(x8, q.t(), scale [N] fp32,
           pertoken_scale=xs, output_dtype=x.dtype): y = (x8 @ q^T) * scale * xs, int32 sums, fp32 scaling.
  experts: npu_grouped_matmul([x8], [q^T], scale=[s [G, N]], per_token_scale=[xs], group_list=counts,
           group_list_type=1, split_item=2, group_type=0, output_dtype=x.dtype): the op's per-token scenario.
           Its table allows (scale bfloat16 -> bfloat16 out) and (scale float32 -> float16 out) only, so a
           bfloat16 model's expert scales are rounded to bfloat16 (2^-9 relative at most, one factor per output
           channel, under the output's own rounding of 2^-9); float16 models keep them in fp32.
w8a16 (int8 weights per channel, activations in the model dtype):
  dense:   npu_weight_quant_batchmatmul(x, q.t(), antiquant_scale=scale [N] in x's dtype): y = x @ (q * scale).
  experts: npu_grouped_matmul's fake-quantization scenario, antiquant_scale [G, N] and a zero antiquant_offset
           [G, N] (the kernel refuses a null offset), both in x's dtype.
fp8, and w8a16 on an FP8 checkpoint (fp8_block weights): refused. On Atlas A2/A3 these ops take int8 (int4)
weights and int8 or float16/bfloat16 activations only, and aclnnGroupedMatmulV5's constraints say so outright:
"Atlas A2/A3: 不支持FLOAT8_E5M2、FLOAT8_E4M3FN、HIFLOAT8、FLOAT8_E8M0类型" (the FP8 types are listed for the newer
"昇腾910_95 AI处理器" only, whose rules afd does not model: it refuses fp8 on every NPU).

Where the ops' documented limits do not hold (float32 activations: npu_dynamic_quant and the antiquant ops take
float16/bfloat16 only and no per-token row outputs float32; K or N past 65535; more than 1024 experts) the GEMM
takes afd.quant.reference, and the experts go group by group, reading the sizes on the host: said once in the log.

sources: torch_npu.npu_dynamic_quant, npu_quant_matmul, npu_weight_quant_batchmatmul, npu_grouped_matmul,
  https://github.com/Ascend/op-plugin/blob/7.1.0/docs/context/torch_npu-<op>.md (op-plugin 7.1.0) and
  .../blob/26.0.0/docs/en/custom_APIs/torch_npu/torch_npu-<op>.md (26.0.0); aclnnGroupedMatmulV4, CANN
  ops-transformer gmm/grouped_matmul (docs/aclnnGroupedMatmulV4.md, op_host/op_api/aclnn_grouped_matmul.cpp), read
  at repo-mirror-test/ops-transformer @bfbbec8 (with docs/aclnnGroupedMatmulV5.md, the FP8 rule). The fakes in
  tests/fakes/torch_npu/ops_quant_gemm.py and ops_quant_gmm.py hold these rules.
Not done: the weights stay ND; the docs recommend FRACTAL_NZ (npu_format_cast(w, 29)) for speed, which needs a
load-time hook in the Backend interface.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from afd.backend.base import quant_grouped_matmul_by_slices, sizes_covering
from afd.quant import reference
from afd.quant.scheme import INT8_CHANNEL, QuantConfigError, QuantSpec

# source: torch_npu.npu_grouped_matmul, https://github.com/Ascend/op-plugin/blob/7.1.0/docs/context/
#   torch_npu-npu_grouped_matmul.md, op-plugin 7.1.0 (torch_npu 2.6.0); the same limits in 26.0.0.
GMM_MAX_GROUPS = 1024
"""Groups one call takes with a single x and a single 3-D weight."""
GMM_INNER_LIMIT = 65536
"""Atlas A2/A3: x's last dim (K) and the weight's (N) must be below it."""

HALF = (torch.float16, torch.bfloat16)
LAST_DIM_MAX = 65535
"""npu_quant_matmul: x1's and x2's last dims at most 65535; npu_weight_quant_batchmatmul: K and N in [1, 65535]."""

Say = Callable[[str, str], None]
"""NpuBackend._say_once(message, why)."""


def refusal(spec: QuantSpec) -> str | None:
    """Why Atlas A2/A3 cannot run `spec`, naming the setting; None when they can."""
    if spec.method == "fp8":
        # an FP8 checkpoint keeps its FP8 blocks under w8a16 too (afd.quant.scheme.resolve): only w8a8 runs it
        other = "" if spec.checkpoint is not None else " or w8a16 (int8 weights, bf16/fp16 activations)"
        return (
            "--quantization fp8: Atlas A2/A3 have no FP8 matmul (torch_npu's npu_quant_matmul and npu_grouped_matmul "
            "take int8/int4 operands there; aclnnGroupedMatmulV5: no FLOAT8 types on A2/A3); use --quantization "
            f"w8a8 (int8 weights per channel, int8 activations per token){other}"
        )
    if spec.weights != INT8_CHANNEL:
        return (
            f"--quantization {spec.method} with an FP8 checkpoint keeps its FP8 blocks, which no Atlas A2/A3 kernel "
            "takes (npu_weight_quant_batchmatmul and npu_grouped_matmul's weights are int8/int4); use "
            "--quantization w8a8, which re-quantizes them to int8 per channel at load"
        )
    return None


def check(spec: QuantSpec) -> str:
    """Raise QuantConfigError where Atlas A2/A3 cannot run `spec`; else the kernels its GEMMs take (for the log)."""
    why = refusal(spec)
    if why is not None:
        raise QuantConfigError(why)
    if spec.activations == "int8":
        return (
            "dense npu_dynamic_quant + npu_quant_matmul (int8 per token, fp32 weight scales); experts "
            "npu_dynamic_quant + npu_grouped_matmul per-token (weight scales in bfloat16 for a bfloat16 model, fp32 "
            "for float16)"
        )
    return "dense npu_weight_quant_batchmatmul; experts npu_grouped_matmul fake-quantization (antiquant_scale)"


def _why_not(x: torch.Tensor, k: int, n: int) -> str | None:
    """Why the fused ops cannot take activations x with a K x N weight (their documented limits), else None."""
    if x.dtype not in HALF:
        return f"{x.dtype} activations (the quantized ops take float16/bfloat16)"
    if max(k, n) > LAST_DIM_MAX:
        return f"a {n} x {k} weight (K and N at most {LAST_DIM_MAX})"
    return None


def quant_matmul(torch_npu, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, spec: QuantSpec, say: Say):
    """x [T, K] @ (q [N, K], scale [N, 1])^T -> [T, N] in x's dtype."""
    n, k = q.shape
    why = _why_not(x, k, n) if spec.weights == INT8_CHANNEL else f"{spec.weights} weights"
    if why is not None:
        say("a quantized GEMM runs afd.quant.reference on NPU: %s", why)
        return reference.quant_matmul(x, q, scale, spec)
    if x.shape[0] == 0:  # both ops refuse empty tensors
        return x.new_empty(0, n)
    s = scale.reshape(n)
    if spec.activations == "int8":
        x8, xs = torch_npu.npu_dynamic_quant(x)  # int8 [T, K], fp32 [T]
        return torch_npu.npu_quant_matmul(x8, q.t(), s, pertoken_scale=xs, output_dtype=x.dtype)
    return torch_npu.npu_weight_quant_batchmatmul(x, q.t(), s.to(x.dtype))


def quant_grouped_matmul(torch_npu, x, q, scale, group_sizes, spec: QuantSpec, say: Say) -> torch.Tensor:
    """Backend.quant_grouped_matmul: x [T, K] sorted by group, q [G, N, K], scale [G, N, 1], group_sizes [G] int64
    on the device (kept there) -> [T, N]; rows past the groups join the last group (computed, then dropped)."""
    G, n, k = q.shape

    def dense(xx, qq, ss, sp):
        return quant_matmul(torch_npu, xx, qq, ss, sp, say)

    if G == 1:  # group_list_type 1 refuses a group list of length 1: one expert is a dense GEMM
        return dense(x, q[0], scale[0], spec)
    if x.shape[0] == 0:
        return x.new_empty(0, n)
    why = _why_not(x, k, n) if spec.weights == INT8_CHANNEL else f"{spec.weights} weights"
    if why is None and G > GMM_MAX_GROUPS:
        why = f"{G} experts (npu_grouped_matmul takes at most {GMM_MAX_GROUPS} groups)"
    if why is None and max(k, n) >= GMM_INNER_LIMIT:
        why = f"a {n} x {k} expert weight (npu_grouped_matmul's InnerLimit is {GMM_INNER_LIMIT})"
    if why is not None:
        say("quantized experts run one GEMM per expert on NPU, reading the group sizes on the host: %s", why)
        return quant_grouped_matmul_by_slices(x, q, scale, group_sizes, spec, dense)
    counts = sizes_covering(group_sizes.to(torch.int64), x.shape[0])  # [G] on the device, summing to T
    w = q.transpose(1, 2)  # [G, K, N], a transposed view
    s = scale.reshape(G, n)
    common = dict(group_list=counts, split_item=2, group_type=0, group_list_type=1)
    if spec.activations == "int8":
        x8, xs = torch_npu.npu_dynamic_quant(x)
        s = s.to(torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32)
        (y,) = torch_npu.npu_grouped_matmul([x8], [w], scale=[s], per_token_scale=[xs], output_dtype=x.dtype, **common)
        return y
    s = s.to(x.dtype)
    (y,) = torch_npu.npu_grouped_matmul([x], [w], antiquant_scale=[s], antiquant_offset=[torch.zeros_like(s)], **common)
    return y
