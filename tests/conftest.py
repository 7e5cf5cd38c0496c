"""Fixtures: tiny random LongCat-Flash checkpoints made with HF transformers, the reference."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from hf_reference import TINY_CONFIGS, make_hf_checkpoint  # noqa: E402

NUMERICS_MODULES = {
    "test_bf16_parity",
    "test_bench_suite",
    "test_checkpoint",
    "test_cpu_weight_layout",
    "test_deepseek_v3",
    "test_engine",
    "test_families",
    "test_graph_mode",
    "test_kv_cache",
    "test_kvp",
    "test_logits",
    "test_model_vs_hf",
    "test_mtp",
    "test_mtp_sampling",
    "test_qwen3_moe",
}
"""Modules that hold afd's numbers to HF's or to another path of afd's: `make test-avx2` runs them again with
the CPU kernels held to AVX2, the other kernel family a user's CPU may take (MKL and oneDNN pick theirs by CPU,
so a tolerance that holds on one CPU may not on another)."""


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.module.__name__ in NUMERICS_MODULES:
            item.add_marker(pytest.mark.numerics)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, str]:
    """name -> checkpoint directory, one per TINY_CONFIGS entry."""
    root = tmp_path_factory.mktemp("ckpt")
    return {name: make_hf_checkpoint(str(root / name), **kw) for name, kw in TINY_CONFIGS.items()}


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_checkpoints) -> str:
    return tiny_checkpoints["zero_experts"]


@pytest.fixture(autouse=True)
def _single_thread():
    # Two cores are shared by the test process and any node processes it starts.
    torch.set_num_threads(1)
