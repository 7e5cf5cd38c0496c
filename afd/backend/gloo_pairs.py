"""A pair's gloo groups and the TCP connections that carry them: what ends a gloo wait that is already blocked.

gloo has nothing that does. ProcessGroupGloo.abort() is c10d's no-op; a send or receive work's wait() blocks in
gloo's UnboundBuffer until its data moved or its timeout passed, and a wait that times out breaks every pair of
the group's context; is_completed() stays False until wait() has returned, even once the data is there (torch
2.13, checked). A peer that hangs (SIGSTOP) keeps its sockets open, so the wait runs to comm_timeout while every
other peer of the node waits behind it. What gloo does react to is its connection closing: its device thread sees
the end of the stream and fails every pending operation of the pair at once ("Connection closed by peer").

So each group remembers its connections, found when it forms: the TCP sockets this process gained during the
group's construction (gloo connects eagerly there), kept where the peer reports the same connection from its end
(exchanged through the pair's store, so a socket another thread opened meanwhile, to anyone else, never
counts), less those accepted on a listener that existed before (a service's: the control plane's, the API's).
Aborting the group shuts those sockets down (shutdown(2) on a duplicate of the descriptor: gloo keeps its own),
which ends this end's waits within milliseconds and tells the peer, once it runs again, that the pair is gone.
Linux only (/proc); elsewhere a group has no sockets to shut and behaves as before.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import socket
from datetime import timedelta

log = logging.getLogger("afd.backend")

_ESTABLISHED, _LISTEN = "01", "0A"
Endpoint = tuple[str, int]


def socket_inodes() -> set[int]:
    """The inodes of this process's sockets (empty where /proc is not Linux's)."""
    out = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/self/fd/{fd}")
                if link.startswith("socket:["):
                    out.add(int(link[8:-1]))
    return out


def _endpoint(field: str) -> Endpoint:
    """/proc/net/tcp{,6}'s `HEXIP:HEXPORT` (the address as the kernel's 32-bit words, little-endian on x86 and
    ARM), IPv4-mapped IPv6 as IPv4, so that both ends of one connection name it alike."""
    hexip, hexport = field.split(":")
    raw = b"".join(int(hexip[i : i + 8], 16).to_bytes(4, "little") for i in range(0, len(hexip), 8))
    ip = ipaddress.ip_address(raw)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip), int(hexport, 16)


def tcp_table(inodes: set[int]) -> dict[int, tuple[Endpoint, Endpoint, str]]:
    """inode -> (local, remote, state) of those of `inodes` that are TCP sockets."""
    out = {}
    for name in ("tcp", "tcp6"):
        with contextlib.suppress(OSError), open(f"/proc/self/net/{name}") as f:
            next(f)
            for line in f:
                p = line.split()
                inode = int(p[9])
                if inode in inodes:
                    out[inode] = (_endpoint(p[1]), _endpoint(p[2]), p[3])
    return out


class GlooPairGroup:
    """A two-rank ProcessGroupGloo (every call goes to it) and the inodes of the connections that carry it."""

    def __init__(self, pg, connections: frozenset[int]):
        self._pg, self.connections = pg, connections

    def __getattr__(self, name: str):
        return getattr(self._pg, name)

    def shut_connections(self) -> int:
        """Shuts this group's connections down (any thread); the number shut (0 once they are closed)."""
        shut = 0
        with contextlib.suppress(OSError):
            for fd in os.listdir("/proc/self/fd"):
                try:
                    link = os.readlink(f"/proc/self/fd/{fd}")
                except OSError:
                    continue
                if not link.startswith("socket:[") or int(link[8:-1]) not in self.connections:
                    continue
                try:
                    with socket.socket(fileno=os.dup(int(fd))) as s:
                        s.shutdown(socket.SHUT_RDWR)
                    shut += 1
                except OSError as e:  # closed meanwhile, or not connected any more
                    log.debug("shutting a gloo connection down: %s", e)
        return shut


def form(store, rank: int, timeout: timedelta) -> GlooPairGroup:
    """ProcessGroupGloo(store, rank, 2, timeout) with its connections (see the module docstring)."""
    import torch.distributed as dist

    before = socket_inodes()
    services = {local[1] for local, _, state in tcp_table(before).values() if state == _LISTEN}
    pg = dist.ProcessGroupGloo(store, rank, 2, timeout)
    new = tcp_table(socket_inodes() - before)
    mine = {
        inode: (local, remote)
        for inode, (local, remote, state) in new.items()
        if state == _ESTABLISHED and local[1] not in services
    }
    store.set(f"afd-connections/{rank}", json.dumps([[list(a), list(b)] for a, b in mine.values()]))
    theirs = {(tuple(a), tuple(b)) for a, b in json.loads(store.get(f"afd-connections/{1 - rank}"))}
    ours = frozenset(i for i, (local, remote) in mine.items() if (remote, local) in theirs)
    if not ours:
        log.warning("gloo pair group: found none of its connections; a hung peer holds it until comm_timeout")
    return GlooPairGroup(pg, ours)
