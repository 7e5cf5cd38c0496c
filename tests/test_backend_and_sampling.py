"""The backend interface on CPU, device backends absent, and the sampler."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch

from afd.backend import DeviceUnavailable, get_backend
from afd.engine.sampling import Sampler, SamplingParams


def test_cpu_grouped_matmul_matches_per_group_reference():
    be = get_backend("cpu")
    sizes = torch.tensor([3, 0, 5, 1])
    x, w = torch.randn(9, 6), torch.randn(4, 6, 5)
    ref = torch.cat([x[0:3] @ w[0], x[3:8] @ w[2], x[8:9] @ w[3]])
    assert torch.allclose(be.grouped_matmul(x, w, sizes), ref)


def test_importing_afd_never_imports_device_sdks():
    code = (
        "import afd, afd.entrypoints.llm, afd.backend, afd.model.checkpoint, sys; "
        "assert 'torch_npu' not in sys.modules and 'torchair' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="torch_npu is installed here")
def test_npu_backend_fails_clearly_without_torch_npu():
    with pytest.raises(DeviceUnavailable, match="torch_npu is not importable"):
        get_backend("npu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_grouped_matmul():
    be = get_backend("cuda")
    sizes = torch.tensor([16, 0, 32], device="cuda")
    x, w = torch.randn(48, 64, device="cuda"), torch.randn(3, 64, 32, device="cuda")
    ref = torch.cat([x[:16] @ w[0], x[16:] @ w[2]])
    assert torch.allclose(be.grouped_matmul(x, w, sizes), ref, atol=1e-3)


def test_unknown_backend():
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        get_backend("tpu")


def test_sampler_greedy_seeded_and_cuts():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.9], [5.0, 0.0, 0.0, 0.0]])
    s = Sampler()
    assert s.sample(logits, [SamplingParams()] * 2, [0, 1]) == [1, 0]
    # top_k=1 and a tiny top_p are greedy whatever the temperature, down to the smallest positive double
    # the API takes (it rounds to 0 in float32: `make fuzz` found every token dropped, and token 0 drawn)
    tiny = [SamplingParams(temperature=2.0, top_p=p) for p in (1e-6, 2.17e-295, 5e-324)]
    for p in (SamplingParams(temperature=2.0, top_k=1), *tiny):
        assert s.sample(logits, [p, p], [2, 3]) == [1, 0], p
    hot = SamplingParams(temperature=5.0, seed=11)
    a = [Sampler().sample(logits[:1], [hot], ["r"])[0] for _ in range(5)]
    assert len(set(a)) == 1  # the same seed gives the same draw
    draws = {Sampler().sample(logits[:1], [SamplingParams(temperature=5.0, seed=i)], ["r"])[0] for i in range(40)}
    assert len(draws) > 1
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 5.894568385841132e-172, 1e-9, 9.9e-6])
def test_a_vanishing_temperature_is_greedy(temperature):
    """make fuzz found 1e-172: logits / temperature overflowed to inf and sampling failed (a 500)."""
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.9]])
    assert Sampler().sample(logits, [SamplingParams(temperature=temperature)], ["r"]) == [1]
