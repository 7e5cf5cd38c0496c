"""Fixtures: every family's tiny random checkpoints made with HF transformers, and HF's greedy output on
them (the reference), each made once per session on first use."""

from __future__ import annotations

import os
import sys
import tempfile

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

# One kernel cache per run (afd.backend.kernel_choice), shared by the run's workers and the nodes they start, so
# that they agree on each kernel as a machine's nodes do, and no run reads another's (or the user's) choices.
_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID") or str(os.getpid())
os.environ.setdefault("AFD_KERNEL_CACHE", os.path.join(tempfile.gettempdir(), f"afd-test-kernels-{_RUN}.json"))
# The weights' plain layout, not timed (afd.backend.cpu_packed): at the fixtures' tiny shapes plain times faster on
# the machines seen, but a close race could flip a test's layout from one run to the next. The packed layout's
# tests (tests/test_cpu_packed.py) name it.
os.environ.setdefault("AFD_KERNELS", "linear_layout=plain,grouped_layout=plain")

from hf_families import BF16_WEIGHT_STD, FAMILIES  # noqa: E402
from hf_reference import PROMPTS, TINY_CONFIGS  # noqa: E402

REF_TOKENS = 32
"""Tokens HF generates per prompt for the reference (greedy: a shorter run is its prefix)."""


class FamilyCheckpoints:
    """family -> config name -> a checkpoint directory and HF's greedy (ids, logits) on PROMPTS."""

    def __init__(self, root):
        self.root = root
        self._paths: dict[tuple[str, str], str] = {}
        self._refs: dict[tuple[str, str], list] = {}

    def path(self, family: str, name: str) -> str:
        """Checkpoint `name` of FAMILIES[family].configs, or "bf16" for the bf16 parity one."""
        key = (family, name)
        if key not in self._paths:
            fam = FAMILIES[family]
            kw = dict(fam.bf16, weight_std=BF16_WEIGHT_STD) if name == "bf16" else fam.configs[name]
            self._paths[key] = fam.make(str(self.root / f"{family}-{name}"), **kw)
        return self._paths[key]

    def ref(self, family: str, name: str) -> list:
        """HF's greedy (ids, per-step fp32 logits) per prompt of PROMPTS, REF_TOKENS tokens."""
        key = (family, name)
        if key not in self._refs:
            self._refs[key] = FAMILIES[family].greedy(self.path(family, name), PROMPTS, REF_TOKENS)
        return self._refs[key]

    def ref_ids(self, family: str, name: str, n: int = REF_TOKENS) -> list[list[int]]:
        return [ids[:n] for ids, _ in self.ref(family, name)]


NUMERICS_MODULES = {
    "test_bf16_parity",
    "test_bench_suite",
    "test_checkpoint",
    "test_cpu_weight_layout",
    "test_deepseek_v3",
    "test_engine",
    "test_families",
    "test_fp8_checkpoint",
    "test_graph_mode",
    "test_kv_cache",
    "test_kvp",
    "test_logits",
    "test_model_vs_hf",
    "test_mtp",
    "test_mtp_sampling",
    "test_prefix_cache_engine",
    "test_quant_accuracy",
    "test_quantization",
    "test_qwen3_moe",
}
"""Modules that hold afd's numbers to HF's or to another path of afd's: `make test-avx2` runs them again with
the CPU kernels held to AVX2, the other kernel family a user's CPU may take (MKL and oneDNN pick theirs by CPU,
so a tolerance that holds on one CPU may not on another)."""


SERIAL_MODULES = {"test_metrics_truth"}
"""Modules whose assertions compare time shares (the overlap hides the exchange): they need the cores to
themselves, so `make test` runs them after the parallel workers, alone (a fresh-clone run beside another
test measured the overlapped wait at 12 % of the step, against 10 % allowed). The Makefile's SERIAL_TESTS
names their files, so that the serial run collects them alone (tests/test_make_suite.py holds the two equal)."""


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.module.__name__ in NUMERICS_MODULES:
            item.add_marker(pytest.mark.numerics)
        if item.module.__name__ in SERIAL_MODULES:
            item.add_marker(pytest.mark.serial)


@pytest.fixture(scope="session")
def families(tmp_path_factory) -> FamilyCheckpoints:
    return FamilyCheckpoints(tmp_path_factory.mktemp("families"))


@pytest.fixture(scope="session")
def tiny_checkpoints(families) -> dict[str, str]:
    """LongCat-Flash: name -> checkpoint directory, one per TINY_CONFIGS entry."""
    return {name: families.path("longcat_flash", name) for name in TINY_CONFIGS}


@pytest.fixture(scope="session")
def tiny_checkpoint(families) -> str:
    return families.path("longcat_flash", "zero_experts")


@pytest.fixture(autouse=True)
def _single_thread():
    # Two cores are shared by the test process and any node processes it starts.
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def llm_pool():
    """afd.LLMs shared across a module's tests by configuration (cluster_helpers.LLMPool); their node
    processes stop when the module ends: an idle cluster still exchanges idle steps (a few % of a core
    per node), which a session-long pool spent through the rest of the suite."""
    from cluster_helpers import LLMPool

    pool = LLMPool()
    yield pool
    pool.close()


@pytest.fixture
def fresh(monkeypatch):
    """A kernel choice of this process's own (afd.backend.kernel_choice), with no cache file, no kernel picked
    yet, and nothing named in AFD_KERNELS."""
    from afd.backend import cpu_kernels, kernel_choice

    monkeypatch.setattr(kernel_choice, "_PROCESS", kernel_choice.KernelChoice(path=""))
    monkeypatch.delenv(kernel_choice.FORCE_ENV, raising=False)
    monkeypatch.setattr(cpu_kernels, "_PICKED", {})
    return kernel_choice.process_choice()
