"""The rendezvous store's server side: a key-value map served as the `Rendezvous` service of a node's
control server, so that it sits behind the cluster token interceptor and cluster.tls like every other
control call (torch's TCPStore has no authentication: anyone who reached it listed the keys and the
gloo pair addresses). afd.dataplane.rendezvous.ControlStore is torch's view of it.

Blocking calls (Get, Wait) hold a server thread for at most MAX_WAIT_S per call; the client loops up
to its own deadline, so a caller that dies holds nothing for long.
"""

from __future__ import annotations

import threading

from afd.control import control_pb2 as pb
from afd.control import control_pb2_grpc as pb_grpc

MAX_WAIT_S = 2.0
MAX_KEYS = 100_000
"""A registered node that keeps adding keys (a bug) meets an error, not an out-of-memory control server."""


class KeyValues:
    """The map and its waits; also usable in-process (the node that serves it)."""

    def __init__(self):
        self._values: dict[str, bytes] = {}
        self._cv = threading.Condition()

    def _put(self, key: str, value: bytes) -> None:
        if key not in self._values and len(self._values) >= MAX_KEYS:
            raise ValueError(f"rendezvous store full ({MAX_KEYS} keys)")
        self._values[key] = value
        self._cv.notify_all()

    def set(self, key: str, value: bytes) -> None:
        with self._cv:
            self._put(key, value)

    def get(self, key: str, timeout_s: float) -> bytes | None:
        with self._cv:
            self._cv.wait_for(lambda: key in self._values, timeout_s)
            return self._values.get(key)

    def add(self, key: str, amount: int) -> int:
        with self._cv:
            value = int(self._values.get(key, b"0")) + amount
            self._put(key, str(value).encode())
            return value

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """c10d's semantics: set when the key holds `expected` (or is absent and `expected` is empty);
        returns the value it holds after."""
        with self._cv:
            have = self._values.get(key)
            if (have is None and not expected) or have == expected:
                self._put(key, desired)
                return desired
            return expected if have is None else have

    def wait(self, keys: list[str], timeout_s: float) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: all(k in self._values for k in keys), timeout_s)

    def check(self, keys: list[str]) -> bool:
        with self._cv:
            return all(k in self._values for k in keys)

    def delete(self, key: str) -> bool:
        with self._cv:
            return self._values.pop(key, None) is not None

    def num_keys(self) -> int:
        with self._cv:
            return len(self._values)

    def drop_prefix(self, prefix: str) -> None:
        """Forgets a finished formation's keys (its addresses are stale once its group formed)."""
        with self._cv:
            for k in [k for k in self._values if k.startswith(prefix)]:
                del self._values[k]


def _bounded(req: pb.StoreRequest) -> float:
    return max(0.0, min(req.timeout_seconds, MAX_WAIT_S))


class RendezvousServicer(pb_grpc.RendezvousServicer):
    def __init__(self, kv: KeyValues | None = None):
        self.kv = kv or KeyValues()

    def Set(self, req, context):
        self.kv.set(req.keys[0], req.value)
        return pb.StoreReply(found=True)

    def Get(self, req, context):
        value = self.kv.get(req.keys[0], _bounded(req))
        return pb.StoreReply(found=value is not None, value=value or b"")

    def Add(self, req, context):
        return pb.StoreReply(found=True, amount=self.kv.add(req.keys[0], req.amount))

    def CompareSet(self, req, context):
        return pb.StoreReply(found=True, value=self.kv.compare_set(req.keys[0], req.expected, req.value))

    def Wait(self, req, context):
        return pb.StoreReply(found=self.kv.wait(list(req.keys), _bounded(req)))

    def Check(self, req, context):
        return pb.StoreReply(found=self.kv.check(list(req.keys)))

    def DeleteKey(self, req, context):
        return pb.StoreReply(found=self.kv.delete(req.keys[0]))

    def NumKeys(self, req, context):
        return pb.StoreReply(found=True, amount=self.kv.num_keys())
