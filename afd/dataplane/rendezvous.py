"""What a data plane needs before its process group forms: the rendezvous store, gloo's listening interface,
and the environment the backend's waits need."""

from __future__ import annotations

import logging
import os
import socket
from datetime import timedelta

import torch.distributed as dist

from afd.backend import Backend
from afd.backend.base import PeerError

log = logging.getLogger("afd.dataplane.transport")


def rendezvous_store(rank: int, master_addr: str, master_port: int, timeout_s: float):
    """torch.distributed's key-value store for forming process groups: rank 0 serves it for the life of
    its process (every generation of the data plane forms through it), the others connect. Rank 0
    listens on its own address only (TCPStore alone would take every interface). Returns the store and,
    on rank 0, the listening socket, which must stay open as long as the store."""
    timeout = timedelta(seconds=timeout_s)
    if rank != 0:
        return dist.TCPStore(master_addr, master_port, is_master=False, timeout=timeout), None
    family, kind, proto, _, addr = socket.getaddrinfo(master_addr, master_port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise PeerError(f"data plane: cannot listen on {master_addr}:{master_port} for the rendezvous ({e})") from None
    sock.listen(512)
    store = dist.TCPStore(
        master_addr,
        master_port,
        is_master=True,
        wait_for_workers=False,
        timeout=timeout,
        master_listen_fd=sock.fileno(),
    )
    return store, sock


def _interface_of(address: str) -> str | None:
    """The network interface that holds the IPv4 `address` (Linux), or None."""
    import fcntl
    import struct

    try:
        want = socket.inet_aton(socket.gethostbyname(address))
    except OSError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                got = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                continue
            if got[20:24] == want:
                return name
    return None


def bind_gloo(bind_host: str | None) -> None:
    """gloo's pair listeners on the node's own address. init_process_group passes no options to gloo
    (torch ignores pg_options there), so its device comes from GLOO_SOCKET_IFNAME, else from the
    hostname's address: name the interface that holds bind_host."""
    if not bind_host or bind_host in ("0.0.0.0", "::") or os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    ifname = _interface_of(bind_host)
    if ifname is None:
        log.warning("no interface holds %s: gloo listens on the hostname's address", bind_host)
        return
    os.environ["GLOO_SOCKET_IFNAME"] = ifname


def apply_comm_env(backend: Backend) -> None:
    """Sets the variables the backend's process group needs for timeouts that hold; refuses a value the
    user set against them (naming the variable), since the group reads them once, at creation."""
    for key, want in backend.comm_env().items():
        have = os.environ.get(key)
        if have is not None and have != want:
            raise ValueError(
                f"environment: {key}={have}, but the {backend.dist_backend} data plane needs {key}={want} "
                "(its waits must not block the host, and afd's watchdog holds every deadline); unset it"
            )
        os.environ[key] = want
