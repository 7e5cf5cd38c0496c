"""AFD across real processes over gloo: any attention:FFN ratio, with and without overlap, equals HF."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import forked_python
import pytest
from hf_reference import PROMPTS

import afd
from afd.cluster.local import LocalCluster
from afd.cluster.local_config import local_job

pytestmark = pytest.mark.multiprocess
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def reference(families):
    return families.ref_ids("longcat_flash", "zero_experts", NEW_TOKENS)  # tiny_checkpoint's


SLOW = pytest.mark.slow  # the same paths as a default case next to it; `make test-slow` (CI) runs them


@pytest.mark.parametrize(
    "A,F,overlap,micro_batches",
    [
        (1, 1, True, 0),
        (1, 1, False, 1),
        pytest.param(1, 1, True, 3, marks=SLOW),
        (2, 1, True, 2),
        pytest.param(2, 1, False, 1, marks=SLOW),
        pytest.param(1, 2, True, 1, marks=SLOW),
        (1, 2, True, 2),
        pytest.param(2, 2, True, 0, marks=SLOW),
        pytest.param(2, 2, False, 1, marks=SLOW),
    ],
)
def test_afd_generation_equals_hf(llm_pool, tiny_checkpoint, reference, A, F, overlap, micro_batches):
    llm = llm_pool.get(
        tiny_checkpoint, attention_nodes=A, ffn_nodes=F, overlap=overlap, micro_batches=micro_batches, block_size=4
    )
    assert llm.generate_ids(PROMPTS, NEW_TOKENS) == reference
    assert llm.generate_ids(PROMPTS[:1], 4) == [reference[0][:4]]  # a second job on the same nodes


@SLOW  # the longest multi-process case (18 s); CI runs test-slow
def test_multiprocess_sampling_honours_seed_top_k_and_top_p(llm_pool, tiny_checkpoint, reference):
    """Sampling runs in the attention nodes' engines, with every field of the request. (The 2A2F
    nodes of the last case above: three jobs on them.)"""
    seeded = dict(temperature=1.0, seed=7)
    local = afd.LLM(tiny_checkpoint).generate_ids(PROMPTS, 12, **seeded)
    assert local != [ids[:12] for ids in reference]  # really sampled
    nodes = llm_pool.get(tiny_checkpoint, attention_nodes=2, ffn_nodes=2, overlap=False, micro_batches=1, block_size=4)
    assert nodes.generate_ids(PROMPTS, 12, **seeded) == local  # the seed, wherever each prompt ran
    assert nodes.generate_ids(PROMPTS, NEW_TOKENS, temperature=1.0, top_k=1) == reference
    assert nodes.generate_ids(PROMPTS, NEW_TOKENS, temperature=5.0, top_p=1e-4) == reference


@SLOW
def test_generate_cli_multiprocess_prints_same_json(tiny_checkpoint, reference, tmp_path):
    f = tmp_path / "p.json"
    f.write_text(json.dumps(PROMPTS))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "afd",
            "generate",
            "--model",
            tiny_checkpoint,
            "--prompt-ids",
            str(f),
            "--max-tokens",
            str(NEW_TOKENS),
            "--attention-nodes",
            "1",
            "--ffn-nodes",
            "2",
            "--micro-batches",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == reference


_KEEPS_ITS_NODES = """
import json, os, sys
import afd

def pids(llm):
    return sorted(p.popen.pid for p in llm._local.processes.procs.values())

with afd.LLM(sys.argv[1], attention_nodes=1, ffn_nodes=1, block_size=4) as llm:
    first = llm.generate_ids([[1, 2, 3]], 3)
    served = pids(llm)
    assert llm.generate_ids([[1, 2, 3]], 3) == first and pids(llm) == served, "a new cluster for the second job"
gone = [p for p in served if not os.path.exists(f"/proc/{p}")]
assert gone == served, f"still running after the with block: {set(served) - set(gone)}"
left = afd.LLM(sys.argv[1], attention_nodes=1, ffn_nodes=0, block_size=4)  # one process is enough here
left.generate_ids([[1, 2, 3]], 3)
print(json.dumps(pids(left)))  # never closed: stopped at interpreter exit
"""


def test_an_llm_keeps_its_nodes_across_jobs_and_leaves_none_behind(tiny_checkpoint):
    out = forked_python.run([sys.executable, "-c", _KEEPS_ITS_NODES, tiny_checkpoint], timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    left = json.loads(out.stdout.strip().splitlines()[-1])
    assert [p for p in left if os.path.exists(f"/proc/{p}")] == []


def _long_job(tmp_path) -> LocalCluster:
    """A dummy-weights job long enough to be interrupted."""
    from afd.model.demo import DEMO_CONFIG

    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**DEMO_CONFIG, "num_layers": 2}))
    cluster = LocalCluster(local_job(str(d), dtype="float32", dummy_weights=True, comm_timeout=120))
    cluster.start([[1, 2, 3, 4]] * 4, 3000, ignore_eos=True)
    _wait_for_log(cluster, "attn0", "data plane up")
    time.sleep(1.0)
    return cluster


def _wait_for_log(cluster: LocalCluster, name: str, text: str, timeout: float = 60) -> str:
    path = os.path.join(cluster.dir, f"{name}.log")
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        log = Path(path).read_text() if os.path.exists(path) else ""
        if text in log:
            return log
        time.sleep(0.1)
    raise AssertionError(f"{name} never logged {text!r}; log:\n{log}")


@pytest.mark.parametrize(
    "victim,survivor,signum",
    [
        ("ffn0", "attn0", signal.SIGKILL),
        ("attn0", "ffn0", signal.SIGKILL),
        pytest.param("ffn0", "attn0", signal.SIGTERM, marks=pytest.mark.slow),
    ],
)
def test_a_dead_peer_fails_fast_with_a_clear_error(tmp_path, victim, survivor, signum):
    with _long_job(tmp_path) as cluster:
        cluster.process(victim).send_signal(signum)
        t0 = time.monotonic()
        rc = cluster.process(survivor).wait(timeout=15)
        assert time.monotonic() - t0 < 10
        assert rc == 1
        log = _wait_for_log(cluster, survivor, "stopping: ")
        assert "the peer process is probably gone" in log
        if signum == signal.SIGTERM:
            assert cluster.process(victim).wait(timeout=5) == 0
