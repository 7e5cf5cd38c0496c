"""`afd bench-tp`: a tiny run end to end (tp 1, allreduce and sp at G = 2 on a colocated cluster, so that
it stays a few processes): the table, the JSON, and TPComm's counted bytes equal to the formula."""

from __future__ import annotations

import argparse
import json

import pytest
from bench_helpers import TINY_LONGCAT, bench_args

from afd.bench import tp as bench_tp
from afd.config.tp import TPConfig
from afd.model.registry import config_from_hf
from afd.model.tp.volume import step_bytes

TINY = TINY_LONGCAT


def _args(argv: list[str]) -> argparse.Namespace:
    return bench_args(bench_tp, "bench-tp", argv)


@pytest.mark.slow  # a benchmark smoke run; CI runs test-slow
def test_tiny_run_prints_the_table_and_counted_bytes_equal_the_formula(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    out = tmp_path / "tp.json"
    args = _args(
        [
            "--model",
            str(tmp_path),
            "--batch-size",
            "2",
            "--prompt-len",
            "5",
            "--steps",
            "3",
            "--repeats",
            "1",
            "--modes",
            "allreduce,sp",
            "--ffn-nodes",
            "0",
            "--output",
            str(out),
        ]
    )
    assert args.func(args) == 0
    text = capsys.readouterr().out
    assert "every mode shards every step" in text and "not NPU" in text
    assert "counted == formula in every run" in text
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert [r.split(" | ")[0][2:] for r in rows[1:]] == ["tp 1", "allreduce", "sp"]
    assert all(r.count("|") == 9 for r in rows)

    data = json.loads(out.read_text())
    results = data["results"]
    assert list(results) == list(data["rounds"]) == ["tp 1", "allreduce", "sp"]
    assert all(len(v) == 1 for v in data["rounds"].values())
    cfg = config_from_hf(TINY)
    for mode, r in results.items():
        assert r["prefill_ms"] > 0 and r["decode_ms"] > 0 and r["bytes_match"]
        assert r["tp_job_counted"] == r["tp_job"] and r["a2f_job_counted"] == r["a2f_job"] == 0  # colocated
        assert r["tp_fallbacks"] == {}  # tp_comm_min_tokens 1: sp shards the decode too
        if mode == "tp 1":
            assert r["tp_job"] == r["tp_decode"] == 0
            continue
        tp = TPConfig(2, mode, None, 1)
        want = [sum(step_bytes(cfg, tp, T, 4, seqs=2).values()) for T in (10, 2)]
        assert [r["tp_prefill"], r["tp_decode"]] == want
        assert r["tp_job"] == want[0] + 3 * want[1]  # one prefill, three decode steps
    assert results["sp"]["tp_decode"] < results["allreduce"]["tp_decode"]


def test_bad_mode_and_head_split_are_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown mode"):
        bench_tp.run(_args(["--modes", "allreduce,ring"]))
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    with pytest.raises(ValueError, match="do not divide"):
        bench_tp.run(_args(["--model", str(tmp_path), "--attention-tp", "3", "--modes", "allreduce"]))
