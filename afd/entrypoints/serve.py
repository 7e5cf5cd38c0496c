"""`afd serve MODEL`: one command, as `vllm serve MODEL` — a local cluster for a checkpoint directory
(or `demo`), 1A1F unless told otherwise, or both halves in one process with `--colocated`.

It writes the cluster YAML that `afd launch` would take (127.0.0.1, free internal ports, HTTP ports
from `--port` up) into a private temporary directory and launches it; `--print-config` shows it.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

from afd.cluster.vllm_flags import add_vllm_flags
from afd.config.flags import DefaultsHelpFormatter, add_config_flags, add_flags, config_argv, overrides_of


def add_parser(sub) -> None:
    p = sub.add_parser(
        "serve", help="serve a model on a local cluster (as `vllm serve MODEL`)", formatter_class=DefaultsHelpFormatter
    )
    p.add_argument("model", help="HF checkpoint directory, or `demo` (the built-in demo checkpoint)")
    add_flags(p, "attention_nodes", "ffn_nodes", "colocated", "port", "device", "host", "api_key")
    p.add_argument("--print-config", action="store_true", help="print the cluster YAML, run nothing")
    add_config_flags(p, exclude=("model",))
    add_vllm_flags(p)
    p.set_defaults(func=run)


def serve_config(args):
    """The cluster config of `afd serve`'s flags: 127.0.0.1, free internal ports, HTTP ports from --port up."""
    from afd.cluster.local_config import local_config

    A = args.attention_nodes or 1
    F = 0 if args.colocated else (1 if args.ffn_nodes is None else args.ffn_nodes)
    sections = overrides_of(args)
    sections["model"] = {**sections.get("model", {}), "path": args.model}
    return local_config(A, F, sections, name="serve", device=_device(args.device), http_port=args.port or 8000)


def _device(kind: str) -> str:
    if kind != "auto":
        return kind
    from afd.backend import resolve_device

    return resolve_device("auto")


def run(args) -> int:
    if args.colocated and (args.attention_nodes or args.ffn_nodes is not None):
        raise ValueError("--colocated runs both halves in one process; it takes no --attention-nodes or --ffn-nodes")
    if args.model != "demo" and not os.path.isfile(os.path.join(args.model, "config.json")):
        from afd.model.hub import checkpoint_dir, is_hub_name

        if not is_hub_name(args.model) or os.path.exists(args.model):
            raise ValueError(f"{args.model}: not a checkpoint directory (no config.json), and not `demo`")
        checkpoint_dir(args.model, args.revision, args.download_dir)  # fetched once here, found by every node
    from afd.backend import check_device

    check_device(args.device)
    if args.colocated and (args.attention_tp or 1) == 1:
        from afd.config.tp import TPConfig

        # --kvp or --tp-comm without TP ranks: refused here (TPConfigError names the flag's key), not dropped
        TPConfig(1, args.tp_comm or "allreduce", args.flashcomm2_otp, args.tp_comm_min_tokens, args.kvp or 1)
        return _exec_colocated(args)
    cfg = serve_config(args)
    if args.print_config:
        print(cfg.to_yaml(), end="")
        return 0
    check_device_count(cfg)
    from afd.entrypoints import launch

    tmp = tempfile.mkdtemp(prefix="afd-serve-")  # mode 0700: the YAML is this user's
    try:
        path = os.path.join(tmp, "cluster.yaml")
        with open(path, "w") as f:
            f.write(cfg.to_yaml())
        args.config = path
        args.model, args.port, args.print_commands, args.curl_example = None, None, False, True
        return launch.run(args)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check_device_count(cfg) -> None:
    """Every process on a device of its own (local_config): refused in one line when this machine has fewer
    devices than that, before anything starts."""
    from afd.backend import DeviceUnavailable, check_devices

    try:
        check_devices(p.device for p in cfg.processes)
    except DeviceUnavailable as e:
        A, G, F = len(cfg.attention_nodes), cfg.layout.attention_tp, len(cfg.ffn_nodes)
        attention = f"{A} attention node{'s' if A > 1 else ''}" + (f" of {G} TP ranks" if G > 1 else "")
        ffn = f" and {F} FFN node{'s' if F > 1 else ''}" if F else ""
        raise DeviceUnavailable(
            f"{e}; afd serve gives every process its own device: {attention}{ffn} need{'' if ffn or A > 1 else 's'} "
            f"{A * G + F}"
        ) from None


def _exec_colocated(args) -> int:
    """Replaces this process with the colocated server: one process, as the flag promises."""
    argv = [sys.executable, "-m", "attention_node.main", "colocated", "--model", args.model]
    argv += ["--device", args.device, "--port", str(args.port or 8000)]
    argv += (["--host", args.host] if args.host else []) + config_argv(args, exclude=("model",))
    if args.print_config:
        print(" ".join(argv[1:]))
        return 0
    from afd.cluster.token import api_key

    key = api_key(args)  # the key travels in the environment, never on the command line
    if key:
        os.environ["AFD_API_KEY"] = key
    sys.stdout.flush()
    os.execv(sys.executable, argv)
    return 0  # not reached
