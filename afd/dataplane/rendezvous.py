"""What a data plane needs before its process group forms: the rendezvous store (on the authenticated
control plane), gloo's listening interface, and the environment the backend's waits need."""

from __future__ import annotations

import logging
import os
import socket
import time

import grpc
import torch.distributed as dist

from afd.backend import Backend
from afd.backend.base import PeerError
from afd.control import control_pb2 as pb
from afd.control import control_pb2_grpc as pb_grpc
from afd.control.auth import call_metadata, channel
from afd.control.server import ControlServer

log = logging.getLogger("afd.dataplane.transport")
_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class ControlStore(dist.Store):
    """torch.distributed's store over the control plane's `Rendezvous` service (afd.control.kvstore):
    every call carries the cluster token (and goes over cluster.tls), so only a node that holds the token
    reads a key or a pair address. Every call has a deadline: blocking ones are sliced into short server
    waits up to the store's timeout, after which they raise, as TCPStore's do.

    Keep a reference for as long as a process group may use it: c10d holds only the C++ half, and calls
    into a store whose Python object was collected fail ("Not implemented")."""

    def __init__(self, address: str, timeout_s: float, tls: dict | None = None, prefix: str = ""):
        super().__init__()
        self.address, self.timeout_s, self.prefix = address, timeout_s, prefix
        self._channel = channel(address, tls)
        self._stub = pb_grpc.RendezvousStub(self._channel)

    def _call(self, name: str, req: pb.StoreRequest, wait_s: float = 0.0) -> pb.StoreReply:
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                return getattr(self._stub, name)(req, metadata=call_metadata(), timeout=wait_s + 5)
            except grpc.RpcError as e:
                if e.code() not in _RETRYABLE or time.monotonic() > deadline:
                    raise PeerError(
                        f"data plane: rendezvous store at {self.address}: {name} failed ({e.details()})"
                    ) from None
                time.sleep(0.2)  # the serving node is (re)starting: its control port answers soon

    def _blocking(self, name: str, keys: list[str], what: str) -> pb.StoreReply:
        deadline = time.monotonic() + self.timeout_s
        while True:
            left = deadline - time.monotonic()
            reply = self._call(name, pb.StoreRequest(keys=keys, timeout_seconds=max(0.0, min(left, 2.0))), 2.0)
            if reply.found:
                return reply
            if left <= 0:
                raise PeerError(
                    f"data plane: rendezvous store at {self.address}: {what} not set within {self.timeout_s:.0f}s"
                )

    def _k(self, key: str) -> str:
        return self.prefix + key

    def set(self, key, value) -> None:
        value = value.encode() if isinstance(value, str) else bytes(value)
        self._call("Set", pb.StoreRequest(keys=[self._k(key)], value=value))

    def get(self, key) -> bytes:
        return self._blocking("Get", [self._k(key)], f"key {key!r}").value

    def add(self, key, amount) -> int:
        return self._call("Add", pb.StoreRequest(keys=[self._k(key)], amount=amount)).amount

    def compare_set(self, key, expected, desired) -> bytes:
        enc = lambda v: v.encode() if isinstance(v, str) else bytes(v)  # noqa: E731
        req = pb.StoreRequest(keys=[self._k(key)], expected=enc(expected), value=enc(desired))
        return self._call("CompareSet", req).value

    def wait(self, keys, timeout=None) -> None:
        self._blocking("Wait", [self._k(k) for k in keys], f"keys {list(keys)}")

    def check(self, keys) -> bool:
        return self._call("Check", pb.StoreRequest(keys=[self._k(k) for k in keys])).found

    def delete_key(self, key) -> bool:
        return self._call("DeleteKey", pb.StoreRequest(keys=[self._k(key)])).found

    def num_keys(self) -> int:
        return self._call("NumKeys", pb.StoreRequest()).amount

    def close(self) -> None:
        self._channel.close()


def rendezvous_store(rank: int, host: str, port: int, timeout_s: float):
    """A store for processes that run no control server of their own (tests, benchmarks): rank 0 serves
    the `Rendezvous` service on host:port (behind the cluster token when one is set), every rank talks
    to it through ControlStore. Returns the store and, on rank 0, the gRPC server to keep."""
    server = ControlServer(host, port, workers=8) if rank == 0 else None
    return ControlStore(f"{host}:{port}", timeout_s), server


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
