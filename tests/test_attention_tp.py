"""Attention-side tensor parallelism (afd.model.tp): every tp_comm mode against HF and the allreduce path.

Token counts that G does not divide throughout: prompts of 5, 7, 3, 9 and 11 tokens, and max_tokens that
leave decode batches of 5, 3 and 1 sequences. The matrix (modes x tp 2/4 x colocated/1A1F) is marked
slow (`make test-slow`, which CI runs) and holds each mode to the allreduce path as well; the default run
keeps one of each kind at tp 2, held to HF.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import pytest
from hf_reference import hf_greedy, make_hf_checkpoint, max_rel_err

import afd
from afd.config.loader import from_dict
from afd.config.schema import ClusterConfigError
from afd.config.tp import TPConfig, TPConfigError, fc2_batch_ids, fc2_groups, plan

PROMPTS = [
    [1, 5, 9, 13, 22],
    [7, 7, 7, 40, 2, 3, 11],
    [3, 60, 14],
    [90, 4, 4, 8, 15, 16, 23, 42, 5],
    [12, 30, 31, 2, 2, 9, 70, 71, 72, 73, 74],
]
MAX_TOKENS = [7, 5, 5, 3, 3]  # decode steps 1-2: 5 sequences, 3-4: 3, 5-6: 1


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    return make_hf_checkpoint(str(tmp_path_factory.mktemp("tp") / "longcat"), seed=0)


@pytest.fixture(scope="module")
def hf(ckpt):
    ref = hf_greedy(ckpt, PROMPTS, max(MAX_TOKENS))
    return [(ids[:n], logits[:n]) for (ids, logits), n in zip(ref, MAX_TOKENS)]


_runs: dict = {}


def run(
    ckpt: str,
    tp: int,
    mode: str,
    colocated: bool,
    otp: int | None = None,
    min_tokens: int | None = 1,
    micro_batches: int = 1,
):
    """(tokens, logits) of the job, cached per configuration (the allreduce runs are shared references)."""
    key = (ckpt, tp, mode, colocated, otp, min_tokens, micro_batches)
    if key not in _runs:
        llm = afd.LLM(
            ckpt,
            block_size=4,
            attention_tp=tp,
            tp_comm=mode,
            flashcomm2_otp=otp,
            tp_comm_min_tokens=min_tokens,
            micro_batches=micro_batches,
            **({"colocated": True} if colocated else {"attention_nodes": 1, "ffn_nodes": 1}),
        )
        logits: list = []
        _runs[key] = (llm.generate_ids(PROMPTS, MAX_TOKENS, logits_out=logits), logits)
    return _runs[key]


def check(ckpt, hf, tp, mode, colocated, otp=None, micro_batches=1, vs_allreduce=True):
    """Tokens equal HF's, logits within 1e-4 of HF's; with vs_allreduce, also of the allreduce path's at
    the same TP (one more job: the slow matrix's)."""
    ids, logits = run(ckpt, tp, mode, colocated, otp, micro_batches=micro_batches)
    ref_logits = run(ckpt, tp, "allreduce", colocated)[1] if vs_allreduce else None
    for i, (hf_ids, hf_logits) in enumerate(hf):
        assert ids[i] == hf_ids, f"prompt {i}: tokens differ from HF"
        if ref_logits is not None:
            assert max_rel_err(logits[i], ref_logits[i]) <= 1e-4, f"prompt {i}: logits off the allreduce path"
        assert max_rel_err(logits[i], hf_logits) <= 1e-4, f"prompt {i}: logits off HF"


@pytest.mark.parametrize(
    "mode,colocated,otp,micro_batches",
    [
        ("sp", True, None, 1),
        pytest.param("flashcomm1", False, None, 2, marks=pytest.mark.slow),  # ping-pong: micro-batches' shards in turn
        ("flashcomm2", False, 1, 1),
    ],
)
def test_tp2_modes_equal_hf(ckpt, hf, mode, colocated, otp, micro_batches):
    """One job per mode, held to HF; each also against the allreduce path in the slow matrix below."""
    check(ckpt, hf, 2, mode, colocated, otp, micro_batches, vs_allreduce=False)


@pytest.mark.slow
@pytest.mark.parametrize(
    "tp,mode,otp",
    [
        (2, "sp", None),
        (2, "flashcomm1", None),
        (2, "flashcomm2", 1),
        (4, "sp", None),
        (4, "flashcomm1", None),
        (4, "flashcomm2", 2),
        (4, "flashcomm2", 1),
    ],
)
@pytest.mark.parametrize("colocated", [True, False], ids=["colocated", "1A1F"])
def test_every_mode_at_tp2_and_tp4(ckpt, hf, tp, mode, otp, colocated):
    check(ckpt, hf, tp, mode, colocated, otp)


def test_below_the_threshold_a_mode_runs_as_allreduce_and_counts_it(ckpt, hf):
    """min_tokens 6: the prefill (35 tokens) is sharded, the decode steps (5, 3, 1 tokens) fall back.
    A second job on the same processes (the TP rank takes it from rank 0) counts only its own."""
    from afd.cluster.local import LocalCluster
    from afd.cluster.local_config import local_job

    job = local_job(ckpt, 1, 1, block_size=4, micro_batches=1, attention_tp=2, tp_comm="sp", tp_comm_min_tokens=6)
    with LocalCluster(job) as cluster:
        cluster.start()
        out, reports = cluster.generate(PROMPTS, MAX_TOKENS)
        again, second = cluster.generate(PROMPTS[:2], 2)  # a 12-token prefill, then one decode step
    assert out == [ids for ids, _ in hf]
    assert reports[0]["tp_fallbacks"] == {"sp": 6}  # the six decode steps
    sent = reports[0]["tp_bytes"]
    assert sent["reduce_scatter"] > 0 and sent["all_reduce"] > 0  # both paths ran
    assert again == [ids[:2] for ids, _ in hf[:2]] and second[0]["tp_fallbacks"] == {"sp": 1}


@pytest.mark.slow  # the CLI runs afd.LLM, which the cases above exercise; CI runs test-slow
def test_generate_cli_with_attention_tp(ckpt, hf, tmp_path):
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps(PROMPTS))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "afd",
            "generate",
            "--model",
            ckpt,
            "--prompt-ids",
            str(prompts),
            "--max-tokens",
            "3",
            "--attention-tp",
            "2",
            "--tp-comm",
            "flashcomm1",
            "--tp-comm-min-tokens",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [ids[:3] for ids, _ in hf]


@pytest.mark.parametrize(
    "argv",
    [
        ["--attention-tp", "2", "--tp-comm", "flashcomm2", "--flashcomm2-otp", "1"],
        pytest.param(["--colocated", "--attention-tp", "2", "--tp-comm", "sp"], marks=pytest.mark.slow),
    ],
    ids=["1A1F-flashcomm2", "colocated-sp"],
)
def test_api_serves_hfs_tokens_with_attention_tp(ckpt, hf, tmp_path, argv):
    """`afd serve` with TP ranks: concurrent completions (their steps batch and shard together)."""
    from concurrent.futures import ThreadPoolExecutor

    from cluster_helpers import post
    from serve_helpers import Served, free_port_run

    port = free_port_run(1)
    url = f"http://127.0.0.1:{port}"
    s = Served([ckpt, "--port", str(port), "--tp-comm-min-tokens", "1", *argv], tmp_path / "serve.log", [url])
    try:
        s.wait_ready()
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            results = list(
                pool.map(
                    lambda a: post(
                        url,
                        "/v1/completions",
                        {"prompt": a[0], "max_tokens": a[1], "temperature": 0, "return_token_ids": True},
                    ),
                    zip(PROMPTS, MAX_TOKENS),
                )
            )
        with urllib.request.urlopen(f"{url}/metrics") as r:
            metrics = r.read().decode()
    finally:
        assert s.stop() == 0
    for (code, body), (ids, _) in zip(results, hf):
        assert code == 200, body
        assert body["choices"][0]["token_ids"] == ids
    assert "afd_tp_comm_bytes_total{model_name=" in metrics


@pytest.mark.slow
def test_deepseek_v3_without_q_lora_and_tied_vocab_at_tp2(tmp_path):
    from hf_deepseek import hf_greedy as ds_greedy
    from hf_deepseek import make_deepseek_checkpoint

    path = make_deepseek_checkpoint(
        str(tmp_path / "ds"), seed=11, q_lora_rank=None, tie_word_embeddings=True, vocab_size=83, eos_token_id=82
    )
    prompts = [[t % 83 for t in p] for p in PROMPTS]  # this vocabulary has 83 ids (not a multiple of 2)
    ref = [ids for ids, _ in ds_greedy(path, prompts, 4)]
    for mode in ("sp", "flashcomm1"):
        llm = afd.LLM(path, block_size=4, attention_tp=2, tp_comm=mode, tp_comm_min_tokens=1, colocated=True)
        assert llm.generate_ids(prompts, 4) == ref, mode


# ---- layouts that cannot work are refused, naming the key --------------------------------------------


def _yaml(layout: dict) -> dict:
    return {
        "model": {"path": "demo"},
        "layout": layout,
        "nodes": [
            {"name": "attn0", "role": "attention", "host": "127.0.0.1", "ports": {"control": 1, "data": 2, "http": 3}}
        ],
    }


@pytest.mark.parametrize(
    "layout,error",
    [
        (
            {"attention_tp": 4, "tp_comm": "flashcomm2", "flashcomm2_otp": 4},
            "layout.flashcomm2_otp: P = 4 must be smaller than layout.attention_tp = 4",
        ),
        (
            {"attention_tp": 4, "tp_comm": "flashcomm2", "flashcomm2_otp": 3},
            "layout.flashcomm2_otp: P = 3 does not divide layout.attention_tp = 4",
        ),
        ({"attention_tp": 2, "tp_comm": "flashcomm2"}, "layout.flashcomm2_otp: tp_comm flashcomm2 needs"),
        ({"attention_tp": 2, "tp_comm": "ring"}, "layout.tp_comm: expected allreduce, sp"),
        ({"attention_tp": 0}, "layout.attention_tp: must be positive, got 0"),
        ({"attention_tp": 2, "flashcomm2_otp": 1}, "layout.flashcomm2_otp: only tp_comm flashcomm2 uses it"),
    ],
)
def test_impossible_layouts_are_refused(layout, error):
    with pytest.raises(ClusterConfigError, match=error):
        from_dict(_yaml(layout), "c.yaml")


def test_tp_not_dividing_the_heads_is_refused(tiny_checkpoints):
    odd = tiny_checkpoints["odd_sizes"]  # 3 attention heads
    with pytest.raises(TPConfigError, match="layout.attention_tp: 2 ranks do not divide the model's 3 attention heads"):
        afd.LLM(odd, attention_tp=2)


def test_a_family_without_tp_layers_is_refused(tmp_path):
    from hf_qwen3 import make_qwen3_checkpoint

    path = make_qwen3_checkpoint(str(tmp_path / "q"))
    with pytest.raises(ValueError, match="qwen3_moe's attention half has no TP layers yet"):
        afd.LLM(path, attention_tp=2)


def test_tp_ranks_take_their_own_devices_and_ranks():
    doc = _yaml({"attention_tp": 2})
    doc["nodes"][0]["device"] = "cuda:0"
    doc["nodes"].append(
        {"name": "ffn0", "role": "ffn", "host": "127.0.0.1", "device": "cuda:1", "ports": {"control": 4, "data": 5}}
    )
    with pytest.raises(ClusterConfigError, match=r"nodes\[1\].device: ffn0 and attn0 TP rank 1 .* both use cuda:1"):
        from_dict(doc, "c.yaml")
    doc["nodes"][1]["device"] = "cuda:2"
    cfg = from_dict(doc, "c.yaml")
    assert [(p.name, p.device, cfg.rank(p.name)) for p in cfg.processes] == [
        ("attn0", "cuda:0", 0),
        ("attn0.tp1", "cuda:1", 1),
        ("ffn0", "cuda:2", 2),
    ]


# ---- the plan and FC2's regrouping ------------------------------------------------------------------


def test_shard_plan_pads_and_spans():
    p = plan(TPConfig(4, "sp"), 5)
    assert (p.sharded, p.shard, p.padded) == (True, 2, 8)
    assert [p.span(r) for r in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]
    assert not plan(TPConfig(4, "flashcomm1"), 1000).sharded and plan(TPConfig(4, "flashcomm1"), 1001).sharded


def test_fc2_groups_follow_the_seed():
    assert fc2_batch_ids(4, 2) == [[0, 2], [1, 3]]  # vllm-ascend's example (docs/design/tp-communication.md#groups)
    assert fc2_groups(4, 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    assert fc2_groups(8, 2) == ([[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 4], [1, 5], [2, 6], [3, 7]])


@pytest.mark.slow  # a 4-process cluster; CI runs it in make test-slow
def test_tp2_with_routing_on_the_attention_side_at_1a2f(ckpt, hf):
    """layout.routing attention under attention TP: each rank routes and dispatches its own token shard (sp)
    to the two FFN nodes, in two micro-batches."""
    llm = afd.LLM(
        ckpt,
        block_size=4,
        attention_tp=2,
        tp_comm="sp",
        tp_comm_min_tokens=1,
        micro_batches=2,
        ffn_nodes=2,
        routing="attention",
    )
    logits: list = []
    ids = llm.generate_ids(PROMPTS, MAX_TOKENS, logits_out=logits)
    for i, (hf_ids, hf_logits) in enumerate(hf):
        assert ids[i] == hf_ids, f"prompt {i}: tokens differ from HF"
        assert max_rel_err(logits[i], hf_logits) <= 1e-4, f"prompt {i}: logits off HF"
