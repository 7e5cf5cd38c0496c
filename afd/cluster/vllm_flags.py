"""vLLM's `vllm serve` flags, as `afd serve` and `afd launch` take them: the ones afd honours under vLLM's
name (an alias of afd's own flag, with vLLM's meaning), the ones it accepts because they change nothing
here, and the ones it refuses with one line naming afd's equivalent, or saying there is none.

Names and meanings are vLLM's engine arguments (vllm/engine/arg_utils.py, EngineArgs; read, not copied).
"""

from __future__ import annotations

import argparse

ALIASES = {
    "--tensor-parallel-size": "attention_tp",
    "-tp": "attention_tp",
}
"""vLLM flag -> the dest of the afd config flag it sets, with the same value."""

ACCEPTED = {
    "--trust-remote-code": "afd runs no code from a checkpoint: its families are afd's own",
    "--disable-log-stats": "afd logs no periodic stats: its metrics are on /metrics",
    "--enable-chunked-prefill": "afd always chunks prompts to --max-num-batched-tokens",
}
"""vLLM flags (switches) that afd takes and that change nothing, and why. (vLLM's --enable-prefix-caching and
--no-enable-prefix-caching are afd's own config flag of that name: engine.enable_prefix_caching.)"""

REFUSED = {
    "--pipeline-parallel-size": None,
    "-pp": None,
    "--data-parallel-size": "--attention-nodes (each attention node is a data-parallel replica of the attention half)",
    "-dp": "--attention-nodes (each attention node is a data-parallel replica of the attention half)",
    "--enable-expert-parallel": "--ffn-nodes (the experts are split across the FFN nodes: layout.placement)",
    "--load-format": "--dummy-weights (for --load-format dummy); safetensors is the only format",
    "--kv-cache-dtype": None,
    "--swap-space": None,
    "--cpu-offload-gb": None,
    "--tokenizer": None,
    "--num-speculative-tokens": "--speculative-tokens (MTP drafts from the checkpoint's own module)",
    "--speculative-config": "--speculative-tokens (MTP drafts from the checkpoint's own module)",
    "--max-num-partial-prefills": None,
    "--uvicorn-log-level": None,
    "--compilation-config": "--graph-mode and --graph-batch-sizes",
    "--cuda-graph-sizes": "--graph-batch-sizes",
}
"""vLLM flags afd cannot honour -> afd's equivalent (None: none yet)."""


def add_vllm_flags(p: argparse.ArgumentParser) -> None:
    """vLLM's names for flags `p` already has (afd.config.flags' config flags), and vLLM's no-op switches."""
    g = p.add_argument_group("vLLM's flags (the same meaning; afd's own names above)")
    for name, dest in ALIASES.items():
        g.add_argument(name, dest=dest, type=int, default=None, metavar="N", help=f"= --{dest.replace('_', '-')}")
    g.add_argument(
        "--enforce-eager",
        dest="graph_mode",
        action="store_const",
        const="eager",
        help="= --graph-mode eager",
    )
    g.add_argument(  # vLLM 0.33 dropped it when it made request logging opt-in; scripts still pass it
        "--disable-log-requests",
        dest="enable_log_requests",
        action="store_false",
        default=None,
        help="= --no-enable-log-requests (vLLM's older flag)",
    )
    for name, why in ACCEPTED.items():
        g.add_argument(name, dest=f"vllm_{name[2:].replace('-', '_')}", action="store_true", help=f"accepted: {why}")


def refusal(extra: list[str]) -> str:
    """The error for arguments the command does not take: vLLM's flags with afd's equivalent, else argparse's."""
    lines = []
    for arg in extra:
        name = arg.split("=", 1)[0]
        if name in REFUSED:
            instead = REFUSED[name]
            lines.append(f"{name} is vLLM's; " + (f"afd's equivalent: {instead}" if instead else "afd has none"))
    if lines:
        return "; ".join(lines)
    return f"unrecognized arguments: {' '.join(extra)}"
