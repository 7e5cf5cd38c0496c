"""Each GEMM case's kernel is chosen by timing the candidates on this machine
(afd/backend/kernel_choice.py), among those that compute the case's numbers (afd/backend/cpu_kernels.py);
cached per machine, agreed on by the machine's processes, named by AFD_KERNELS, logged and exported."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import pytest
import torch

from afd.backend import cpu_kernels, cpu_quant, kernel_choice
from afd.backend.kernel_choice import FORCE_ENV, Case, KernelChoice, row_class
from afd.quant.formats import quantize_int8_channel

CASE = Case("linear", "bfloat16", 64, 32, 16)


class Clock:
    """A timer the kernels move: each run of a kernel costs its own figure, whatever the machine does."""

    def __init__(self):
        self.now, self.runs = 0.0, []

    def __call__(self) -> float:
        return self.now

    def kernels(self, costs: dict[str, float]) -> dict:
        def run(name: str):
            def kernel(*args):
                self.runs.append(name)
                self.now += costs[name]

            return kernel

        return {name: run(name) for name in costs}


def test_the_fastest_of_the_offered_kernels_is_chosen_in_rotating_rounds():
    clock = Clock()
    choice = KernelChoice(path="", timer=clock)
    kernels = clock.kernels({"native": 3e-3, "fp32": 1e-3, "other": 2e-3})
    assert choice.choose(CASE, kernels, lambda: (), {"other": "computes other numbers"}) == "fp32"
    assert "other" not in clock.runs
    timed = clock.runs[2:]  # after one warm run each
    rounds = [timed[i : i + 2] for i in range(0, len(timed), 2)]
    assert len(rounds) == kernel_choice.ROUNDS and rounds[0] != rounds[1]  # each round in another order
    (made,) = choice.choices().values()
    assert made.medians_ms == pytest.approx({"native": 3.0, "fp32": 1.0}) and made.source == "timed"
    clock.runs.clear()
    assert choice.choose(CASE, kernels, lambda: (), {}) == "fp32" and clock.runs == []  # chosen once


def test_a_choice_is_cached_for_the_machine_and_read_without_timing(tmp_path, monkeypatch):
    path = str(tmp_path / "kernels.json")
    clock = Clock()
    kernels = clock.kernels({"native": 3e-3, "fp32": 1e-3})
    assert KernelChoice(path, timer=clock).choose(CASE, kernels, lambda: (), {}) == "fp32"
    saved = json.loads(Path(path).read_text())
    assert list(saved) == [kernel_choice.machine_key()] and saved[kernel_choice.machine_key()][CASE.label]
    clock.runs.clear()
    again = KernelChoice(path, timer=clock)
    assert again.choose(CASE, kernels, lambda: (), {}) == "fp32" and clock.runs == []
    assert next(iter(again.choices().values())).source == "cached"
    # another machine (here: another thread count) times its own
    monkeypatch.setattr(kernel_choice, "machine_key", lambda: "another machine")
    other = KernelChoice(path, timer=clock)
    assert other.choose(CASE, clock.kernels({"native": 1e-3, "fp32": 3e-3}), lambda: (), {}) == "native"
    assert set(json.loads(Path(path).read_text())) == {*saved, "another machine"}


def test_the_processes_of_a_machine_agree_and_time_a_case_once(tmp_path):
    """Two choosers (as two nodes' processes) meet the same case at once: the file lock lets one time it, and
    the other reads its choice, even where its own timing would have chosen otherwise."""
    path = str(tmp_path / "kernels.json")
    runs: list[str] = []

    def slow(name: str):
        def kernel():
            runs.append(name)
            threading.Event().wait(0.002)

        return kernel

    out: list[str] = []
    threads = [
        threading.Thread(
            target=lambda: out.append(KernelChoice(path).choose(CASE, {"a": slow("a"), "b": slow("b")}, tuple, {}))
        )
        for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(out) == 2 and out[0] == out[1]
    assert len(runs) == 2 * (1 + kernel_choice.ROUNDS)  # one timing (a warm run and ROUNDS runs of each), not two


def test_afd_kernels_names_a_kernel(monkeypatch):
    clock = Clock()
    choice = KernelChoice(path="", timer=clock)
    kernels = clock.kernels({"native": 3e-3, "fp32": 1e-3})
    monkeypatch.setenv(FORCE_ENV, "native")
    assert choice.choose(CASE, kernels, lambda: (), {}) == "native" and clock.runs == []
    monkeypatch.setenv(FORCE_ENV, "w8a8_linear=int_mm,linear=fp32")
    assert choice.choose(CASE, kernels, lambda: (), {}) == "fp32"
    monkeypatch.setenv(FORCE_ENV, "native")  # not offered where it computes other numbers
    assert choice.choose(CASE, kernels, lambda: (), {"native": "why"}) == "fp32"


def test_row_classes():
    assert [row_class(t) for t in (1, 4, 5, 32, 33, 128, 129, 4096)] == [1, 1, 16, 16, 64, 64, 256, 256]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_dense_candidate_computes_the_dtypes_numbers(dtype, fresh, caplog):
    """bf16 or fp16 in and out, the products summed in fp32: the candidates differ only by the order of the
    sums, well within the dtype's own rounding of the output (2^-8 for bf16, 2^-11 for fp16, relative)."""
    torch.manual_seed(0)
    x, w = torch.randn(16, 96).to(dtype), torch.randn(40, 96).to(dtype)
    want = torch.nn.functional.linear(x.double(), w.double())
    eps = torch.finfo(dtype).eps
    for kernel in cpu_kernels.LINEAR.values():
        got = kernel(x, w)
        assert got.dtype == dtype and ((got.double() - want).abs() <= eps * want.abs() + 1e-3).all()
    with caplog.at_level(logging.INFO, logger="afd.backend"):
        layer = torch.nn.Linear(96, 40, bias=False).to(dtype)
        assert cpu_kernels.choose_linears(torch.nn.Sequential(layer)) == 1
        y = layer(x.view(2, 8, 96))
    (case, choice) = next(iter(fresh.choices().items()))
    assert case == Case("linear", str(dtype).removeprefix("torch."), 96, 40, 16)
    assert y.view(16, 40).equal(cpu_kernels.LINEAR[choice.kernel](x, layer.weight))
    assert f"kernel {case.label}: {choice.kernel}" in caplog.text


def test_the_grouped_candidates_agree(fresh):
    torch.manual_seed(0)
    x, w, sizes = torch.randn(9, 24).bfloat16(), torch.randn(3, 24, 16).bfloat16(), torch.tensor([4, 0, 3])
    native, fp32 = (f(x, w, sizes)[:7] for f in cpu_kernels.GROUPED.values())
    assert ((native.float() - fp32.float()).abs() <= 2**-7 * fp32.float().abs() + 1e-2).all()


def test_the_w8a8_candidates_give_the_same_numbers(fresh):
    """int_mm sums the int8 products in int32, the other in fp32: exact both while a sum stays under 2^24,
    as it does for K up to 1040, so that the choice changes no number there."""
    x = torch.randn(16, 1040)
    q = torch.full((8, 1040), 127, dtype=torch.int8)  # the largest sums a row can have
    q[1::2] = -127
    scale = torch.rand(8, 1) + 0.5
    x[:, :] = x.abs().amax(1, keepdim=True)  # every activation quantizes to 127
    a, b = (f(x, q, scale) for f in cpu_kernels.W8A8_LINEAR.values())
    if cpu_quant.int_mm_exact():
        assert a.equal(b)
    q3, s3 = zip(*(quantize_int8_channel(torch.randn(12, 40)) for _ in range(3)))
    x3, sizes = torch.randn(9, 40), torch.tensor([4, 0, 3])
    g = [f(x3, torch.stack(q3), torch.stack(s3), sizes)[:7] for f in cpu_kernels.W8A8_GROUPED.values()]
    if cpu_quant.int_mm_exact():
        assert g[0].equal(g[1])


def test_the_choices_are_exported(fresh):
    from afd.observability.metrics import NodeMetrics

    q, scale = quantize_int8_channel(torch.randn(24, 40))
    cpu_kernels.w8a8_linear(torch.randn(3, 40), q, scale)
    (case, choice) = next(iter(fresh.choices().items()))
    text = NodeMetrics("ffn", "ffn0", "m").render().decode()
    labels = f'kernel="{choice.kernel}",model_name="m",node="ffn0",op="{case.label}",role="ffn"'
    assert f"afd_kernel_info{{{labels}}} 1.0" in text


def test_a_bf16_model_on_cpu_computes_through_the_chosen_kernels(tiny_checkpoints, fresh, monkeypatch):
    """Loaded in bf16 on the CPU with the weights' plain layout (afd.backend.cpu_packed), every plain linear of both
    halves is a ChosenLinear (its weight still bf16), and a step's GEMMs take kernels chosen here, each logged once
    as a case."""
    import afd

    monkeypatch.setenv(FORCE_ENV, "linear_layout=plain,grouped_layout=plain")

    llm = afd.LLM(tiny_checkpoints["no_zero_experts"], dtype="bfloat16")
    chosen = [m for m in llm.attn.modules() if isinstance(m, cpu_kernels.ChosenLinear)]
    assert chosen and all(m.weight.dtype == torch.bfloat16 for m in chosen)
    assert not any(type(m) is torch.nn.Linear for m in llm.attn.modules())
    llm.generate_ids([[3, 4, 5]], 2)
    ops = {case.op for case in fresh.choices()}
    assert {"linear", "grouped"} <= ops


def test_afd_env_prints_the_machine_and_its_cached_choices(tmp_path, monkeypatch, capsys):
    from afd.entrypoints.cli import main

    path = str(tmp_path / "kernels.json")
    monkeypatch.setenv(kernel_choice.CACHE_ENV, path)
    clock = Clock()
    KernelChoice(path, timer=clock).choose(CASE, clock.kernels({"native": 3e-3, "fp32": 1e-3}), tuple, {})
    assert main(["env", "--json"]) == 0
    env = json.loads(capsys.readouterr().out)
    threads = f"{torch.get_num_threads()} thread(s)"
    assert env["machine"] == kernel_choice.machine_prefix() and env["kernel_cache"] == path
    assert env["kernels"][f"{CASE.label} ({threads})"]["kernel"] == "fp32"
    assert main(["env"]) == 0
    assert f"{CASE.label} ({threads}): fp32 (fp32 1.000 ms, native 3.000 ms)" in capsys.readouterr().out


def test_a_candidate_far_behind_at_its_first_run_is_not_run_again():
    """Held to AVX2, bf16's own GEMM took 2.2 s where the fp32 one took 15 ms: timing it ROUNDS times over would
    cost a start seconds per case."""
    clock = Clock()
    choice = KernelChoice(path="", timer=clock)
    slow = kernel_choice.OUT_OF_RACE * 2e-3 * 1.5
    assert choice.choose(CASE, clock.kernels({"native": slow, "fp32": 2e-3}), tuple, {}) == "fp32"
    assert clock.runs.count("native") == 1 and clock.runs.count("fp32") == 1 + kernel_choice.ROUNDS
    (made,) = choice.choices().values()
    assert made.medians_ms == pytest.approx({"native": slow * 1e3, "fp32": 2.0})


def test_a_candidate_that_meets_another_case_while_timed_raises_rather_than_hangs():
    """Timing holds the choice's lock and the cache's file lock: a candidate whose first run needed a choice of
    its own would wait on itself for ever."""
    choice = KernelChoice(path="")
    inner = Case("linear", "float32", 8, 8, 16)

    def nested(*args):
        return choice.choose(inner, {"a": lambda: None, "b": lambda: None}, tuple, {})

    with pytest.raises(RuntimeError, match="met while timing"):
        choice.choose(CASE, {"native": nested, "fp32": lambda: None}, tuple, {})


def test_afd_env_into_a_reader_that_left_ends_without_a_traceback():
    """`afd env | head` used to end in a BrokenPipeError traceback: `true` reads nothing and exits before afd writes."""
    import subprocess
    import sys

    out = subprocess.run(f"{sys.executable} -m afd env | true", shell=True, capture_output=True, text=True)
    assert "Traceback" not in out.stderr and "BrokenPipe" not in out.stderr, out.stderr
