"""Command-line flags shared by afd's commands: the overrides of a cluster YAML that `afd launch`,
`afd serve` and the node commands take, with the names and meanings vLLM users know, and how --help
shows defaults."""

from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Every option's default in --help, unless its help already says it or there is none to show."""

    @staticmethod
    def _shows(default) -> bool:  # identity checks: 0 and 0.0 equal False, yet are defaults worth showing
        return not (default is None or default is False or default is argparse.SUPPRESS)

    def add_argument(self, action):
        if action.help is None and action.option_strings and self._shows(action.default):
            action.help = "(default: %(default)s)"  # argparse prints no line at all for an option without help
        super().add_argument(action)

    def _get_help_string(self, action):
        text = action.help or ""
        if not action.option_strings or "default" in text or not self._shows(action.default):
            return text
        return f"{text} (default: %(default)s)".lstrip()


def parse_bytes_arg(text: str) -> int:
    """A size as the YAML writes it: 268435456, 256MiB, 1GiB."""
    from afd.cluster.config import ClusterConfigError, parse_bytes

    try:
        return parse_bytes("command line", "size", int(text) if text.isdigit() else text)
    except ClusterConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def speculative_count(text: str) -> int:
    """--speculative-tokens: 0 (off), 1 or 2 MTP draft tokens per step."""
    value = int(text)
    if value not in (0, 1, 2):
        raise argparse.ArgumentTypeError(f"must be 0 (off), 1 or 2, got {value}")
    return value


def add_speculative_arg(p) -> None:
    p.add_argument(
        "--speculative-tokens",
        type=speculative_count,
        default=None,
        metavar="N",
        help="MTP speculative decoding: N = 1 or 2 draft tokens per step from the checkpoint's "
        "multi-token-prediction module (the YAML's engine.speculative_tokens; default: off)",
    )


def add_graph_mode_arg(p) -> None:
    p.add_argument(
        "--graph-mode",
        default=None,
        choices=["eager", "compile"],
        help="decode steps' attention layers as compiled graphs per batch bucket (layout.graph_mode; "
        "default: the device backend's, chosen by measurement)",
    )


def add_serving_overrides(p: argparse.ArgumentParser) -> None:
    """The flags `vllm serve` users know, with vLLM's names and meanings (`afd launch` and `afd serve`)."""
    g = p.add_argument_group("serving (override the YAML)")
    g.add_argument(
        "--host", default=None, help="address the attention nodes' HTTP APIs listen on (default: each node's YAML host)"
    )
    g.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1 routes (or AFD_API_KEY)")
    g.add_argument("--served-model-name", default=None, help="the model's name in the API and metrics")
    g.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="weights and activations (default: the YAML's; float32 for `afd serve`)",
    )
    g.add_argument("--max-model-len", type=positive_int, default=None, help="context limit of a request")
    g.add_argument("--max-num-seqs", type=positive_int, default=None, help="sequences per step")
    g.add_argument("--chat-template", default=None, help="a Jinja chat template, or a file holding one")
    g.add_argument("--seed", type=int, default=None, help="seed of unseeded requests' random sampling")
    add_speculative_arg(g)
    add_graph_mode_arg(g)


def add_tp_args(p: argparse.ArgumentParser) -> None:
    """Attention-side tensor parallelism (the YAML's layout.attention_tp / tp_comm / flashcomm2_otp /
    tp_comm_min_tokens; afd.model.tp)."""
    g = p.add_argument_group("attention tensor parallelism (override the YAML's layout)")
    g.add_argument(
        "--attention-tp",
        type=positive_int,
        default=None,
        help="processes (ranks) per attention node, one device each (default: 1)",
    )
    g.add_argument(
        "--tp-comm",
        default=None,
        choices=["allreduce", "sp", "flashcomm1", "flashcomm2"],
        help="how TP ranks combine row-parallel results (default: allreduce)",
    )
    g.add_argument(
        "--flashcomm2-otp",
        type=positive_int,
        default=None,
        help="flashcomm2: the o_proj TP group size P (attention-tp > P, divisible by P)",
    )
    g.add_argument(
        "--tp-comm-min-tokens",
        type=int,
        default=None,
        help="micro-batches with fewer tokens run as allreduce (default: the seed's threshold: sp 1, "
        "flashcomm1/2 1001)",
    )
    g.add_argument(
        "--kvp",
        type=positive_int,
        default=None,
        help="KV-parallel ranks (dividing --attention-tp): the KV cache split by block across them, so "
        "the context a node holds grows that many times (default: 1)",
    )


TP_KEYS = ("attention_tp", "tp_comm", "flashcomm2_otp", "tp_comm_min_tokens", "kvp")


def tp_kwargs(args) -> dict:
    """The TP flags set on `args`, as afd.LLM / LocalClusterSpec / Layout keywords."""
    return {k: getattr(args, k) for k in TP_KEYS if getattr(args, k, None) is not None}


FOR_EVERY_NODE = ("dtype", "served_model_name", "speculative_tokens")
"""The overrides every node command takes (FFN nodes hold the MTP layer's experts with speculative_tokens)."""
FOR_ATTENTION = ("host", "max_model_len", "max_num_seqs", "chat_template", "seed", "graph_mode")
"""The overrides only attention nodes take (the API key goes through the environment instead)."""


def override_argv(args, keys: tuple[str, ...]) -> list[str]:
    """The given overrides as a node command's flags, for those set on `args`."""
    out: list[str] = []
    for key in keys:
        value = getattr(args, key, None)
        if value is not None:
            out += [f"--{key.replace('_', '-')}", str(value)]
    return out
