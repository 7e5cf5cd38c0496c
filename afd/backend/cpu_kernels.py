"""The CPU's GEMMs where more than one kernel computes the same numbers, each case's kernel chosen by timing
(afd.backend.kernel_choice). Storage and compute are separate decisions: the weights stay as the model holds
them (bf16, or int8 with its scales), whichever kernel runs.

- A dense or grouped GEMM in bf16 or fp16: that dtype's own kernel, or the inputs widened to fp32, an fp32 GEMM,
  and the output rounded to the dtype (the same products, summed in fp32 either way; the order of the sums may
  differ). Where the CPU has no native bf16, the fp32 GEMM is faster.
- w8a8 (int8 weights per channel, int8 activations per token): torch._int_mm (int32 sums) where it sums
  exactly, or the int8 values widened to fp32 and an fp32 GEMM (the same integer products, summed in fp32:
  exact while a sum stays below 2^24, as it does for K up to 1040), each rescaled the same way.

FBGEMM's dynamic int8 linear (torch.ao.nn.quantized.dynamic, `reduce_range` on CPUs without VNNI) is no
candidate: it quantizes the activations per tensor, asymmetric, to 7 bits with reduce_range, where w8a8 is
per token, symmetric, 8 bits; other numbers (only the requested ones are allowed).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from afd.backend import cpu_quant
from afd.backend.base import group_slices, grouped_matmul_by_slices
from afd.backend.cpu_quant import int8_grouped_matmul, int8_matmul
from afd.backend.kernel_choice import FORCE_ENV, Case, process_choice, row_class
from afd.quant.formats import quantize_rows_int8

# ---- candidates: each computes the case's numbers ----


def linear_fp32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x.float(), w.float()).to(x.dtype)


def grouped_fp32(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    out = x.new_empty(x.shape[0], w.shape[-1])
    for g, rows in group_slices(group_sizes):
        out[rows] = torch.mm(x[rows].float(), w[g].float())
    return out


def int8_matmul_fp32(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """w8a8 as int8_matmul computes it, the integer products summed by an fp32 GEMM."""
    xq, xs = quantize_rows_int8(x)
    return (F.linear(xq.float(), q.float()) * xs * scale.t()).to(x.dtype)


def int8_grouped_matmul_fp32(x, q, scale, group_sizes) -> torch.Tensor:
    xq, xs = quantize_rows_int8(x)
    xf = xq.float()
    out = x.new_empty(x.shape[0], q.shape[1])
    for g, rows in group_slices(group_sizes):
        out[rows] = (F.linear(xf[rows], q[g].float()) * xs[rows] * scale[g].t()).to(x.dtype)
    return out


LINEAR: dict[str, Callable] = {"native": F.linear, "fp32": linear_fp32}
GROUPED: dict[str, Callable] = {"native": grouped_matmul_by_slices, "fp32": grouped_fp32}
W8A8_LINEAR: dict[str, Callable] = {"int_mm": int8_matmul, "fp32": int8_matmul_fp32}
W8A8_GROUPED: dict[str, Callable] = {"int_mm": int8_grouped_matmul, "fp32": int8_grouped_matmul_fp32}


def _w8a8_left_out() -> dict[str, str]:
    if cpu_quant.int_mm_exact():
        return {}
    return {"int_mm": "torch._int_mm saturates on this CPU (no VNNI): other numbers"}


def spread_rows(rows: int, groups: int) -> torch.Tensor:
    """rows over the groups as evenly as they go: a routed batch's sizes when timing a grouped case."""
    return torch.tensor([rows // groups + (g < rows % groups) for g in range(groups)])


_PICKED: dict[tuple, Callable] = {}
"""The kernel of each call shape met, so that a call costs a dict lookup (a Case and its choice cost ~10 us)."""
_PICKED_UNDER: list[str | None] = [None]
"""FORCE_ENV as it was when _PICKED was filled: a change empties it."""


def _kernel(op: str, table: dict[str, Callable], x: torch.Tensor, k: int, n: int, inputs, left_out=None) -> Callable:
    """The kernel of `table` for x [T, k] times an [n, k] weight: inputs(rows) makes the case's inputs to time."""
    setting = os.environ.get(FORCE_ENV)
    if setting != _PICKED_UNDER[0]:
        _PICKED.clear()
        _PICKED_UNDER[0] = setting
    key = (op, x.dtype, k, n, x.shape[0])
    kernel = _PICKED.get(key)
    if kernel is None:
        case = Case(op, str(x.dtype).removeprefix("torch."), k, n, row_class(x.shape[0]))
        kernel = table[process_choice().choose(case, table, lambda: inputs(case.rows), left_out or {})]
        if not torch.compiler.is_compiling():
            _PICKED[key] = kernel
    return kernel


# ---- the operations the backend calls ----


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, K] @ w [N, K]^T in x's dtype (bf16 or fp16)."""
    k, n = w.shape[1], w.shape[0]
    kernel = _kernel("linear", LINEAR, x, k, n, lambda rows: (torch.randn(rows, k, dtype=x.dtype), w))
    return kernel(x, w)


def grouped(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """grouped_matmul in x's dtype (bf16 or fp16): w [G, K, N]."""
    k, n = w.shape[1], w.shape[2]

    def inputs(rows: int) -> tuple:
        return torch.randn(rows, k, dtype=x.dtype), w, spread_rows(rows, w.shape[0])

    return _kernel("grouped", GROUPED, x, k, n, inputs)(x, w, group_sizes)


def w8a8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [T, K] @ (q [N, K] int8, scale [N, 1])^T, the activations quantized per token."""
    k, n = q.shape[1], q.shape[0]

    def inputs(rows: int) -> tuple:
        return torch.randn(rows, k, dtype=x.dtype), q, scale

    return _kernel("w8a8_linear", W8A8_LINEAR, x, k, n, inputs, _w8a8_left_out())(x, q, scale)


def w8a8_grouped(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """The experts' w8a8 GEMM: q [G, N, K] int8, scale [G, N, 1]."""
    k, n = q.shape[2], q.shape[1]

    def inputs(rows: int) -> tuple:
        return torch.randn(rows, k, dtype=x.dtype), q, scale, spread_rows(rows, q.shape[0])

    return _kernel("w8a8_grouped", W8A8_GROUPED, x, k, n, inputs, _w8a8_left_out())(x, q, scale, group_sizes)


class ChosenLinear(nn.Linear):
    """An nn.Linear in bf16 or fp16 whose GEMM is `linear`'s choice (the same parameters: a loaded module's
    class is switched in place by choose_linears)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x.reshape(-1, self.in_features), self.weight).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def choose_linears(module: nn.Module) -> int:
    """Every nn.Linear of `module` held in bf16 or fp16 to a ChosenLinear, in place; returns how many."""
    done = 0
    for mod in module.modules():
        if type(mod) is nn.Linear and mod.weight.dtype in (torch.bfloat16, torch.float16):
            mod.__class__ = ChosenLinear  # the same parameters and buffers; the forward above
            done += 1
    return done
