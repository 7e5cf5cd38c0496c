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


def test_engine_thread_binds_the_nodes_device():
    """The current device is per thread: a node on device 1 whose engine thread never binds it would
    record events and synchronize on device 0."""
    import threading

    from afd.backend import get_backend

    be = get_backend("cuda", torch.cuda.device_count() - 1)
    seen = []

    def work():
        be.bind_thread()
        seen.append(torch.cuda.current_device())

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert seen == [be.device.index]
