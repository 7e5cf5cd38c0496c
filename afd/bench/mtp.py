"""`afd bench-mtp`: MTP speculative decoding on vs off: decode tok/s, tokens per step and the
acceptance rate with speculative_tokens 0, 1 and 2, colocated and at 1A1F, side by side in one run.

Every mode runs the same job (B prompts of L tokens, S new tokens each, greedy, EOS ignored) on the same
checkpoint; modes are interleaved over --repeats rounds with the order rotating each round (as `afd
bench-step`), and each figure is a median over rounds. Greedy speculative decoding is lossless, so every
mode must produce the same tokens: the run checks that and fails if they differ.

The checkpoint must carry an MTP module whose drafts are often right, or there is nothing to measure.
Without --model the bench writes one (`build_mtp_checkpoint`): a LongCat-Flash-shaped model at bench size
(afd.bench.step.BENCH_CONFIG) with random weights, made so that its drafts are accepted often *by
construction* (the same recipe as tests/hf_mtp.py's add_mtp): the main model's output projections
(o_proj, every down_proj) are scaled by `damp`, so that its next token depends mostly on the last token
alone, and the MTP module's eh_proj is [I, 0] plus `noise` times random weights with its block's output
projections `noise` times random, so that its draft is mostly lm_head(norm(embed(next token))): the main
model's own answer after that token. Every path of both stays in play (attention, MLPs, MoE, the MTP
block), so the work per step is a real model's; the acceptance rate is not one a trained model would
give, and the bench prints it measured.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import zlib
from typing import TYPE_CHECKING

from afd.bench.common import count_flag, interleaved, synthetic_prompts
from afd.bench.step import BENCH_CONFIG
from afd.config.flags import DefaultsHelpFormatter

if TYPE_CHECKING:
    from afd import LLM

PLACEMENTS = ("colocated", "1A1F")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "bench-mtp",
        help="MTP speculative decoding on vs off: decode tok/s, tokens per step",
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument(
        "--model",
        default=None,
        help="a checkpoint with an MTP module (default: build one whose drafts are accepted often)",
    )
    p.add_argument(
        "--config",
        default=None,
        help="config.json of the LongCat-Flash model to build (default: afd.bench.step's BENCH_CONFIG)",
    )
    p.add_argument("--batch-sizes", default="1,8", help="comma-separated decode batch sizes B")
    count_flag(p, "--prompt-len", 32, 1, "prompt tokens L")
    count_flag(p, "--decode-tokens", 128, 1, "new tokens S per prompt")
    p.add_argument("--speculative-tokens", default="0,1,2", help="comma-separated N (0: MTP off, the baseline)")
    p.add_argument(
        "--placements", default=",".join(PLACEMENTS), help="comma-separated subset of: " + ", ".join(PLACEMENTS)
    )
    count_flag(p, "--repeats", 3)
    p.add_argument("--noise", type=float, default=0.03, help="built checkpoint: the MTP module's random share")
    p.add_argument(
        "--damp",
        type=float,
        default=0.02,
        help="built checkpoint: scale of the main model's output projections (0: drafts always right)",
    )
    p.add_argument("--output", default=None, help="write the results as JSON here")
    p.set_defaults(func=run)


# ---- the checkpoint ---------------------------------------------------------------------------------


def _checkpoint_keys(cfg) -> dict[str, tuple[int, ...]]:
    """Every key afd reads from a checkpoint of cfg (both halves, all experts, the MTP module) -> shape."""
    from afd.model.meta import on_meta
    from afd.model.mtp import family_mtp
    from afd.model.registry import family

    fam = family(cfg.model_type)
    names = fam.name_map
    with on_meta():
        parts = [
            (fam.attention_half(cfg), names.attention_weights),
            (fam.ffn_half(cfg), names.ffn_weights),
            (family_mtp(cfg).build(cfg), names.mtp_weights),
        ]
    return {key: shape for model, weights in parts for w in weights(model) for key, shape in w.sources}


def _output_projection(key: str) -> bool:
    return key.endswith("o_proj.weight") or key.endswith("down_proj.weight")


def build_mtp_checkpoint(
    dst: str, config: dict | None = None, noise: float = 0.03, damp: float = 0.02, seed: int = 0
) -> str:
    """A LongCat-Flash checkpoint at `dst` (config.json + model.safetensors, the hub's key names) with random
    weights and an MTP module whose drafts are right most of the time by construction (module docstring).
    Weights are N(0, 1/hidden), so that a layer keeps its input's scale, the embeddings N(0, 1) (the scale
    of normed activations), norms near 1; noise = damp = 1 is a model and MTP module both fully random."""
    import torch
    from safetensors.torch import save_file

    from afd.model.registry import config_from_hf

    config = dict(BENCH_CONFIG if config is None else config)
    cfg = config_from_hf(config)
    if cfg.model_type != "longcat_flash":
        raise ValueError(f"bench-mtp builds LongCat-Flash checkpoints; got model_type {cfg.model_type!r}")
    H = cfg.hidden_size
    std = H**-0.5

    def randn(key: str, shape) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
        return torch.randn(shape, generator=g)

    tensors = {}
    for key, shape in _checkpoint_keys(cfg).items():
        t = randn(key, shape)
        mtp = key.startswith("model.mtp.")
        if "norm" in key:  # near 1; the MTP module's enorm and hnorm nearer, by `noise`
            tensors[key] = 1.0 + 0.1 * (noise if key.endswith(("enorm.m.weight", "hnorm.m.weight")) else 1.0) * t
        elif key.endswith("e_score_correction_bias"):
            tensors[key] = 0.05 * t
        elif key.endswith("eh_proj.weight"):  # [H, 2H]: the embedding of the next token, mostly
            eye = torch.cat([torch.eye(H), torch.zeros(H, H)], dim=1)
            tensors[key] = (1 - noise) * eye + noise * std * t
        elif key == "model.embed_tokens.weight":  # rows of norm ~sqrt(H), as the normed activations
            tensors[key] = t
        else:
            tensors[key] = std * t * ((noise if mtp else damp) if _output_projection(key) else 1.0)
    # the MTP module's final norm: the main model's, nudged (its head is the main model's)
    tensors["model.mtp.norm.weight"] = tensors["model.norm.weight"] + noise * 0.1 * randn("mtp.norm", (H,))
    os.makedirs(dst, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        os.path.join(dst, "model.safetensors"),
        metadata={"format": "pt"},
    )
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return dst


# ---- the runs ---------------------------------------------------------------------------------------


class _Colocated:
    """afd.LLM colocated, one per N (its weights loaded once), run step by step for the step timings."""

    def __init__(self, model: str):
        self.model = model
        self.llms: dict[int, LLM] = {}  # speculative tokens N -> its LLM

    def run(self, n: int, prompts: list[list[int]], new_tokens: int) -> dict:
        import torch

        import afd
        from afd.engine import offline
        from afd.engine.sampling import SamplingParams

        if n not in self.llms:
            self.llms[n] = afd.LLM(self.model, speculative_tokens=n)
        llm = self.llms[n]
        per = [new_tokens] * len(prompts)
        before = torch.get_num_threads()
        torch.set_num_threads(1)  # one core, as each AFD node gets
        try:
            engine = llm.job_engine(prompts, per, speculative_tokens=n)
            steps: list[dict] = []
            out = offline.generate(
                engine, prompts, per, SamplingParams(), ignore_eos=True, on_step=lambda s: steps.append(s.report())
            )
        finally:
            torch.set_num_threads(before)
        return {"outputs": out, "steps": steps, "spec_decode": engine.spec.stats.report() if engine.spec else None}


def _run_1a1f(model: str, n: int, prompts: list[list[int]], new_tokens: int) -> dict:
    """afd.LLM(attention_nodes=1, ffn_nodes=1) on this machine; the attention node's own report (its steps)."""
    import afd
    from afd.cluster.local import run_generate
    from afd.engine.sampling import SamplingParams

    llm = afd.LLM(model, attention_nodes=1, ffn_nodes=1, speculative_tokens=n)
    out, reports = run_generate(llm.cluster, prompts, [new_tokens] * len(prompts), SamplingParams(), ignore_eos=True)
    return {"outputs": out, "steps": reports[0]["steps"], "spec_decode": reports[0].get("spec_decode")}


def summarize(job: dict) -> dict:
    """Decode figures of one run. Step 0 prefills every prompt (and samples each one's first token); the
    decode steps are the rest, each timed with the drafting that follows it (the MTP module's pass)."""
    steps = job["steps"]
    decode = steps[1:]
    seconds = sum(s["seconds"] + s.get("draft_seconds", 0.0) for s in decode)
    draft = sum(s.get("draft_seconds", 0.0) for s in decode)
    tokens = sum(s["generated"] for s in decode)
    spec = job["spec_decode"]
    drafts, drafted, accepted = (
        (spec["num_drafts"], spec["num_draft_tokens"], spec["num_accepted_tokens"]) if spec else (0, 0, 0)
    )
    return {
        "decode_tok_s": tokens / seconds if seconds else 0.0,
        "decode_tokens": tokens,
        "decode_steps": len(decode),
        "step_ms": 1e3 * seconds / max(1, len(decode)),
        "draft_share": draft / seconds if seconds else 0.0,
        "tokens_per_step": 1 + accepted / drafts if drafts else 1.0,
        "acceptance": accepted / drafted if drafted else None,
        "num_drafts": drafts,
        "num_draft_tokens": drafted,
        "num_accepted_tokens": accepted,
        "accepted_per_pos": spec["num_accepted_tokens_per_pos"] if spec else [],
        "prefill_tokens": steps[0]["tokens"] if steps else 0,
    }


def mode_name(batch: int, placement: str, n: int) -> str:
    return f"B={batch} {placement} " + (f"MTP {n}" if n else "MTP off")


def _ints(text: str, what: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what}: comma-separated integers, got {text!r}") from None


def run(args) -> int:
    from afd.model.mtp import check_speculative_tokens

    batches = _ints(args.batch_sizes, "--batch-sizes")
    ns = _ints(args.speculative_tokens, "--speculative-tokens")
    placements = [p.strip() for p in args.placements.split(",") if p.strip()]
    for n in ns:
        check_speculative_tokens(n)
    if 0 not in ns:
        ns = [0, *ns]  # the baseline every speedup is against
    unknown = [p for p in placements if p not in PLACEMENTS]
    if unknown or not placements:
        raise ValueError(f"unknown placement(s) {unknown}; choose from {list(PLACEMENTS)}")
    if not batches or min(batches) < 1 or args.prompt_len < 1 or args.decode_tokens < 2 or args.repeats < 1:
        raise ValueError("need batch sizes >= 1, --prompt-len >= 1, --decode-tokens >= 2, --repeats >= 1")
    modes = {mode_name(b, p, n): (b, p, n) for b in batches for p in placements for n in ns}
    with tempfile.TemporaryDirectory() as tmp:
        model, built = args.model, args.model is None
        if built:
            config = None
            if args.config:
                with open(args.config) as f:
                    config = json.load(f)
            model = build_mtp_checkpoint(os.path.join(tmp, "ckpt"), config, args.noise, args.damp)
            print(
                f"built a LongCat-Flash checkpoint with an MTP module made to be accepted often "
                f"(noise {args.noise}, damp {args.damp}; afd.bench.mtp.build_mtp_checkpoint)",
                flush=True,
            )
        from afd.model.registry import load_config

        vocab = load_config(model).vocab_size
        prompts = synthetic_prompts(max(batches), args.prompt_len, vocab)
        colocated = _Colocated(model)
        outputs: dict[str, list] = {}

        def one(name: str, _round: int) -> dict:
            b, placement, n = modes[name]
            job = (
                colocated.run(n, prompts[:b], args.decode_tokens)
                if placement == "colocated"
                else _run_1a1f(model, n, prompts[:b], args.decode_tokens)
            )
            outputs.setdefault(name, []).append(job["outputs"])
            s = summarize(job)
            acc = "" if s["acceptance"] is None else f", acceptance {100 * s['acceptance']:.0f}%"
            print(f"  {name}: {s['decode_tok_s']:.1f} tok/s, {s['tokens_per_step']:.2f} tokens/step{acc}", flush=True)
            return s

        rounds = interleaved(list(modes), args.repeats, one, log=lambda line: print(line, flush=True))
    # greedy speculative decoding is lossless: every mode of a batch size, every round, the same tokens
    mismatched = []
    for b in batches:
        names = [m for m, (bb, _, _) in modes.items() if bb == b]
        want = outputs[names[0]][0]
        mismatched += [m for m in names if any(o != want for o in outputs[m])]
    identical = not mismatched
    keys = ("decode_tok_s", "step_ms", "draft_share")
    results = {m: {**v[-1], **{k: statistics.median(x[k] for x in v) for k in keys}} for m, v in rounds.items()}
    for m, (b, p, n) in modes.items():
        # vs MTP off: the ratio within each round (its runs are close in time, so a load change on a shared
        # machine hits both), then the median over rounds
        base = rounds[mode_name(b, p, 0)]
        for x, y in zip(rounds[m], base):
            x["speedup"] = x["decode_tok_s"] / y["decode_tok_s"] if y["decode_tok_s"] else None
        ratios = [x["speedup"] for x in rounds[m] if x["speedup"] is not None]
        results[m].update(
            batch=b, placement=p, speculative_tokens=n, speedup=statistics.median(ratios) if ratios else None
        )
    drafted = [r for r in results.values() if r["num_draft_tokens"]]
    acceptance = (
        sum(r["num_accepted_tokens"] for r in drafted) / sum(r["num_draft_tokens"] for r in drafted)
        if drafted
        else None
    )
    _print_table(args, model if not built else None, results, acceptance)
    print(
        "tokens: identical across every mode and round of each batch size (greedy MTP is lossless): checked"
        if identical
        else f"MISMATCH: these modes generated other tokens than MTP off: {mismatched}"
    )
    if args.output:
        with open(args.output, "w") as f:
            json.dump(
                {
                    "config": vars(args) | {"func": None},
                    "checkpoint": "built" if built else args.model,
                    "acceptance": acceptance,
                    "tokens_identical": identical,
                    "results": results,
                    "rounds": rounds,
                },
                f,
                indent=2,
            )
    return 0 if identical else 1


def _print_table(args, model: str | None, results: dict, acceptance: float | None) -> None:
    what = model or f"built LongCat-Flash checkpoint (noise {args.noise}, damp {args.damp})"
    print(
        f"\n{what}: prompt {args.prompt_len}, {args.decode_tokens} new tokens per prompt, greedy, EOS ignored, "
        f"median of {args.repeats} rounds (vs MTP off: of each round's ratio); colocated: 1 process, 1 thread; "
        f"1A1F: 2 processes, 1 thread each; "
        f"{os.cpu_count()} CPU cores"
    )
    if acceptance is not None:
        how = (
            "; the checkpoint's MTP head is built to be accepted often: by construction, not trained"
            if model is None
            else ""
        )
        print(
            f"MTP acceptance, measured: {100 * acceptance:.1f}% of draft tokens{how}. "
            "Tokens per step = 1 + accepted / drafts"
        )
    print(
        "| batch | placement | MTP | decode tok/s | vs MTP off | tokens / step | acceptance | decode steps "
        "| ms / decode step | drafting share |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results.values():
        n = r["speculative_tokens"]
        acc = "-" if r["acceptance"] is None else f"{100 * r['acceptance']:.1f}%"
        speed = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        print(
            f"| {r['batch']} | {r['placement']} | {'off' if n == 0 else f'N={n}'} | {r['decode_tok_s']:.1f} "
            f"| {speed} | {r['tokens_per_step']:.2f} | {acc} | {r['decode_steps']} | {r['step_ms']:.2f} "
            f"| {100 * r['draft_share']:.0f}% |"
        )
