"""`afd launch FILE`: every node of a cluster YAML on this host, logs prefixed, one URL when ready.

A node that fails is started again with its own command, after a back-off, up to `cluster.max_restarts`
in a row (afd.cluster.supervise); past that the cluster is stopped and the launcher exits 1. SIGINT/SIGTERM
are forwarded: attention nodes first (they drain, then leave the data plane), then FFN nodes; whatever is
still alive after the grace period is killed. No child outlives the launcher.

The cluster token never travels on a command line (`ps` shows those to every user): without
AFD_CLUSTER_TOKEN, the launcher makes one in a 0600 file (afd.cluster.token) and its nodes, restarted ones
and those started by hand from `--print-commands`, read it through AFD_CLUSTER_TOKEN_FILE.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import sys

from afd.cluster.host import healthy, is_loopback, node_ports, ports_in_use
from afd.cluster.processes import MODULES, ClusterError, Command, NodeExited, NodeProcesses
from afd.cluster.supervise import RestartPolicy
from afd.cluster.token import TOKEN_ENV, TOKEN_FILE_ENV, api_key, cluster_token, launch_token_file
from afd.cluster.topology import with_http_port
from afd.cluster.vllm_flags import add_vllm_flags
from afd.config.flags import (
    DefaultsHelpFormatter,
    add_config_flags,
    add_flags,
    config_argv,
    overrides_of,
    with_overrides,
)
from afd.config.loader import load
from afd.config.schema import ClusterConfig, Node, Process

COMMANDS = {"attention": "afd-attention", "ffn": "afd-ffn"}


def add_parser(sub) -> None:
    p = sub.add_parser(
        "launch", help="start every node of a cluster YAML on this host", formatter_class=DefaultsHelpFormatter
    )
    p.add_argument("config", help="cluster YAML")
    add_flags(p, "port", "host", "api_key")
    p.add_argument("--print-commands", action="store_true", help="print the per-node commands, run nothing")
    p.add_argument("--curl-example", action="store_true", help="print a curl example once ready")
    add_config_flags(p)
    add_vllm_flags(p)
    p.set_defaults(func=run)


def node_args(cfg_path: str, node: Node, args, first_attention: str, tp_rank: int = 0) -> list[str]:
    """A node's command line (with `--tp-rank R` for an attention node's TP rank R > 0): its place in the
    YAML plus the config flags given here. The API key travels in the environment (AFD_API_KEY), never on
    a command line others can read in `ps`."""
    out = ["--config", cfg_path, "--node", node.name] + (["--tp-rank", str(tp_rank)] if tp_rank else [])
    if args.port is not None and node.name == first_attention:
        out += ["--port", str(args.port)]
    if args.host is not None and node.role == "attention":
        out += ["--host", args.host]
    return out + config_argv(args)


def run(args) -> int:
    cfg = with_http_port(with_overrides(load(args.config), overrides_of(args)), args.port)
    first = cfg.attention_nodes[0]
    plan = [(p, node_args(args.config, p.node, args, first.name, p.tp_rank)) for p in cfg.processes]
    if args.print_commands:
        env, key_args = token_env(cfg), _printed_api_key(args)
        for p, a in plan:  # the host (and device) as a shell comment: the line still pastes as it is
            dev = f", {p.device}" if p.device != "cpu" else ""
            assign = "".join(f"{k}={shlex.quote(v)} " for k, v in env.items())  # VAR=value: for this command
            a = a + key_args if p.node.role == "attention" and p.tp_rank == 0 else a
            print(f"{assign}{shlex.join([COMMANDS[p.node.role], *a])}  # on {p.node.host}{dev}")
        return 0
    check_startable(cfg, args.config)
    env = dict(os.environ)
    key = api_key(args)
    if key:
        env["AFD_API_KEY"] = key
    return _Launcher(cfg, plan, env).run(args.curl_example)


def _printed_api_key(args) -> list[str]:
    """The API key as printed commands carry it: by its file, never by value (a command line is in `ps`)."""
    if getattr(args, "api_key_file", None):
        return ["--api-key-file", os.path.abspath(args.api_key_file)]
    if getattr(args, "api_key", None):
        print("note: the printed commands carry no API key; give it as --api-key-file FILE", file=sys.stderr)
    return []


def token_env(cfg: ClusterConfig) -> dict[str, str]:
    """What printed node commands set for the cluster token: nothing with AFD_CLUSTER_TOKEN in this shell
    (the other shells need it too); the AFD_CLUSTER_TOKEN_FILE this shell names; else, for a one-host
    cluster, the 0600 file `afd launch` of the same YAML uses (made now if it is not there yet). A file on
    this host is no use to other hosts: there, nodes need their own AFD_CLUSTER_TOKEN or token file."""
    if os.environ.get(TOKEN_ENV):
        return {}
    if os.environ.get(TOKEN_FILE_ENV):
        return {TOKEN_FILE_ENV: os.path.abspath(os.environ[TOKEN_FILE_ENV])}
    if not all(is_loopback(n.host) for n in cfg.nodes):
        return {}
    path, _ = launch_token_file(cfg.cluster.name, cfg.coordinator.ports.control)
    return {TOKEN_FILE_ENV: path}


def check_startable(cfg: ClusterConfig, source: str) -> None:
    """What would make every node fail, said once here rather than as a traceback from each."""
    if cfg.model.path != "demo":
        from afd.cluster.topology import model_dir, with_model_defaults
        from afd.config.loader import check_expert_layout, check_routing, check_tp_layout
        from afd.model.registry import load_config

        mcfg = load_config(model_dir(cfg))  # a hub name is fetched here, once, before any node starts
        cfg = with_model_defaults(cfg)  # as every node will settle it (an unset routing)
        check_expert_layout(cfg, mcfg.n_routed_experts, mcfg.expert_groups[0])
        check_tp_layout(cfg, mcfg.num_attention_heads)
        check_routing(cfg, mcfg)
    from afd.backend import DeviceUnavailable, check_devices

    try:  # every process's device (a TP rank's is its node's index + r), before any process starts
        check_devices(p.device for p in cfg.processes)
    except DeviceUnavailable as e:
        raise DeviceUnavailable(f"{source}: {e}") from None
    busy = ports_in_use(cfg)
    if busy:
        raise ValueError(f"{source}: port(s) already in use on this host: {', '.join(busy)} (another cluster running?)")
    if cfg.model.path == "demo":  # made once here, not by every node at the same time
        from afd.model.demo import ensure_demo_checkpoint

        ensure_demo_checkpoint()


class _Launcher:
    """`afd launch`'s run: its processes (afd.cluster.processes), the token, the URLs once ready."""

    def __init__(self, cfg: ClusterConfig, plan, env: dict):
        self.cfg, self.plan, self.env = cfg, plan, env
        self.stopping = False

    def run(self, curl_example: bool) -> int:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: setattr(self, "stopping", True))
        env = self.env
        coord = self.cfg.coordinator
        made = None
        if not cluster_token():  # secure by default: the control plane of a launch always has a token
            path, new = launch_token_file(self.cfg.cluster.name, coord.ports.control)
            env.pop(TOKEN_ENV, None)  # an empty one
            env[TOKEN_FILE_ENV] = path
            made = path if new else None
        try:
            return self._run(curl_example, env)
        finally:
            if made:
                with contextlib.suppress(OSError):
                    os.unlink(made)

    def _run(self, curl_example: bool, env: dict) -> int:
        procs = NodeProcesses(env=env, echo=True, restart=RestartPolicy.of(self.cfg.cluster))
        procs.start_all(  # any order works; FFN nodes first shows it
            Command(
                proc.name,
                (sys.executable, "-m", MODULES[proc.node.role], *args),
                _stage(proc),
                () if proc.tp_rank else tuple(node_ports(proc.node)),  # TP ranks > 0 listen on none
                proc.node.name,  # a node's TP ranks fail and restart together
            )
            for proc, args in reversed(self.plan)
        )
        from afd.cluster.api_client import api_url, client_context

        urls = [api_url(self.cfg.http, n.host, n.ports.http) for n in self.cfg.attention_nodes if n.ports.http]
        tls = client_context(self.cfg.http)  # https when the YAML gives http.ssl_certfile
        code = 0
        try:
            ready = procs.wait_until(
                lambda: all(healthy(u, tls) for u in urls),
                self.cfg.cluster.startup_timeout + 60,
                f"the cluster to be ready at {', '.join(urls)}",
                stopping=lambda: self.stopping,
                every=0.2,
            )
            if ready:
                self._ready(procs, urls, curl_example)
                # until a signal, or every node has exited 0 (a shutdown through the control plane); a node
                # that fails is restarted inside the wait (NodeProcesses' supervisor)
                procs.wait_until(
                    lambda: _all_exited(procs),
                    None,
                    "the cluster",
                    stopping=lambda: self.stopping,
                    exited_ok=True,
                    every=0.2,
                )
        except NodeExited as e:  # its log is on the terminal already
            procs.say(f"{e.why}; stopping the cluster")
            code = 1
        except ClusterError as e:
            procs.say(f"{e}; stopping")
            code = 1
        grace = self.cfg.engine.shutdown_timeout + 10  # attention nodes drain first
        procs.stop({"attention": grace, "tp": 10.0, "ffn": 10.0})
        procs.say("all nodes stopped")
        return code

    def _ready(self, procs: NodeProcesses, urls: list[str], curl_example: bool) -> None:
        procs.say(f"cluster {self.cfg.cluster.name} ({self.cfg.topology_name}) ready; API at {', '.join(urls)}")
        for u in urls:  # one line each, for scripts
            print(u, flush=True)
        if curl_example:
            # the key itself is never printed: the example names where it is (an API key was set: --api-key,
            # --api-key-file or $AFD_API_KEY, all handed to the nodes as AFD_API_KEY)
            auth = ' -H "Authorization: Bearer $AFD_API_KEY"' if "AFD_API_KEY" in self.env else ""
            procs.say(
                "try: curl "
                + shlex.quote(f"{urls[0]}/v1/completions")
                + auth
                + ' -H \'Content-Type: application/json\' -d \'{"prompt": "Experts are", '
                '"max_tokens": 16, "temperature": 0}\'' + (" (with the API key in $AFD_API_KEY)" if auth else "")
            )


def _all_exited(procs: NodeProcesses) -> bool:
    sup = procs.supervisor
    return all(p.popen.poll() is not None for p in procs.procs.values()) and not (sup and sup.any_pending)


def _stage(proc: Process) -> str:
    """Attention nodes (their TP rank 0) drain and leave first; their other ranks follow them out; then
    the FFN nodes."""
    return "tp" if proc.tp_rank else proc.node.role
