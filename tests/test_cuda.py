"""The CUDA path, where a GPU exists: colocated generation on the GPU equals the CPU reference."""

from __future__ import annotations

import pytest
import torch
from hf_reference import PROMPTS

import afd

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_colocated_generation_on_cuda_equals_cpu(tiny_checkpoint):
    ref = afd.LLM(tiny_checkpoint).generate_ids(PROMPTS, 16)
    assert afd.LLM(tiny_checkpoint, device="cuda").generate_ids(PROMPTS, 16) == ref


def test_cuda_backend_streams_and_events():
    from afd.backend import get_backend

    be = get_backend("cuda")
    x = torch.randn(256, 256, device=be.device)
    ev = be.record_event()
    with be.stream_scope(be.comm_stream()):
        be.wait_event(ev, be.comm_stream())
        y = x @ x
    be.synchronize()
    assert torch.allclose(y, x @ x)
