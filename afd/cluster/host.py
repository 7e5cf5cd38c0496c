"""What a launcher asks of this host: which of a YAML's ports are taken (before a node starts, and before
it restarts), free ports for local clusters, a node's readiness on its HTTP port, and the processes
below a pid."""

from __future__ import annotations

import os
import random
import socket
import urllib.request
from collections.abc import Iterable


def is_loopback(host: str) -> bool:
    """`host` is this host only (localhost, 127.0.0.0/8, ::1); a DNS name may be reached from elsewhere."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def port_busy(port: int) -> bool:
    """Something listens on `port` (on any address of this host)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers do: TIME_WAIT is free
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return True
    return False


def busy(ports: Iterable[int]) -> list[int]:
    return [p for p in ports if port_busy(p)]


def node_ports(node) -> list[int]:
    """The ports a node of the YAML listens on (control, http, metrics; those it has: `ports.data` has no
    listener, the rendezvous being a service of the control port)."""
    return [p for p in (getattr(node.ports, k) for k in ("control", "http", "metrics")) if p is not None]


def ports_in_use(cfg) -> list[str]:
    """The YAML's ports (of this host's nodes) that something already listens on."""
    out = []
    for n in cfg.nodes:
        for name in ("control", "http", "metrics"):
            port = getattr(n.ports, name)
            if port is not None and port_busy(port):
                out.append(f"{port} ({n.name}.ports.{name})")
    return out


def healthy(url: str, context=None) -> bool:
    """`/health` answers 200 (`context`: the ssl.SSLContext of an https URL)."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=1, context=context) as r:
            return r.status == 200
    except OSError:
        return False


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """n distinct ports free on `host` now, for nodes that bind them seconds later. Chosen below the kernel's
    ephemeral range: a port the OS hands out (a bind to port 0, the source port of every outgoing connection)
    comes from that range, so one picked there can be taken by anything on the machine before the node
    binds it (seen under make test's parallel workers)."""
    top = _ephemeral_low()
    pick = random.SystemRandom()
    ports: list[int] = []
    while len(ports) < n:
        port = pick.randrange(10000, top) if top > 11000 else _os_port(host)
        if port in ports:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        ports.append(port)
    return ports


def _os_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default range starts here


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, grandchildren, ...), from /proc."""
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(_read(f"/proc/{d}/stat").rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            kids.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.append(k)
            todo.append(k)
    return out


def _read(path: str) -> str:
    with open(path) as fh:
        return fh.read()
