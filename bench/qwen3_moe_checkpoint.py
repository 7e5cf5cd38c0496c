"""A Qwen3-MoE-shaped checkpoint for serving benchmarks: afd's bench-step scenario (hidden 512, 2 layers,
16 experts of 768, top-4) with seeded random weights and the demo's tokenizer and chat template, so that
`afd` and `transformers serve --continuous-batching` (whose paged cache takes GQA) load the same files.

    python bench/qwen3_moe_checkpoint.py DIR     # prints DIR once written
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import torch


def main(out: str) -> str:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from afd.bench.step import QWEN3_MOE
    from afd.model.demo import ensure_demo_checkpoint

    demo = ensure_demo_checkpoint()
    with open(os.path.join(demo, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    raw = {k: v for k, v in QWEN3_MOE.items() if k != "model_type"}
    cfg = Qwen3MoeConfig(**{**raw, "vocab_size": vocab, "bos_token_id": 1, "eos_token_id": 2})
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(cfg).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(os.path.join(demo, name), os.path.join(out, name))
    return out


if __name__ == "__main__":
    print(main(sys.argv[1]))
