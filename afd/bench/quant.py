"""`afd bench-quant`: quantized serving, every figure side by side in one run.

Sections (--sections):
  decode  decode tok/s per mode (fp32, bf16, w8a8, fp8; --modes) at each batch, colocated (both halves in
          this process, one thread) and 1A1F (one thread per node), and HF transformers `generate` in bf16
          (and fp32: --hf-dtypes) on the same checkpoint, on 1 and 2 threads (--hf-threads; two are the cores
          1A1F's nodes get, but HF's OpenMP threads stall when other work holds a core); interleaved rounds,
          order rotating, medians; "vs HF's fastest" is against HF's fastest case at each batch;
  gemm    per-GEMM times at one batch (--gemm-tokens) per mode: each linear of the attention half's first
          layer, the head, the first MoE layer's grouped GEMMs, one expert's call, and the whole FFN half
          (afd.bench.quant_parts); with decode, the step bounds A, F and max(A, F) (afd.bench.quant_report);
  memory  the FFN node's resident memory per mode (afd.bench.quant_mem), on the bench model and on a model
          large enough that its weights dominate the runtime (MEMORY_CONFIG, dummy weights);
  wire    bytes per decode step on the wire for each layout.exchange_dtype, counted by the attention node
          (the count afd_exchange_bytes_total exports) against afd.dataplane.protocol.exchange_bytes.

The checkpoint: --model, or the bench model (afd bench-step's BENCH_CONFIG as an HF LongCat-Flash config)
written with random weights as safetensors, which afd and HF both load. A --model holding only config.json
runs on dummy weights, without HF.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

from afd.bench import quant_mem
from afd.bench import quant_parts as parts
from afd.bench.common import Colocated, count_flag, interleaved, median, synthetic_prompts
from afd.config.flags import DefaultsHelpFormatter

MODES = {
    # name: (model.dtype, model.quantization)
    "fp32": ("float32", None),
    "bf16": ("bfloat16", None),
    "w8a8": ("float32", "w8a8"),
    "fp8": ("float32", "fp8"),
    "w8a16": ("float32", "w8a16"),
    "w8a8 bf16": ("bfloat16", "w8a8"),
}
DEFAULT_MODES = ("fp32", "bf16", "w8a8", "fp8")
HF_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
SECTIONS = ("decode", "gemm", "memory", "wire")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "bench-quant",
        help="quantized serving: decode tok/s, FFN memory, wire bytes",
        formatter_class=DefaultsHelpFormatter,
    )
    p.add_argument("--model", default=None, help="checkpoint dir (default: the bench model, random weights)")
    p.add_argument("--modes", default=",".join(DEFAULT_MODES), help="comma-separated subset of: " + ", ".join(MODES))
    p.add_argument("--topologies", default="colocated,1A1F", help="comma-separated subset of: colocated, 1A1F")
    p.add_argument("--batches", default="1,16,64")
    count_flag(p, "--prompt-len", 32)
    count_flag(p, "--steps", 16, 1, "decode steps measured per run (after --warmup-steps)")
    count_flag(p, "--warmup-steps", 2, 0)
    count_flag(p, "--repeats", 3, 1, "interleaved rounds")
    p.add_argument("--no-hf", action="store_true", help="leave HF transformers out")
    p.add_argument("--hf-threads", default="1,2", help="torch threads HF generate runs on, one case each")
    p.add_argument("--hf-dtypes", default="bf16", help="dtypes HF generate runs in, one case each: bf16, fp32")
    count_flag(p, "--gemm-tokens", 16)
    p.add_argument("--memory-model", default=None, help="model dir for the memory section (default: MEMORY_CONFIG)")
    p.add_argument("--wire-mode", default="w8a8", help="the mode the wire section's 1A1F runs serve")
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset of: " + ", ".join(SECTIONS))
    p.add_argument("--output", default=None, help="write the results as JSON here")
    p.set_defaults(func=run)


class _Colocated(Colocated):
    """Colocated with the mode's dtype and quantization."""

    def __init__(self, path: str, dummy: bool, dtype: str, method: str | None):
        from afd import LLM

        self.llm = LLM(path, dummy_weights=dummy, dtype=dtype, quantization=method)
        self.cfg, self.backend, self.attn, self.ffn = self.llm.cfg, self.llm.backend, self.llm.attn, self.llm.ffn

    def evidence(self) -> str:
        """The experts' storage dtype and how many attention linears run quantized."""
        from afd.model.quant_layers import QuantLinear

        w13 = self.ffn.layer(self.cfg.moe_layers[0]).experts.w13
        n = sum(isinstance(m, QuantLinear) for m in self.attn.modules())
        return f"experts {str(w13.dtype).removeprefix('torch.')}, {n} quantized attention linears"


def _checkpoint(args, tmp: str) -> tuple[str, bool]:
    """(path, dummy): --model, or the bench model written as an HF checkpoint with random weights."""
    if args.model is not None:
        dummy = not any(f.endswith(".safetensors") for f in os.listdir(args.model))
        return args.model, dummy
    from afd.bench.suite import HF_CONFIG
    from afd.model.demo import write_checkpoint

    path = os.path.join(tmp, "bench-ckpt")
    write_checkpoint(path, HF_CONFIG, seed=0)
    return path, False


def section_decode(args, path: str, dummy: bool, state: dict) -> dict:
    modes, batches, topos = state["modes"], state["batches"], state["topologies"]
    n = args.steps + args.warmup_steps + 1  # tokens per sequence: the prefill's, then the decode steps'
    vocab = state["colo"][modes[0]].cfg.vocab_size if "colocated" in topos else 97
    prompts = {b: synthetic_prompts(b, args.prompt_len, vocab) for b in batches}
    evidence = {f"colocated {m}": c.evidence() for m, c in state["colo"].items()}
    evidence |= {f"1A1F {m}": parts.ffn_evidence(c) for m, c in state["clusters"].items()}
    hf = {}
    if not args.no_hf and not dummy:
        import torch

        from afd.bench.suite import _HF

        for name in args.hf_dtypes.split(","):
            if name not in HF_DTYPES:
                raise ValueError(f"--hf-dtypes: {name!r} is none of {', '.join(HF_DTYPES)}")
            hf[name] = _HF(path)
            hf[name].model.to(getattr(torch, HF_DTYPES[name]))
            hf[name].generate(prompts[batches[0]], 2, 2)  # warm-up

    cases = {f"{t} {m} b={b}": (t, m, b) for t in topos for m in modes for b in batches}
    threads = [int(t) for t in args.hf_threads.split(",")] if hf else []
    cases |= {f"HF {d} {t}t b={b}": ("HF", (d, t), b) for d in hf for t in threads for b in batches}

    def one(name: str, r: int) -> dict:
        topo, mode, b = cases[name]
        if topo == "HF":
            model, t = hf[mode[0]], mode[1]
            _, t_n = model.generate(prompts[b], n, threads=t)
            _, t_1 = model.generate(prompts[b], 1, threads=t)
            return {"tok_s": b * (n - 1) / (t_n - t_1), "step_ms": 1e3 * (t_n - t_1) / (n - 1)}
        if topo == "colocated":
            return parts.tok_s(state["colo"][mode].generate(prompts[b], n, threads=1).steps, args.warmup_steps)
        _, reports = state["clusters"][mode].generate(prompts[b], n, ignore_eos=True)
        return parts.tok_s(reports[0]["steps"], args.warmup_steps) | {"a2f_bytes": reports[0]["a2f_bytes"]}

    rounds = interleaved(list(cases), args.repeats, one, lambda s: print(f"  .. {s}", flush=True))
    results = {
        k: {f: median(x.get(f, 0.0) for x in v) for f in ("tok_s", "step_ms", "ffn_wait")} for k, v in rounds.items()
    }
    per_round = {  # each round's tok/s over fp32's in the same round, the same topology and batch
        k: [x["tok_s"] / y["tok_s"] for x, y in zip(v, rounds[f"{t} fp32 b={b}"])]
        for k, v in rounds.items()
        for t, _, b in [cases[k]]
        if f"{t} fp32 b={b}" in rounds
    }
    return {
        "results": results,
        "rounds": rounds,
        "vs_fp32_per_round": per_round,
        "quantization": evidence,
        "new_tokens": n,
    }


def section_gemm(args, state: dict) -> dict:
    probes = {m: parts.gemm_probes(c.llm, args.gemm_tokens) for m, c in state["colo"].items()}
    rounds = interleaved(list(probes), args.repeats, lambda m, r: {k: parts.time_call(f) for k, f in probes[m].items()})
    return {
        "tokens": args.gemm_tokens,
        "results_ms": {m: {k: 1e3 * median(x[k] for x in v) for k in v[0]} for m, v in rounds.items()},
    }


def _setup(args, path: str, dummy: bool, sections: list[str]) -> dict:
    modes = [m.strip() for m in args.modes.split(",")]
    topos = [t.strip() for t in args.topologies.split(",")]
    bad = [m for m in modes if m not in MODES] + [t for t in topos if t not in ("colocated", "1A1F")]
    if bad:
        raise ValueError(f"unknown mode(s) or topologies {bad}; modes: {list(MODES)}, topologies: colocated, 1A1F")
    state: dict[str, Any] = {"modes": modes, "topologies": topos, "batches": [int(b) for b in args.batches.split(",")]}
    state |= {"colo": {}, "clusters": {}, "node_rss": {}}
    if "colocated" in topos or "gemm" in sections:
        for m in modes:
            state["colo"][m] = colo = _Colocated(path, dummy, *MODES[m])
            colo.generate([[3, 4, 5, 6]], 2, threads=1)  # quantizes the attention linears (the engine factory)
    if "decode" in sections and "1A1F" in topos:
        for m in modes:
            print(f"  .. starting 1A1F {m}", flush=True)
            state["clusters"][m] = cluster = parts.start_cluster(path, *MODES[m], dummy)
            cluster.generate([[3, 4, 5, 6]], 2, ignore_eos=True)  # loaded and warm
            state["node_rss"][m] = {"node_rss": quant_mem.rss(cluster.process("ffn0").pid)["rss"]}
    return state


def run(args) -> int:
    from afd.bench import quant_report

    sections = [s.strip() for s in args.sections.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        path, dummy = _checkpoint(args, tmp)
        state = _setup(args, path, dummy, sections)
        res: dict = {"checkpoint": "dummy weights" if dummy else "safetensors, random weights (afd and HF)"}
        try:
            if "decode" in sections:
                res["decode"] = section_decode(args, path, dummy, state)
        finally:
            for c in state["clusters"].values():
                c.close()
        if "gemm" in sections:
            res["gemm"] = section_gemm(args, state)
        if "memory" in sections:
            res["memory"] = quant_mem.section_memory(args, path, dummy, state, tmp, MODES)
        if "wire" in sections:
            res["wire"] = parts.section_wire(args, path, dummy, MODES)
    from afd.backend.kernel_choice import environment

    env = environment()  # the nodes' choices too: a machine's processes share the kernel cache
    res["machine"] = {k: env[k] for k in ("cpu", "cpu_flags", "torch", "int_mm_exact", "kernel_cache")}
    res["kernels"] = env["kernels"]
    quant_report.print_all(res, state)
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"config": vars(args) | {"func": None}} | res, f, indent=1)
    return 0
