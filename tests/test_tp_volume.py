"""Attention-TP communication volume: the formula of afd.model.tp.volume equals what
TPComm counts on every rank, in every mode, and `afd check-config` prints it.

The counted side is one spawn of 4 gloo processes: two TP groups of 2 ranks run the G = 2 cases side by
side, then all 4 ranks run the G = 4 ones. Each case is a tiny dummy-weight model (the bytes do not depend
on the weights) stepped by the real ModelRunner: a prefill of 2 sequences, 7 tokens (odd, so the shards
pad), then a decode of 2 tokens (which sharded modes with tp_comm_min_tokens 3 run as allreduce).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections import Counter
from dataclasses import fields
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml
from bench_helpers import TINY_LONGCAT

from afd.backend import get_backend
from afd.config.tp import TPConfig, TPConfigError
from afd.dataplane.exchange import LocalMoE
from afd.engine.kv_cache import KVCache
from afd.engine.messages import RunStep
from afd.engine.runner import ModelRunner, StepSeq
from afd.model.checkpoint import DummyReader, build_attention_half, build_ffn_half
from afd.model.registry import config_from_hf
from afd.model.tp.comm import TPComm
from afd.model.tp.shard import shard_attention_half
from afd.model.tp.volume import COLLECTIVES, step_bytes, volume, volume_table

ROOT = Path(__file__).resolve().parent.parent

CONFIGS = {
    # 2 layers of 2 MLA + 2 dense MLPs, every layer MoE; MLA with a q LoRA (flashcomm1/2 gather latents)
    "longcat": {k: v for k, v in TINY_LONGCAT.items() if k != "eos_token_id"},
    # 3 layers, the first dense; q without a LoRA (flashcomm1/2 gather the hidden state before the MLA)
    "deepseek": dict(
        model_type="deepseek_v3",
        vocab_size=83,
        hidden_size=24,
        intermediate_size=40,
        moe_intermediate_size=12,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        kv_lora_rank=8,
        q_lora_rank=None,
        qk_rope_head_dim=4,
        v_head_dim=6,
        qk_nope_head_dim=8,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=3,
        first_k_dense_replace=1,
        max_position_embeddings=64,
    ),
}
CONFIGS_CFG = {name: config_from_hf(d) for name, d in CONFIGS.items()}

# (family, mode, otp, tp_comm_min_tokens[, kvp]) by TP group (its global ranks)
CASES = {
    (0, 1): [
        ("longcat", "allreduce", None, None),
        ("longcat", "sp", None, None),
        ("deepseek", "flashcomm1", None, 3),
        ("deepseek", "flashcomm2", 1, 3),
        ("longcat", "allreduce", None, None, 2),
    ],
    (2, 3): [
        ("deepseek", "allreduce", None, None),
        ("deepseek", "sp", None, None),
        ("longcat", "flashcomm1", None, 3),
        ("longcat", "flashcomm2", 1, 3),
        ("deepseek", "flashcomm1", None, 3, 2),
    ],
    (0, 1, 2, 3): [
        ("longcat", "flashcomm2", 2, 3),
        ("deepseek", "flashcomm2", 2, 3),
        ("longcat", "sp", None, None),
        ("deepseek", "sp", None, None, 2),
    ],
}
PROMPTS = [[3, 5, 7, 11], [13, 17, 19]]  # prefill: T = 7, B = 2
DECODE = [23, 29]  # decode: T = 2, B = 2


def case_id(ranks: tuple, case: tuple) -> str:
    family, mode, otp, min_tokens, *kvp = case
    return (
        f"{family}-tp{len(ranks)}-{mode}"
        + (f"-P{otp}" if otp else "")
        + (f"-min{min_tokens}" if min_tokens else "")
        + (f"-kvp{kvp[0]}" if kvp else "")
    )


def tp_config(ranks: tuple, case: tuple) -> TPConfig:
    return TPConfig(len(ranks), case[1], case[2], case[3], *case[4:])


# ---- the counted side (spawned processes) ---------------------------------------------------------------


class CountingMoE(LocalMoE):
    """The colocated MoE, counting the bytes of MoE input this rank sends (what a RemoteMoE sends to each
    FFN node)."""

    sent = 0

    def submit(self, layer: int, micro_batch: int, m: torch.Tensor):
        self.sent += m.numel() * m.element_size()
        return super().submit(layer, micro_batch, m)


def _run_case(ranks: tuple, case: tuple, tp_rank: int) -> list[dict]:
    """Per step: the bytes this rank counted by collective, and the MoE input it sent (summed over layers)."""
    cfg, be, reader = config_from_hf(CONFIGS[case[0]]), get_backend("cpu"), DummyReader(0)
    tp = TPComm(tp_config(ranks, case), tp_rank, list(ranks))
    attn = shard_attention_half(build_attention_half(cfg, reader, torch.float32, be.device), tp)
    moe = CountingMoE(build_ffn_half(cfg, reader, torch.float32, be.device), be)
    N = tp.cfg.kvp  # with KVP a sequence's first block comes from pool 0: ids 0 and N
    runner = ModelRunner(attn, moe, KVCache(cfg, 2 * N, 8, torch.float32, be.device, N), be.device, 1, True, tp)
    steps = [
        [StepSeq(p, 0, [i * N]) for i, p in enumerate(PROMPTS)],
        [StepSeq([t], len(p), [i * N]) for i, (p, t) in enumerate(zip(PROMPTS, DECODE))],
    ]
    out = []
    for seqs in steps:
        before, moe.sent = Counter(tp.bytes), 0
        if tp.is_leader:
            runner.execute(seqs)
        else:
            msg = tp.recv_step()
            assert isinstance(msg, RunStep)
            runner.execute(msg.seqs, micro_batches=msg.micro_batches)
        out.append({**{k: tp.bytes[k] - before[k] for k in COLLECTIVES}, "ffn": moe.sent})
    return out


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    for ranks, cases in CASES.items():
        if rank in ranks:
            for case in cases:
                got = _run_case(ranks, case, ranks.index(rank))
                Path(out_dir, f"{case_id(ranks, case)}.{ranks.index(rank)}.json").write_text(json.dumps(got))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def counted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tp_volume")
    mp.spawn(_worker, args=(4, _free_port(), str(out)), nprocs=4, join=True)
    return out


ALL = [(ranks, case) for ranks, cases in CASES.items() for case in cases]


@pytest.mark.slow  # one 4-process spawn for every case; CI runs test-slow
@pytest.mark.parametrize("ranks, case", ALL, ids=[case_id(r, c) for r, c in ALL])
def test_formula_equals_counted_bytes(counted, ranks, case):
    cfg, tp = CONFIGS_CFG[case[0]], tp_config(ranks, case)
    lens = [(sum(map(len, PROMPTS)), len(PROMPTS)), (len(DECODE), len(DECODE))]  # (T, B) per step
    for tp_rank in range(len(ranks)):
        got = json.loads((counted / f"{case_id(ranks, case)}.{tp_rank}.json").read_text())
        for step, (T, B) in zip(got, lens):
            want = step_bytes(cfg, tp, T, 4, seqs=B)
            assert {k: step[k] for k in COLLECTIVES} == want, (tp_rank, T)
            assert step["ffn"] == len(cfg.moe_layers) * volume(cfg, tp, T, 4).to_ffn[tp_rank], (tp_rank, T)


def test_cases_cover_sharding_and_fallback():
    """Each sharded mode shards the prefill; those with a threshold of 3 run the decode as allreduce."""
    for ranks, case in ALL:
        tp = tp_config(ranks, case)
        prefill, decode = (volume(CONFIGS_CFG[case[0]], tp, T, 4) for T in (7, 2))
        assert prefill.mode == tp.mode
        assert decode.mode == ("allreduce" if case[3] == 3 else tp.mode)


# ---- the formula by hand, and what it refuses ---------------------------------------------------------


def test_layer_formula_by_hand():
    """LongCat tiny at G = 2, T = 7 (s = 4, Tp = 8), fp32: H = 32, latents 16 + 8 + 4 = 28, heads 2 * v 8."""
    cfg = CONFIGS_CFG["longcat"]
    ar = volume(cfg, TPConfig(2), 7, 4).moe_layer
    # 4 row-parallel outputs all-reduced (2 * 7*32*4 / 2 each), the MoE output gathered (8*32*4 / 2)
    assert ar == {"all_reduce": 4 * 896, "reduce_scatter": 0, "all_gather": 512, "all_to_all": 0}
    fc2 = volume(cfg, TPConfig(2, "flashcomm2", 1, 1), 7, 4).moe_layer
    # 2 MLAs: gather latents 8*28*4/2, all_to_all 8*16*4/2, RS over P = 1 rank sends 0;
    # 2 MLPs: gather 8*32*4/2 and RS 8*32*4/2
    assert fc2 == {"all_reduce": 0, "reduce_scatter": 2 * 512, "all_gather": 2 * 448 + 2 * 512, "all_to_all": 2 * 256}


def test_qwen3_has_no_tp_volume():
    with pytest.raises(TPConfigError, match="qwen3_moe has no attention TP"):
        volume(config_from_hf({"model_type": "qwen3_moe"}), TPConfig(2), 4, 2)


def test_volume_is_torch_free():
    code = (
        "import sys; from afd.model.registry import config_from_hf; from afd.config.tp import TPConfig; "
        "from afd.model.tp.volume import volume_table; "
        "volume_table(config_from_hf({'model_type': 'deepseek_v3'}), TPConfig(8, 'flashcomm2', 2), 'bfloat16'); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "False"


# ---- the table `afd check-config` prints --------------------------------------------------------------


def test_table_marks_the_configured_mode_and_fallbacks():
    text = volume_table(CONFIGS_CFG["longcat"], TPConfig(2, "flashcomm1", min_tokens=16))
    rows = {line[4:24].strip(): line for line in text.splitlines()[2:]}
    assert rows["flashcomm1"].startswith("  > ")
    assert rows["sp"].startswith("    ")
    # flashcomm1 falls back below 16 tokens only; flashcomm2 keeps vllm-ascend's 1001
    # (docs/design/tp-communication.md#thresholds)
    assert rows["flashcomm1"].count("*") == 1
    assert "flashcomm2 (P=1)" in rows and rows["flashcomm2 (P=1)"].count("*") == 3
    assert "T=4096" in text and "to each FFN node" in rows and "+ per step" in rows


def _has_tp_layout() -> bool:
    from afd.config.sections import Layout

    return {"attention_tp", "tp_comm"} <= {f.name for f in fields(Layout)}


@pytest.mark.skipif(not _has_tp_layout(), reason="afd.config.loader.Layout has no attention_tp yet")
def test_check_config_prints_the_table(tmp_path):
    def cluster(**layout) -> Path:
        path = tmp_path / f"{len(layout)}.yaml"
        path.write_text(
            yaml.safe_dump(
                {
                    "cluster": {"name": "t"},
                    "model": {"path": "demo"},
                    "layout": layout,
                    "nodes": [
                        {
                            "name": "attn0",
                            "role": "attention",
                            "host": "127.0.0.1",
                            "ports": {"control": 50001, "data": 50002, "http": 50003},
                        },
                        {
                            "name": "ffn0",
                            "role": "ffn",
                            "host": "127.0.0.1",
                            "ports": {"control": 50004, "data": 50005, "metrics": 50006},
                        },
                    ],
                }
            )
        )
        return path

    def check(path: Path) -> str:
        r = subprocess.run(
            [sys.executable, "-m", "afd", "check-config", str(path)],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr
        return r.stdout

    out = check(cluster(attention_tp=2, tp_comm="sp"))
    assert "TP communication per attention rank" in out and "attention_tp 2" in out
    assert any(line.startswith("  > sp ") for line in out.splitlines())
    assert "TP communication" not in check(cluster())
