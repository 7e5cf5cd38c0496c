"""`afd launch FILE`: every node of a cluster YAML on this host, logs prefixed, one URL when ready.

SIGINT/SIGTERM are forwarded: attention nodes first (they drain, then leave the data plane), then FFN
nodes; whatever is still alive after the grace period is killed. No child outlives the launcher.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.request

from afd.cluster.config import ClusterConfig, Node, Process, load
from afd.cluster.flags import (
    DefaultsHelpFormatter,
    add_config_flags,
    add_flags,
    api_key,
    config_argv,
    overrides_of,
    with_overrides,
)
from afd.cluster.topology import with_http_port

MODULES = {"attention": "attention_node.main", "ffn": "ffn_node.main"}
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
        for p, a in plan:  # the host (and device) as a shell comment: the line still pastes as it is
            dev = f", {p.device}" if p.device != "cpu" else ""
            print(f"{shlex.join([COMMANDS[p.node.role], *a])}  # on {p.node.host}{dev}")
        return 0
    check_startable(cfg, args.config)
    env = dict(os.environ)
    key = api_key(args)
    if key:
        env["AFD_API_KEY"] = key
    return _Launcher(cfg, plan, env).run(args.curl_example)


def check_startable(cfg: ClusterConfig, source: str) -> None:
    """What would make every node fail, said once here rather than as a traceback from each."""
    if cfg.model.path != "demo":
        from afd.cluster.config import check_expert_layout, check_tp_layout
        from afd.model.registry import load_config

        mcfg = load_config(cfg.model.path)
        check_expert_layout(cfg, mcfg.n_routed_experts)
        check_tp_layout(cfg, mcfg.num_attention_heads)
    from afd.backend import check_device  # here: afd.backend imports torch, which `afd --help` need not

    for device in sorted({n.device_type for n in cfg.nodes}):  # TP ranks share their node's device type
        check_device(device)
    busy = _ports_in_use(cfg)
    if busy:
        raise ValueError(f"{source}: port(s) already in use on this host: {', '.join(busy)} (another cluster running?)")
    if cfg.model.path == "demo":  # made once here, not by every node at the same time
        from afd.model.demo import ensure_demo_checkpoint

        ensure_demo_checkpoint()


class _Launcher:
    def __init__(self, cfg: ClusterConfig, plan, env: dict):
        self.cfg, self.plan, self.env = cfg, plan, env
        self.procs: list[tuple[Process, subprocess.Popen]] = []
        self.stopping = False
        self._lock = threading.Lock()

    def run(self, curl_example: bool) -> int:
        from afd.cluster.token import TOKEN_ENV, cluster_token, make_launch_token, token_file

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: setattr(self, "stopping", True))
        env = self.env
        coord = self.cfg.coordinator
        made = None
        if not cluster_token():  # secure by default: the control plane of a launch always has a token
            env[TOKEN_ENV] = make_launch_token(self.cfg.cluster.name, coord.ports.control)
            made = token_file(self.cfg.cluster.name, coord.ports.control)
        try:
            return self._run(curl_example, env)
        finally:
            if made:
                with contextlib.suppress(OSError):
                    os.unlink(made)

    def _run(self, curl_example: bool, env: dict) -> int:
        for proc, args in reversed(self.plan):  # any order works; FFN nodes first shows it
            p = subprocess.Popen(
                [sys.executable, "-m", MODULES[proc.node.role], *args],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                text=True,
                bufsize=1,
                env=env,
            )
            self.procs.append((proc, p))
            threading.Thread(target=self._pump, args=(proc.name, p), daemon=True).start()
        urls = [f"http://{n.host}:{n.ports.http}" for n in self.cfg.attention_nodes]
        deadline = time.monotonic() + self.cfg.cluster.startup_timeout + 60
        ready = False
        code = 0
        while not self.stopping:
            dead = [(n, p.returncode) for n, p in self.procs if p.poll() is not None]  # n: a Process
            if dead:
                n, rc = dead[0]
                self._say(f"node {n.name} exited with code {rc}; stopping the cluster")
                code = 1
                break
            if not ready:
                ready = all(_healthy(u) for u in urls)
                if ready:
                    self._say(
                        f"cluster {self.cfg.cluster.name} ({self.cfg.topology_name}) ready; API at {', '.join(urls)}"
                    )
                    for u in urls:  # one line each, for scripts
                        print(u, flush=True)
                    if curl_example:
                        self._say(
                            "try: curl "
                            + shlex.quote(f"{urls[0]}/v1/completions")
                            + ' -H \'Content-Type: application/json\' -d \'{"prompt": "Experts are", '
                            '"max_tokens": 16, "temperature": 0}\''
                        )
                elif time.monotonic() > deadline:
                    self._say(f"cluster not ready at {', '.join(urls)} within the startup timeout; stopping")
                    code = 1
                    break
            time.sleep(0.2)
        self.shutdown()
        return code

    def _say(self, msg: str) -> None:
        with self._lock:
            print(f"[launch] {msg}", flush=True)

    def _pump(self, name: str, p: subprocess.Popen) -> None:
        width = max(len(n) for n in self.cfg.process_names)
        for line in p.stdout:
            with self._lock:
                sys.stdout.write(f"[{name:<{width}}] {line}")
                sys.stdout.flush()

    def shutdown(self) -> None:
        """Attention nodes (their TP rank 0) drain and leave first; their other ranks follow them out;
        then the FFN nodes."""
        grace = self.cfg.engine.shutdown_timeout + 10

        def stage(proc: Process) -> str:
            return "tp" if proc.tp_rank else proc.node.role

        for role, wait in (("attention", grace), ("tp", 10.0), ("ffn", 10.0)):
            group = [p for n, p in self.procs if stage(n) == role and p.poll() is None]
            for p in group:
                p.send_signal(signal.SIGTERM)
            end = time.monotonic() + wait
            for p in group:
                try:
                    p.wait(max(0.1, end - time.monotonic()))
                except subprocess.TimeoutExpired:
                    self._say(f"pid {p.pid} did not stop in {wait:.0f}s; killing it")
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
        self._say("all nodes stopped")


def _ports_in_use(cfg: ClusterConfig) -> list[str]:
    import socket

    busy = []
    for n in cfg.nodes:
        for name in ("control", "data", "http", "metrics"):
            port = getattr(n.ports, name)
            if port is None:
                continue
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers do: TIME_WAIT is free
                try:
                    s.bind(("0.0.0.0", port))
                except OSError:
                    busy.append(f"{port} ({n.name}.ports.{name})")
    return busy


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False
