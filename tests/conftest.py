"""Fixtures: tiny random LongCat-Flash checkpoints made with HF transformers, the reference."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from hf_reference import TINY_CONFIGS, make_hf_checkpoint  # noqa: E402


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


@pytest.fixture(scope="session")
def llm_pool():
    """afd.LLMs shared across tests by configuration (cluster_helpers.LLMPool); their node processes
    stop at the end of the session."""
    from cluster_helpers import LLMPool

    pool = LLMPool()
    yield pool
    pool.close()
