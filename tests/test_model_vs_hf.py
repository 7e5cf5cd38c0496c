"""The colocated model (both halves in one process) against HF transformers on the same checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hf_reference import PROMPTS, TINY_CONFIGS, hf_greedy, max_rel_err

import afd

NEW_TOKENS = 32


@pytest.mark.parametrize("name", list(TINY_CONFIGS))
def test_greedy_tokens_and_logits_match_hf(tiny_checkpoints, name):
    path = tiny_checkpoints[name]
    ref = hf_greedy(path, PROMPTS, NEW_TOKENS)
    logits: list = []
    ours = afd.LLM(path, dtype="float32", block_size=4).generate_ids(PROMPTS, NEW_TOKENS, logits_out=logits)
    for i, (ref_ids, ref_logits) in enumerate(ref):
        assert ours[i] == ref_ids, f"prompt {i}"
        assert max_rel_err(logits[i], ref_logits) <= 1e-4


def test_generate_cli_colocated_matches_hf(tiny_checkpoint, tmp_path):
    prompts_file = tmp_path / "prompts.json"
    prompts_file.write_text(json.dumps(PROMPTS))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "afd.cli",
            "generate",
            "--model",
            tiny_checkpoint,
            "--prompt-ids",
            str(prompts_file),
            "--max-tokens",
            str(NEW_TOKENS),
            "--dtype",
            "float32",
            "--colocated",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == [ids for ids, _ in hf_greedy(tiny_checkpoint, PROMPTS, NEW_TOKENS)]


@pytest.mark.parametrize("micro_batches", [2, 3])
def test_micro_batches_do_not_change_tokens(tiny_checkpoint, micro_batches):
    ref = afd.LLM(tiny_checkpoint).generate_ids(PROMPTS, 12)
    assert afd.LLM(tiny_checkpoint, micro_batches=micro_batches).generate_ids(PROMPTS, 12) == ref
