"""A LongCat-Flash checkpoint of hidden 1024 with 16 routed experts, fp32 on disk and seeded random weights: the
shape the kernel figures of docs/benchmarks/quantization.md name (its GEMMs are [T x 1024] x [1024 x 2048] and the
like), for `afd bench-quant --model DIR` and `afd generate --model DIR`. With --bf16, the same weights stored in
bf16 (the config says bfloat16), the copy `--dtype auto` serves in bf16.

    python bench/longcat_1024_checkpoint.py DIR [--bf16]     # prints DIR once written
"""

from __future__ import annotations

import argparse
import json
import os

from afd.bench.suite import HF_CONFIG

CONFIG = {
    **HF_CONFIG,
    "hidden_size": 1024,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "ffn_hidden_size": 2048,
    "q_lora_rank": 512,
    "kv_lora_rank": 256,
    "expert_ffn_hidden_size": 1024,
}


def main() -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--bf16", action="store_true", help="store the weights in bf16")
    args = ap.parse_args()
    from safetensors.torch import load_file, save_file

    from afd.model.demo import write_checkpoint

    write_checkpoint(args.out, CONFIG, seed=0)
    if args.bf16:
        weights = os.path.join(args.out, "model.safetensors")
        tensors = {k: v.bfloat16() if v.is_floating_point() else v for k, v in load_file(weights).items()}
        save_file(tensors, weights, metadata={"format": "pt"})
        config = os.path.join(args.out, "config.json")
        with open(config) as f:
            doc = json.load(f)
        with open(config, "w") as f:
            json.dump({**doc, "dtype": "bfloat16", "torch_dtype": "bfloat16"}, f, indent=2)
    return args.out


if __name__ == "__main__":
    print(main())
