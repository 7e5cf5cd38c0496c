"""The colocated entry points beyond afd.LLM against HF transformers (LongCat-Flash's tiny checkpoint).
Every family's colocated greedy tokens and logits against HF are tests/test_families.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hf_reference import PROMPTS

import afd

NEW_TOKENS = 32


def test_generate_cli_colocated_matches_hf(families, tiny_checkpoint, tmp_path):
    prompts_file = tmp_path / "prompts.json"
    prompts_file.write_text(json.dumps(PROMPTS))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "afd",
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
    assert got == families.ref_ids("longcat_flash", "zero_experts", NEW_TOKENS)


@pytest.mark.parametrize("micro_batches", [2, 3])
def test_micro_batches_do_not_change_tokens(tiny_checkpoint, micro_batches):
    ref = afd.LLM(tiny_checkpoint).generate_ids(PROMPTS, 12)
    assert afd.LLM(tiny_checkpoint, micro_batches=micro_batches).generate_ids(PROMPTS, 12) == ref
