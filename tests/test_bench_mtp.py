"""`afd bench-mtp`: a tiny run end to end (a built LongCat-Flash checkpoint whose MTP drafts are accepted
often, speculative_tokens 0, 1, 2, one round): the table, the JSON, and the same tokens in every mode;
colocated in make test, colocated and 1A1F in make test-slow."""

from __future__ import annotations

import argparse
import json

import pytest
from bench_helpers import TINY_LONGCAT, bench_args

from afd.bench import mtp as bench_mtp

TINY = TINY_LONGCAT


def _args(argv: list[str]) -> argparse.Namespace:
    return bench_args(bench_mtp, "bench-mtp", argv)


def _tiny_run(tmp_path, capsys, placements: tuple[str, ...]) -> tuple[str, dict]:
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    out = tmp_path / "mtp.json"
    args = _args(
        [
            "--config",
            str(tmp_path / "config.json"),
            "--batch-sizes",
            "2",
            "--prompt-len",
            "5",
            "--decode-tokens",
            "8",
            "--repeats",
            "1",
            "--placements",
            ",".join(placements),
            "--output",
            str(out),
        ]
    )
    assert args.func(args) == 0
    text = capsys.readouterr().out
    assert "MTP head is built to be accepted often" in text and "MTP acceptance, measured:" in text
    assert "identical across every mode and round of each batch size (greedy MTP is lossless): checked" in text
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert [r.split(" | ")[1:3] for r in rows[1:]] == [[p, n] for p in placements for n in ("off", "N=1", "N=2")]
    assert all(r.count("|") == 11 for r in rows)

    data = json.loads(out.read_text())
    assert data["tokens_identical"] and data["checkpoint"] == "built"
    results = data["results"]
    names = [f"B=2 {p} {n}" for p in placements for n in ("MTP off", "MTP 1", "MTP 2")]
    assert list(results) == list(data["rounds"]) == names
    assert all(len(v) == 1 for v in data["rounds"].values())
    for r in results.values():
        assert r["decode_tok_s"] > 0 and r["step_ms"] > 0 and r["speedup"] > 0
        assert r["decode_tokens"] == 2 * 7 and r["prefill_tokens"] == 2 * 5  # the first token comes with prefill
        n = r["speculative_tokens"]
        if n == 0:
            assert r["speedup"] == 1.0 and r["tokens_per_step"] == 1.0 and r["acceptance"] is None
            assert r["decode_steps"] == 7
            continue
        assert r["tokens_per_step"] == 1 + r["num_accepted_tokens"] / r["num_drafts"]
        assert r["acceptance"] == r["num_accepted_tokens"] / r["num_draft_tokens"]
        assert sum(r["accepted_per_pos"]) == r["num_accepted_tokens"] and len(r["accepted_per_pos"]) == n
        assert r["decode_steps"] < 7  # drafts accepted: fewer steps than tokens
    assert 0.5 < data["acceptance"] <= 1.0  # the built MTP head is right most of the time
    return text, results


def test_tiny_colocated_run_prints_the_table_and_every_mode_gives_the_same_tokens(tmp_path, capsys):
    _tiny_run(tmp_path, capsys, ("colocated",))


@pytest.mark.slow  # a benchmark smoke run with three local clusters; CI runs test-slow
def test_tiny_run_colocated_and_1a1f_give_the_same_tokens_and_counters(tmp_path, capsys):
    _, results = _tiny_run(tmp_path, capsys, ("colocated", "1A1F"))
    for n in ("MTP 1", "MTP 2"):  # the same tokens, the same drafts
        a, b = results[f"B=2 colocated {n}"], results[f"B=2 1A1F {n}"]
        assert [a["num_drafts"], a["num_accepted_tokens"]] == [b["num_drafts"], b["num_accepted_tokens"]]


def test_a_model_without_a_built_mtp_head_and_bad_arguments_are_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**TINY, "model_type": "qwen3_moe"}))
    with pytest.raises(ValueError, match="LongCat-Flash"):
        bench_mtp.build_mtp_checkpoint(
            str(tmp_path / "x"),
            {
                "model_type": "qwen3_moe",
                "vocab_size": 97,
                "hidden_size": 32,
                "num_hidden_layers": 1,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 8,
                "intermediate_size": 48,
                "moe_intermediate_size": 12,
                "num_experts": 4,
                "num_experts_per_tok": 2,
            },
        )
    for argv, match in (
        (["--speculative-tokens", "3"], "speculative_tokens"),
        (["--placements", "2A1F"], "placement"),
        (["--batch-sizes", "x"], "batch-sizes"),
    ):
        args = _args(["--config", str(tmp_path / "config.json"), *argv])
        with pytest.raises(ValueError, match=match):
            args.func(args)
