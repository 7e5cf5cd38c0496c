"""Weights held in oneDNN's blocked layout ("packed"), where timing says that pays: a layout, chosen at load.

A GEMM of a few rows against a plain weight re-lays the weight out on every call (MKL and oneDNN both pack
the right-hand side into blocks before they multiply), which at decode sizes costs as much as the products.
Laid out once, oneDNN's linear reads the blocks directly: 16 routed experts of [512 x 1536] in fp32 at 4 rows
each took 2.4 ms against 6.0 ms on one thread of an AVX-512 EPYC, and 4.4 against 6.1 ms held to AVX2
(docs/benchmarks/quantization.md, "Weights held packed"). The same products, summed in another order: an fp32
layer's output moves by a few ulps, as it does between two BLAS builds.

The packed tensor replaces the plain one (no copy is kept: memory is what the dtype says); what reads the
plain weight afterwards (`weight`, a group of PackedGroups) gets it unpacked, exact. fp32 everywhere torch has
oneDNN; bf16 where oneDNN runs it (AVX-512 BW/VL/DQ or AVX-NE-CONVERT); fp16 and 8-bit weights never.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

from afd.backend.base import group_slices, grouped_matmul_by_slices
from afd.backend.cpu_kernels import ChosenLinear, spread_rows
from afd.backend.cpu_kernels import grouped as chosen_grouped
from afd.backend.cpu_kernels import linear as chosen_linear
from afd.backend.kernel_choice import Case, process_choice, row_class

TIMED_ROWS = 16
"""The rows a dense layer's layout is timed at: a decode batch's (the layout serves every batch size)."""
ROWS_PER_GROUP = 4
"""The rows each expert gets when a grouped layout is timed: batch 16 at top-4 over 16 experts."""


def unsupported(dtype: torch.dtype) -> str | None:
    """Why a weight of `dtype` cannot be packed here, or None."""
    if not torch.backends.mkldnn.is_available():
        return "this torch has no oneDNN"
    if dtype == torch.float32:
        return None
    if dtype == torch.bfloat16:
        return None if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "oneDNN has no bf16 kernel on this CPU"
    return f"oneDNN's linear does not take {dtype}"


def pack(w: torch.Tensor, rows: int = TIMED_ROWS) -> torch.Tensor:
    """w [N, K] (any strides) in oneDNN's blocked layout for about `rows` rows of input."""
    return torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), rows)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ packed [N, K]^T (+ bias)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(nn.Linear):
    """An nn.Linear whose weight is held packed (pack_linears switches a loaded module's class in place)."""

    packed: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed, self.bias)

    @property
    def weight(self) -> torch.Tensor:  # type: ignore[override]
        """The plain weight [out, in], unpacked (a copy: for readers other than forward)."""
        return self.packed.to_dense()


class PackedGroups:
    """A grouped GEMM's weight w [G, K, N] held as G packed [N, K] tensors: what Experts keeps in place of w13 or
    w2. Reads like the plain weight where its readers need it (shape, dtype, one group unpacked)."""

    def __init__(self, w: torch.Tensor, rows: int = ROWS_PER_GROUP):
        self.groups = [pack(w[g].t(), rows) for g in range(w.shape[0])]
        self.shape, self.dtype, self.device = w.shape, w.dtype, w.device

    def __getitem__(self, g: int | slice) -> torch.Tensor:
        """Group g unpacked, [K, N] (a copy); a slice of groups, [g, K, N]."""
        if isinstance(g, slice):
            return torch.stack([p.to_dense().t() for p in self.groups[g]])
        return self.groups[g].to_dense().t()

    def dense(self) -> torch.Tensor:
        """The plain weight [G, K, N], unpacked (a copy)."""
        return self[:]

    def dim(self) -> int:
        return len(self.shape)

    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def numel(self) -> int:
        return self.shape.numel()


def plain(w: torch.Tensor | PackedGroups) -> torch.Tensor:
    """A grouped weight as a plain tensor, whichever layout holds it."""
    return w.dense() if isinstance(w, PackedGroups) else w


def grouped(x: torch.Tensor, w: PackedGroups, group_sizes: torch.Tensor) -> torch.Tensor:
    """grouped_matmul (x [T, K], one GEMM per non-empty group's row slice) against packed groups."""
    out = x.new_empty(x.shape[0], w.shape[-1])
    for g, rows in group_slices(group_sizes):
        out[rows] = packed_linear(x[rows], w.groups[g])
    return out


def _choose(op: str, dtype: torch.dtype, k: int, n: int, rows: int, plain_run, packed_run, inputs) -> bool:
    """Whether the packed layout was timed faster than the plain one for this case (or is forced)."""
    why = unsupported(dtype)
    left_out = {"packed": why} if why else {}
    case = Case(op, str(dtype).removeprefix("torch."), k, n, row_class(rows))
    return process_choice().choose(case, {"plain": plain_run, "packed": packed_run}, inputs, left_out) == "packed"


def _linear_packs(w: torch.Tensor) -> bool:
    n, k = w.shape
    if w.dtype != torch.float32:  # bf16: the plain layout runs its own choice of kernel, made before this one
        chosen_linear(torch.zeros(TIMED_ROWS, k, dtype=w.dtype), w)

    def plain_run(x, w, _):
        return F.linear(x, w) if w.dtype == torch.float32 else chosen_linear(x, w)

    def inputs() -> tuple:
        return torch.randn(TIMED_ROWS, k, dtype=w.dtype), w, pack(w)

    return _choose("linear_layout", w.dtype, k, n, TIMED_ROWS, plain_run, lambda x, _, p: packed_linear(x, p), inputs)


def pack_linears(module: nn.Module) -> int:
    """Every nn.Linear of `module` (plain, or a bf16 ChosenLinear) whose layout was timed faster packed, packed
    in place; returns how many. A weight another module shares (a tied lm_head), or one its module reads itself
    (afd.model.layers.read_directly: a router's classifier, MLA's kv_b_proj), stays plain."""
    uses = Counter(id(p) for _, p in module.named_parameters(remove_duplicate=False))
    done = 0
    for mod in module.modules():
        if type(mod) not in (nn.Linear, ChosenLinear):
            continue
        w = mod.weight
        if getattr(mod, "reads_weight", False) or uses[id(w)] != 1 or w.device.type != "cpu" or not _linear_packs(w):
            continue
        packed = pack(w)
        del mod._parameters["weight"]
        mod.__class__ = PackedLinear
        mod.register_buffer("packed", packed, persistent=False)
        done += 1
    return done


def pack_grouped(holder: nn.Module, names: tuple[str, ...]) -> bool:
    """The grouped GEMM weights `names` of `holder` (Parameters [G, K, N]) packed in place, where each one's
    layout was timed faster packed; returns whether they were."""
    weights = [getattr(holder, name) for name in names]
    if any(w.device.type != "cpu" for w in weights) or not all(_grouped_packs(w) for w in weights):
        return False
    for name, w in zip(names, weights, strict=True):
        del holder._parameters[name]
        setattr(holder, name, PackedGroups(w))
    return True


def _grouped_packs(w: torch.Tensor) -> bool:
    G, k, n = w.shape

    def plain_run(x, w, sizes, _):
        return grouped_matmul_by_slices(x, w, sizes) if w.dtype == torch.float32 else chosen_grouped(x, w, sizes)

    sample = w[: min(G, 4)]  # four experts time as well as all, and pack in a quarter of the time
    sizes = spread_rows(ROWS_PER_GROUP * sample.shape[0], sample.shape[0])
    x = torch.randn(int(sizes.sum()), k, dtype=w.dtype)
    if w.dtype != torch.float32:  # as in _linear_packs
        chosen_grouped(x, sample, sizes)

    def inputs() -> tuple:
        return x, sample, sizes, PackedGroups(sample)

    def packed_run(x, _, sizes, p):
        return grouped(x, p, sizes)

    return _choose("grouped_layout", w.dtype, k, n, ROWS_PER_GROUP * G, plain_run, packed_run, inputs)


def unpack(module: nn.Module) -> int:
    """Every packed weight of `module` back in the plain layout, in place (a graph traces plain weights; a TP
    cut slices them); returns how many. The loader's layouts apply again after (afd.model.checkpoint)."""
    done = 0
    for mod in module.modules():
        if type(mod) is PackedLinear:
            packed = mod.packed
            del mod._buffers["packed"]
            mod.__class__ = nn.Linear  # type: ignore[assignment]  # a plain nn.Linear from here on
            mod.weight = nn.Parameter(packed.to_dense(), requires_grad=False)  # type: ignore[misc]
            done += 1
        for name, value in list(vars(mod).items()):
            if isinstance(value, PackedGroups):
                delattr(mod, name)
                mod.register_parameter(name, nn.Parameter(value.dense(), requires_grad=False))
                done += 1
    return done
