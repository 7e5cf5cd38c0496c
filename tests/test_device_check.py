"""`make test-device` (tests/device/check.py) on a machine without an accelerator: it reports the
environment, says why every device check skips, exits 0 and writes nothing; on one that has a GPU or NPU
torch cannot use (probes made up), it fails in one line. Its parts that need no device, on made-up
inputs: the report writer, the pytest report reader, teacher forcing and the verdicts."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
DEVICE = ROOT / "tests" / "device"
sys.path.insert(0, str(DEVICE))

import check as device_check  # noqa: E402  (first: it puts tests/ on the path, as `make test-device` does)
import checks_colocated  # noqa: E402
import checks_failure  # noqa: E402
import checks_host_syncs  # noqa: E402
import checks_pytest  # noqa: E402
import device_env  # noqa: E402
from device_common import Target  # noqa: E402
from device_report import SCHEMA, Result, write_report  # noqa: E402


def _accelerator_here() -> bool:
    """torch can use one, or the machine has one (then torch's not using it fails the run: tested below)."""
    return (
        torch.cuda.is_available()
        or importlib.util.find_spec("torch_npu") is not None
        or bool(device_check.visible_accelerators())
    )


@pytest.mark.skipif(_accelerator_here(), reason="an accelerator is here: `make test-device` runs the real checks")
def test_without_an_accelerator_every_device_check_skips_with_the_reason_and_nothing_is_written():
    out = ROOT / "docs" / "bench" / "device"
    before = sorted(out.iterdir()) if out.exists() else []
    # pytest on the device tests is left out: it is a pytest run inside this one, and its verdict is theirs
    r = subprocess.run(
        [sys.executable, str(DEVICE / "check.py"), "--checks", "colocated,gemm,1a1f"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "== environment" in r.stdout and re.search(rf"^ +torch +{re.escape(torch.__version__)}$", r.stdout, re.M)
    why = re.search(r"no accelerator here, so every device check was skipped: (.+)", r.stdout)
    assert why and ("CPU-only build" in why.group(1) or "is_available() is False" in why.group(1)), r.stdout
    rows = [ln for ln in r.stdout.splitlines() if ln.startswith("| ") and not ln.startswith(("| check", "| ---"))]
    assert len(rows) == 4 and all(" | skip | " in ln and "no accelerator: " in ln for ln in rows), rows
    assert "nothing written" in r.stdout
    assert (sorted(out.iterdir()) if out.exists() else []) == before


@pytest.mark.parametrize(
    "smi, paths, seen",
    [
        (
            {"nvidia-smi": "GPU 0: NVIDIA H200 (UUID: GPU-1)\nGPU 1: NVIDIA H200 (UUID: GPU-2)"},
            (),
            {"cuda": "nvidia-smi -L lists 2 GPUs"},
        ),
        ({"nvidia-smi": "No devices were found"}, (), {}),
        ({}, ("/dev/nvidia0",), {"cuda": "/dev/nvidia0 exists"}),
        ({"npu-smi": "+--- npu-smi 24.1.0 ---+"}, (), {"npu": "npu-smi info answers"}),
        ({}, ("/dev/davinci0",), {"npu": "/dev/davinci0 exists"}),
        ({}, (), {}),
    ],
)
def test_visible_accelerators_reads_the_vendor_tools_then_the_device_files(monkeypatch, smi, paths, seen):
    monkeypatch.setattr(device_env, "_command_output", lambda argv: smi.get(argv[0]))
    monkeypatch.setattr(device_env.os.path, "exists", lambda p: p in paths)
    assert device_env.visible_accelerators() == seen


@pytest.fixture
def torch_here(monkeypatch):
    """torch_here(cuda_build, cuda_ok, npu_ok): which torch build this is and what it can use (made up)."""

    def make(cuda_build: str | None, cuda_ok: bool = False, npu_ok: bool = False) -> None:
        monkeypatch.setattr(torch, "__version__", "2.13.0+cpu" if cuda_build is None else "2.13.0")
        monkeypatch.setattr(torch.version, "cuda", cuda_build)
        monkeypatch.setattr(torch.version, "hip", None, raising=False)
        why = "torch.cuda.is_available() is False (torch 2.13.0, CUDA 12.8): no GPU visible, or no driver"
        no_npu = "torch_npu is not installed"
        monkeypatch.setattr(device_env, "_cuda_usable", lambda: (cuda_ok, "" if cuda_ok else why))
        monkeypatch.setattr(device_env, "_npu_usable", lambda: (npu_ok, "" if npu_ok else no_npu))

    return make


def test_an_accelerator_torch_cannot_use_is_named_with_the_fix(torch_here):
    unusable = device_check.unusable_accelerator
    gpu = {"cuda": "nvidia-smi -L lists 2 GPUs"}
    torch_here(None)
    assert unusable(gpu) == (
        "torch 2.13.0+cpu is a CPU-only build and cannot use the GPU this machine has (nvidia-smi -L lists 2 GPUs): "
        "install a CUDA build of torch (see the Makefile's PIP_LOCK_ARGS)"
    )
    assert unusable({}) is None and unusable(gpu, "npu") is None and unusable(gpu, "cuda")
    torch_here("12.8")  # a CUDA build that sees no GPU: the driver, or CUDA_VISIBLE_DEVICES
    assert unusable(gpu) == (
        "torch 2.13.0 cannot use the GPU this machine has (nvidia-smi -L lists 2 GPUs): torch.cuda.is_available() "
        "is False (torch 2.13.0, CUDA 12.8): no GPU visible, or no driver"
    )
    torch_here("12.8", cuda_ok=True)
    assert unusable(gpu) is None
    torch_here(None)
    assert unusable({"npu": "/dev/davinci0 exists"}) == (
        "torch 2.13.0+cpu cannot use the NPU this machine has (/dev/davinci0 exists): torch_npu is not "
        "installed; install the torch_npu release for this torch and source CANN's set_env.sh"
    )
    torch_here(None, npu_ok=True)
    assert unusable({"npu": "npu-smi info answers"}) is None


def test_a_gpu_machine_with_the_cpu_wheel_fails_before_any_check(torch_here, monkeypatch, capsys):
    """What `make test-device` did there: every check skipped and exit 0. Now: exit 2, one line saying why."""
    torch_here(None)
    monkeypatch.setattr(device_check, "find_target", lambda requested: (None, "torch 2.13.0+cpu is a CPU-only build"))
    monkeypatch.setattr(device_check, "environment", lambda target, why: {"torch": torch.__version__})
    ran = []
    monkeypatch.setattr(device_check, "run_checks", lambda *a: ran.append(a) or [])
    monkeypatch.setattr(device_check, "visible_accelerators", lambda: {"cuda": "/dev/nvidia0 exists"})
    assert device_check.main(["--no-write"]) == 2 and not ran
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("error: torch 2.13.0+cpu is a CPU-only build and cannot use the GPU this machine has")
    assert sum("cannot use" in line for line in out) == 1
    monkeypatch.setattr(device_check, "visible_accelerators", lambda: {})  # no GPU: the checks skip, exit 0
    assert device_check.main(["--no-write"]) == 0 and ran


def test_report_is_a_well_formed_table_and_json(tmp_path):
    env = {
        "date": "2025-06-01T10:00:00+00:00",
        "torch": "2.13.0",
        "device_type": "cuda",
        "device_count": 2,
        "devices": [{"index": i, "name": "NVIDIA H200", "capability": "9.0"} for i in range(2)],
    }
    results = [
        Result(
            "colocated bfloat16 vs CPU fp32",
            "pass",
            "top-1 on 99.8% of steps",
            {"steps": 512, "top1_strict": 0.977, "logits_err_max": float("nan")},
            12.3,
            "tokens and logits vs CPU",
        ),
        Result(
            "grouped GEMM float32 G=1",
            "fail",
            "rel err 0.01 > 0.0001 | a pipe\nand a newline",
            {"grouped_ms": float("inf")},
            0.5,
        ),
        Result("1A1F over NCCL via the OpenAI API", "skip", "1 cuda device here: 1A1F needs 2"),
    ]
    md, js = write_report(tmp_path, env, results, ["check.py"], 42.0)
    assert (md.name, js.name) == ("2x-nvidia-h200-2025-06-01.md", "2x-nvidia-h200-2025-06-01.json")

    def not_json(const):
        raise AssertionError(f"{const} is not JSON")

    doc = json.loads(js.read_text(), parse_constant=not_json)
    assert doc["schema"] == SCHEMA and doc["summary"] == {"pass": 1, "fail": 1, "skip": 1}
    assert [(c["check"], c["status"]) for c in doc["checks"]] == [(r.check, r.status) for r in results]
    assert doc["checks"][0]["figures"] == {"steps": 512, "top1_strict": 0.977, "logits_err_max": "nan"}
    assert doc["checks"][2]["reason"] == results[2].reason and doc["environment"] == env

    table = [ln for ln in md.read_text().splitlines() if ln.startswith("|")]
    assert len(table) == 2 + len(results)
    assert all(len(re.findall(r"(?<!\\)\|", ln)) == 6 for ln in table), table  # 5 cells; escaped pipes aside
    assert [ln.split(" | ")[1] for ln in table[2:]] == ["pass", "fail", "skip"]
    assert "a pipe and a newline" in table[3]
    # each row says what it measured, in its check cell
    assert table[2].startswith("| colocated bfloat16 vs CPU fp32: tokens and logits vs CPU | pass |")
    assert table[4].startswith("| 1A1F over NCCL via the OpenAI API | skip |")  # none said: the name alone
    assert doc["checks"][0]["measured"] == "tokens and logits vs CPU"

    again = write_report(tmp_path, env, results, ["check.py"], 1.0)  # the same day: a new file, not over the first
    assert [p.name for p in again] == ["2x-nvidia-h200-2025-06-01-2.md", "2x-nvidia-h200-2025-06-01-2.json"]


def test_pytest_report_reader(tmp_path):
    xml = tmp_path / "junit.xml"
    xml.write_text("""<testsuites><testsuite name="pytest">
<testcase classname="tests.test_cuda" name="test_a"><skipped message="needs a CUDA device">x</skipped></testcase>
<testcase classname="tests.test_cuda" name="test_b"/>
<testcase classname="tests.t" name="test_c"><failure message="assert 1 == 2&#10;where">tb</failure></testcase>
<testcase classname="tests.t" name="test_d"><error message="">tb</error></testcase>
</testsuite></testsuites>""")
    got = checks_pytest.parse_junit(xml)
    assert {k: got[k] for k in ("passed", "failed", "skipped")} == {"passed": 1, "failed": 2, "skipped": 1}
    assert got["skips"] == ["needs a CUDA device"]
    assert got["failures"] == ["tests.t::test_c: assert 1 == 2", "tests.t::test_d: "]


class _FakeLLM:
    """Greedy decoding of `truth`, except that it picks truth[k] + 1 at the steps in `flips` (when its
    history is the reference's) and 0 after that; each step's logits are [k], to check the alignment."""

    def __init__(self, prompt: list[int], truth: list[int], flips: set[int]):
        self.prompt, self.truth, self.flips, self.calls = prompt, truth, flips, 0

    def generate_ids(self, prompts, max_tokens, ignore_eos, logits_out):
        self.calls += 1
        outs = []
        for p, n in zip(prompts, max_tokens):
            start = len(p) - len(self.prompt)
            assert p == self.prompt + self.truth[:start]  # restarted from the reference's own history
            ids, off = [], False
            for k in range(start, start + n):
                ids.append(0 if off else self.truth[k] + 1 if k in self.flips else self.truth[k])
                off = off or k in self.flips
            outs.append(ids)
            logits_out.append([torch.tensor([float(k)]) for k in range(start, start + n)])
        return outs


def test_teacher_forcing_restarts_from_the_reference_after_each_disagreement():
    truth = [11, 12, 13, 14, 15, 16, 17, 18]
    llm = _FakeLLM([5, 6], truth, flips={2, 5})
    tokens, logits, rounds = checks_colocated.teacher_forced(llm, [[5, 6]], [truth])
    assert tokens == [[11, 12, 14, 14, 15, 17, 17, 18]]
    assert [x.item() for x in logits[0]] == list(range(8)) and rounds == llm.calls == 3

    cut = checks_colocated.teacher_forced(_FakeLLM([5, 6], truth, set(range(8))), [[5, 6]], [truth], max_rounds=3)
    assert len(cut[0][0]) == 3 and cut[2] == 3  # cut short: the verdict then fails it


def _steps(n: int, misses: int, gap: float, err: float = 1e-4) -> list:
    """n compared steps over a 4-token vocabulary; `misses` of them pick a token `gap` below the top-1."""
    ref = torch.tensor([0.0, 10.0, 10.0 - 10 * gap, 1.0])
    return [checks_colocated.compare_step(f"s{k}", 2 if k < misses else 1, ref + err * 10, 1, ref) for k in range(n)]


def test_verdicts():
    judge = checks_colocated.judge_colocated
    assert judge("fp32", "float32", _steps(100, 0, 0.5), 0, []).status == "pass"
    fp32_miss = judge("fp32", "float32", _steps(100, 1, 0.001), 1, [])
    assert fp32_miss.status == "fail" and "tokens differ at 1 steps (first: s0)" in fp32_miss.reason
    assert judge("fp32", "float32", _steps(10, 0, 0.5, err=0.01), 0, []).status == "fail"  # logits off
    # bf16: a near-tie flip is agreement; 1 decisive flip in 100 is 99 %; 2 are not enough
    near = judge("bf16", "bfloat16", _steps(100, 50, checks_colocated.TIE / 2, err=0.01), 5, [])
    assert near.status == "pass" and near.figures["top1_strict"] == 0.5 and near.figures["top1_up_to_ties"] == 1
    assert judge("bf16", "bfloat16", _steps(100, 1, 0.5), 1, []).status == "pass"
    assert judge("bf16", "bfloat16", _steps(100, 2, 0.5), 2, []).status == "fail"
    assert judge("bf16", "bfloat16", _steps(100, 0, 0.5, err=0.03), 0, []).status == "fail"  # median too far
    assert "cut short" in judge("bf16", "bfloat16", _steps(10, 0, 0.5), 5, ["x prompt 0"]).reason
    # p99 as a count of steps above 0.05: CPU bf16's two jumps in 128 steps (--quick) pass, three fail; 1 % of 512
    jumps = lambda n, k: [*_steps(n - k, 0, 0.5), *_steps(k, 0, 0.5, err=0.07)]  # noqa: E731
    assert judge("bf16", "bfloat16", jumps(128, 2), 0, []).status == "pass"
    three = judge("bf16", "bfloat16", jumps(128, 3), 0, [])
    assert three.status == "fail" and "above 0.05 at 3 of 128 steps (p99: at most 2)" in three.reason
    assert judge("bf16", "bfloat16", jumps(512, 5), 0, []).status == "pass"
    assert judge("bf16", "bfloat16", jumps(512, 6), 0, []).status == "fail"


def _window(attention: float, ffn: float, decode_steps: float, runtime: tuple | None = None) -> dict[str, float]:
    """The counts of a window; runtime: the runtime's own (sync watch) counts, the same as afd's when None."""
    attention_rt, ffn_rt = runtime if runtime is not None else (attention, ffn)
    return {
        "attention": attention,
        "ffn": ffn,
        "decode_steps": decode_steps,
        "attention_runtime": attention_rt,
        "ffn_runtime": ffn_rt,
    }


def test_host_sync_verdicts():
    judge = checks_host_syncs.judge
    short = _window(9, 14, 7)
    ok = judge("cuda", 32, short, _window(9 + 31, 14 + 33, 7 + 32), {"ffn": ["_recv_headers at x.py:1"]})
    assert ok.status == "pass" and ok.figures["attention_per_step"] == round(31 / 32, 3)
    assert ok.figures["ffn_first_sites"] == "_recv_headers at x.py:1"
    twice = judge("cuda", 32, short, _window(9 + 64, 14 + 32, 39)).reason  # one more sync per step
    assert twice.startswith("attention 2.00 per step > 1 + 0.25")
    assert (
        "ffn 0.00 per step < 1 - 0.25: afd_host_syncs_total misses"
        in judge("npu", 32, short, _window(41, 14, 39)).reason
    )
    assert "ran 31 more decode steps, not 32" in judge("cuda", 32, short, _window(40, 46, 38)).reason
    # a sync afd does not mark: its counter holds 1 per step, the runtime sees 2
    unmarked = judge("npu", 32, short, _window(9 + 32, 14 + 32, 39, runtime=(9 + 64, 14 + 32))).reason
    assert unmarked == "attention_runtime 2.00 per step > 1 + 0.25"
    blind = {k: v for k, v in _window(9 + 32, 14 + 32, 39).items() if not k.endswith("_runtime")}
    no_watch = {k: v for k, v in short.items() if not k.endswith("_runtime")}
    assert "the runtime counted nothing" in judge("cuda", 32, no_watch, blind).reason
    cpu = {k: v for k, v in _window(0, 0, 7).items() if not k.endswith("_runtime")}
    assert judge("cpu", 32, cpu, {**cpu, "decode_steps": 39}).status == "pass"  # the dry run: steps only
    assert judge("cpu", 32, cpu, {**cpu, "attention": 1, "decode_steps": 39}).status == "fail"


def test_failure_verdicts():
    ref = [[1, 2, 3], [4, 5, 6]]
    prompts = checks_failure.PROMPTS[:2]
    fine = {"finished_at_kill": 0, "pause_s": 0.4, "reform_s": 12.0}
    good = [([1, 2, 3], []), ([4, 5, 6], [])]
    judge = checks_failure.judge
    assert judge(good, ref, prompts, 0, fine, True).status == "pass"
    assert "1 stream(s) still open" in judge([good[0], None], ref, prompts, 1, fine, True).reason
    assert "a token lost or doubled" in judge([good[0], ([4, 5, 5, 6], [])], ref, prompts, 0, fine, True).reason
    late = judge(good, ref, prompts, 0, {**fine, "finished_at_kill": 2}, True).reason
    assert "every stream had finished before the kill" in late
    assert (
        "did not re-form within rejoin_timeout" in judge(good, ref, prompts, 0, {**fine, "reform_s": None}, True).reason
    )
    assert "never paused" in judge(good, ref, prompts, 0, {**fine, "pause_s": None}, True).reason
    assert "was restarted" in judge(good, ref, prompts, 0, fine, False).reason
    errs = judge([good[0], ([4], ["engine stopped: no replacement"])], ref, prompts, 0, fine, True).reason
    assert "1 stream error(s), first: engine stopped" in errs


def test_one_gpu_shares_its_device_and_one_npu_skips_the_cluster_checks(tmp_path):
    assert Target("cpu", 1).node_devices() == ("cpu", "cpu") and not Target("cpu", 1).shared
    assert Target("npu", 2).node_devices() == ("npu:0", "npu:1") and not Target("npu", 2).shared
    assert Target("cuda", 1).node_devices() == ("cuda:0", "cuda:0") and Target("cuda", 1).shared
    assert Target("npu", 1).node_devices() is None
    skip = checks_host_syncs.check_host_syncs(Target("npu", 1), "unused", quick=True)
    assert skip.status == "skip" and "1A1F needs 2" in skip.reason
    assert checks_failure.check_failure(Target("npu", 1), "unused", quick=True).status == "skip"
    # one GPU: a config afd accepts, whose two nodes each get an NCCL_HOSTID of their own
    from checks_1a1f import cluster_config

    from afd.backend.cuda import CudaBackend
    from afd.config.loader import load

    path, doc = cluster_config(tmp_path, "demo", Target("cuda", 1), "one-gpu")
    cfg = load(str(path))
    assert cfg.cluster.share_devices and [n.device for n in cfg.nodes] == ["cuda:0", "cuda:0"]
    assert cfg.shares_device("attn0") and cfg.shares_device("ffn0")
    ids = {CudaBackend.shared_device_env(None, f"one-gpu-{n.name}")["NCCL_HOSTID"] for n in cfg.nodes}
    assert len(ids) == 2
    (tmp_path / "two").mkdir()
    two, _ = cluster_config(tmp_path / "two", "demo", Target("cuda", 2), "two-gpus")
    assert not load(str(two)).cluster.share_devices and not load(str(two)).shares_device("attn0")


@pytest.mark.slow  # ~45 s of node processes on 2 cores; make test-slow
@pytest.mark.multiprocess
def test_the_host_sync_row_reads_one_sync_per_decode_step_on_the_fake_npu(tiny_checkpoint, tmp_path):
    """The row's arithmetic on counts that are not 0: the fake NPU (tests/fakes) counts host syncs as a
    device would, and afd holds one per decode step on each node there (tests/test_npu_fake_cluster.py)."""
    from npu_fake import fake_env

    r = checks_host_syncs.check_host_syncs(Target("npu", 2), tiny_checkpoint, quick=True, env=fake_env(tmp_path / "r"))
    assert r.status == "pass", r
    assert all(0.75 <= r.figures[f"{role}_per_step"] <= 1.25 for role in ("attention", "ffn")), r.figures
