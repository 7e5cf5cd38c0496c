"""Fake torch_npu.npu_format_cast / get_npu_format, for tests only: an NPU tensor's storage format (ND, FRACTAL_NZ, ...)
is a property of its device memory that CPU memory cannot have; the fake records the format asked for on the tensor
it returns, so that an op whose document requires a format (npu_mla_prolog_v3's weights: ops_prolog.py) can refuse
a tensor that was never cast.

source: (beta) torch_npu.npu_format_cast(self, acl_format) -> Tensor, "修改NPU张量的格式" (returns a new tensor),
  and torch_npu.get_npu_format, Ascend Extension for PyTorch 6.0.0 API list,
  https://www.hiascend.com/document/detail/zh/Pytorch/600/apiref/apilist/ptaoplist_000794.html; acl_format is an
  aclFormat number: 2 ACL_FORMAT_ND, 29 ACL_FORMAT_FRACTAL_NZ (same page).

Not modelled: the NZ layout itself (values and shape stay as they were, which is also what the user of a cast
tensor sees), other formats' rules, npu_format_cast_ (in place).
"""

from __future__ import annotations

import torch

ND, FRACTAL_NZ = 2, 29
ATTR = "_fake_npu_format"
"""Where the format is recorded on a tensor (ops_prolog.py reads it; it is loaded on its own in some tests)."""

if not hasattr(torch.ops.fake_npu, "calls"):  # the call log ops.py keeps on the namespace
    torch.ops.fake_npu.calls = []
calls: list[tuple] = torch.ops.fake_npu.calls


def npu_format_cast(input: torch.Tensor, acl_format: int) -> torch.Tensor:
    """A copy of `input` in format `acl_format` (a new tensor, as the real op returns). The argument names are the
    registered schema's, `npu_format_cast(Tensor input, int acl_format, *, ...)` (torch_npu 2.14.0's library; the
    document above calls the first `self`)."""
    if not isinstance(acl_format, int):
        raise TypeError(f"npu_format_cast: acl_format must be an int (an aclFormat), got {type(acl_format).__name__}")
    out = input.clone()
    setattr(out, ATTR, acl_format)
    calls.append(("npu_format_cast", acl_format, tuple(input.shape)))
    return out


def get_npu_format(input: torch.Tensor) -> int:
    """The tensor's recorded format; ND for one never cast (the real default follows the tensor's rank: the doc's
    4-D example reads 0, NCHW; only FRACTAL_NZ is ever checked here)."""
    return getattr(input, ATTR, ND)
