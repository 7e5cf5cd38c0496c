"""How far afd's 8-bit serving moves the logits from HF's, teacher-forced.

    PYTHONPATH=$PWD .venv/bin/python bench/quant_accuracy.py [--out docs/bench/quant-accuracy.json]

Per family (DeepSeek-V3, LongCat-Flash): a random checkpoint made by HF transformers (tests/hf_deepseek.py,
tests/hf_reference.py: every weight N(0, std), norms N(1, 0.1)), hidden 512 and 32 routed experts, written in
the released FP8 layout with 128 x 128 blocks (tests/fp8_checkpoint.py). The oracle is HF's dequantized load
of it (FineGrainedFP8Config(dequantize=True)) in fp32: its greedy tokens on a fixed prompt set (a forward of
the whole sequence per step, no cache). afd, colocated in fp32 with --quantization fp8, w8a8 and w8a16, then
prefills every prompt + HF's first k tokens and its next-token logits are compared with HF's at that position:
top-1 agreement, and the largest logit error over the vocabulary relative to HF's largest |logit|. w8a16 also
generates greedily (identical tokens asked). The same again on the fp32 checkpoint before FP8 (quantized at
load by afd), against HF on those fp32 weights: there the error includes the weights' quantization.

To tell the scheme's error from afd's, HF runs each scheme too, simulated in its F.linear from the formats'
definitions (bench/quant_sim.py), and the share of (token, MoE layer) pairs whose experts the scheme changes is
counted (`routes`), and the simulation runs again with HF's own routes replayed (the routes frozen): what
the scheme moves besides the experts chosen. Weights N(0, 0.02) by default: HF's initializer_range.

Every FP8 dimension is a multiple of 128 or a single block (kv_lora 96): HF 5.24 takes a tensor's block as its
shape over its scale grid (transformers integrations/finegrained_fp8.py, Fp8Dequantize._dequantize_one).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from fp8_checkpoint import hf_dequantized_model, write_fp8_checkpoint  # noqa: E402
from quant_sim import routes, routing_changed, simulated  # noqa: E402

METHODS = ("w8a16", "fp8", "w8a8")
BLOCK = (128, 128)
# MLA as the releases have it, scaled down: every FP8 linear [N, K] has N and K multiples of 128, or K = 96
# (kv_b_proj's kv_lora: one partial block). q_b, kv_b: 4 heads x 64 = 256; kv_a: 96 + 32 = 128; o: K = 128.
MLA = dict(
    vocab_size=1024,
    hidden_size=512,
    num_attention_heads=4,
    q_lora_rank=256,
    kv_lora_rank=96,
    qk_nope_head_dim=32,
    qk_rope_head_dim=32,
    v_head_dim=32,
    max_position_embeddings=512,
    eos_token_id=1023,
    bos_token_id=1,
)
CONFIGS = {
    # 1 dense layer then 3 MoE layers; 32 experts in 4 groups keeping 2, top-4, one shared expert
    "deepseek_v3": dict(
        **MLA,
        num_key_value_heads=4,
        num_hidden_layers=4,
        first_k_dense_replace=1,
        intermediate_size=1024,
        moe_intermediate_size=256,
        n_routed_experts=32,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=4,
        routed_scaling_factor=2.5,
    ),
    # 2 layers (each: 2 attentions, 2 dense MLPs, 1 MoE); 32 experts + 16 identity experts, top-6
    "longcat_flash": dict(
        **MLA,
        head_dim=32,
        num_layers=2,
        ffn_hidden_size=1024,
        expert_ffn_hidden_size=256,
        n_routed_experts=32,
        zero_expert_num=16,
        moe_topk=6,
        routed_scaling_factor=2.5,
    ),
}
PROMPT_LENS = (3, 5, 8, 12, 17, 24, 33, 48) * 2


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab - 1, (n,), generator=g).tolist() for n in PROMPT_LENS]


def make_checkpoint(family: str, path: str, weight_std: float) -> str:
    if family == "deepseek_v3":
        from hf_deepseek import make_deepseek_checkpoint

        return make_deepseek_checkpoint(path, seed=0, weight_std=weight_std, **CONFIGS[family])
    from hf_reference import make_hf_checkpoint

    return make_hf_checkpoint(path, seed=0, weight_std=weight_std, **CONFIGS[family])


def hf_fp32_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation="eager").eval()


@torch.no_grad()
def hf_greedy(model, ps: list[list[int]], steps: int) -> list[list[int]]:
    """Per prompt: HF's greedy ids, one whole-sequence forward per step (no cache); EOS ignored."""
    ids = []
    for p in ps:
        seq = list(p)
        for _ in range(steps):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
        ids.append(seq[len(p) :])
    return ids


@torch.no_grad()
def hf_teacher_forced(model, ps, ids) -> list[torch.Tensor]:
    """HF's fp32 next-token logits [V] after each prompt + ids[:k], k < len(ids), from one forward per prompt."""
    out = []
    for p, i in zip(ps, ids):
        logits = model(torch.tensor([p + i])).logits[0].float()  # [len(p) + len(i), V]
        out += [logits[len(p) - 1 + k] for k in range(len(i))]
    return out


def afd_teacher_forced(path: str, method: str, ps, ids) -> tuple[object, list[torch.Tensor]]:
    """afd colocated (fp32, --quantization method): the next-token logits after each prompt + ids[:k]."""
    import afd

    llm = afd.LLM(path, dtype="float32", quantization=method)
    seqs = [p + i[:k] for p, i in zip(ps, ids) for k in range(len(i))]
    out: list = []
    llm.generate_ids(seqs, 1, ignore_eos=True, logits_out=out)
    return llm, [steps[0] for steps in out]


def agreement(got: list[torch.Tensor], ref: list[torch.Tensor]) -> dict:
    """Top-1 agreement and the logit error per position relative to ref's largest |logit|; the disagreements'
    ref margin (top-1 - top-2, relative likewise), against the median margin: are they close calls?"""
    errs = sorted(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, ref))
    margin = [((t := b.topk(2).values)[0] - t[1]).item() / b.abs().max().item() for b in ref]
    flips = sorted(m for a, b, m in zip(got, ref, margin) if int(a.argmax()) != int(b.argmax()))
    n = len(ref)
    return {
        "top1_agreement": round(1 - len(flips) / n, 4),
        "logit_err_median": errs[n // 2],
        "logit_err_p90": errs[int(0.9 * (n - 1))],
        "logit_err_max": errs[-1],
        "disagreements_ref_margin_median": flips[len(flips) // 2] if flips else None,
        "ref_margin_median": sorted(margin)[n // 2],
    }


def run_checkpoint(path: str, hf, ps, steps: int, stored_fp8: bool, hf32=None) -> dict:
    """afd on the checkpoint at `path` under each method, and HF `hf` with the same scheme simulated, against
    HF `hf` teacher-forced on its own greedy tokens; `hf32` (HF on the weights before FP8): how far the FP8
    format's own weight rounding moves the same logits, HF against HF."""
    t0 = time.time()
    ids = hf_greedy(hf, ps, steps)
    ref_routes: list = []
    with routes(hf, ref_routes):
        ref = hf_teacher_forced(hf, ps, ids)
    rec: dict = {"positions": len(ref), "hf_seconds": round(time.time() - t0, 1), "methods": {}}
    if hf32 is not None:
        got_routes: list = []
        with routes(hf32, got_routes):
            rec["hf_fp32_vs_hf_dequantized"] = agreement(hf_teacher_forced(hf32, ps, ids), ref)
        rec["hf_fp32_vs_hf_dequantized"]["routing_changed"] = routing_changed(got_routes, ref_routes)
    for method in METHODS:
        t0 = time.time()
        llm, got = afd_teacher_forced(path, method, ps, ids)
        r = {"afd_vs_hf": agreement(got, ref)}
        if method == "w8a16":
            greedy = llm.generate_ids(ps, steps, ignore_eos=True)
            r["greedy_identical"] = greedy == ids
            r["greedy_identical_prompts"] = f"{sum(a == b for a, b in zip(greedy, ids))}/{len(ids)}"
        sim_routes: list = []
        with simulated(hf, method, stored_fp8), routes(hf, sim_routes):
            sim = hf_teacher_forced(hf, ps, ids)
        r["hf_simulated_vs_hf"] = agreement(sim, ref)
        r["hf_simulated_vs_hf"]["routing_changed"] = routing_changed(sim_routes, ref_routes)
        if method != "w8a16":  # the scheme's error less its route changes: the same, routed as HF routed
            with simulated(hf, method, stored_fp8), routes(hf, [], replay=ref_routes):
                r["hf_simulated_routes_frozen_vs_hf"] = agreement(hf_teacher_forced(hf, ps, ids), ref)
        r["afd_vs_hf_simulated"] = agreement(got, sim)
        r["seconds"] = round(time.time() - t0, 1)
        rec["methods"][method] = r
        print(f"  {method}: " + json.dumps({k: v for k, v in r.items()}), flush=True)
    return rec


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="docs/bench/quant-accuracy.json")
    ap.add_argument("--families", default=",".join(CONFIGS))
    ap.add_argument("--weight-std", type=float, default=0.02, help="0.02: HF's initializer_range")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workdir", default=None, help="keep the checkpoints here (default: a temporary dir)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    import transformers

    report: dict = {
        "command": " ".join(["python bench/quant_accuracy.py", *(argv if argv is not None else sys.argv[1:])]),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": f"{cpu_model()}, {a.threads} threads",
        "dtype": "float32 (afd and HF)",
        "weights": f"random, made by HF transformers: every weight N(0, {a.weight_std}), norms N(1, 0.1), "
        "e_score_correction_bias N(0, 0.05)",
        "fp8_block": list(BLOCK),
        "prompts": {"lengths": list(PROMPT_LENS), "seed": 0, "tokens_per_prompt": a.steps},
        "logit_err": "per position, max over the vocabulary of |got - ref| over ref's largest |logit|",
        "families": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        root = a.workdir or tmp
        for family in a.families.split(","):
            cfg = CONFIGS[family]
            ps = prompts(cfg["vocab_size"])
            src = make_checkpoint(family, os.path.join(root, f"{family}-fp32"), a.weight_std)
            fp8 = write_fp8_checkpoint(src, os.path.join(root, f"{family}-fp8"), BLOCK)
            hf32, hfd = hf_fp32_model(src), hf_dequantized_model(fp8)
            rec: dict = {"config": cfg}
            print(f"{family}: the FP8 checkpoint against HF's dequantized load", flush=True)

            rec["fp8_checkpoint"] = run_checkpoint(fp8, hfd, ps, a.steps, True, hf32)
            print(f"{family}: the fp32 checkpoint, quantized at load, against HF fp32", flush=True)
            rec["fp32_checkpoint"] = run_checkpoint(src, hf32, ps, a.steps, False)
            report["families"][family] = rec
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)
        f.write("\n")
    print(a.out)
    return report


if __name__ == "__main__":
    main()
