"""A node's side of the control plane: register (retrying until the coordinator is up), wait for the
cluster, report ready, and send heartbeats whose replies carry the cluster state."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable

import grpc

from afd import __version__
from afd.cluster.config import ClusterConfig
from afd.control import control_pb2 as pb
from afd.control import control_pb2_grpc as pb_grpc
from afd.control.auth import call_metadata, channel

log = logging.getLogger("afd.control")
_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class ControlError(RuntimeError):
    """The coordinator refused this node, or could not be reached in time."""


class ControlClient:
    def __init__(self, cfg: ClusterConfig, node: str, process: str | None = None):
        """process: the name this process registers under (a TP rank's `NODE.tpR`); default: the node's."""
        self.cfg, self.node = cfg, cfg.node(node)
        self.process = process or node
        coord = cfg.coordinator
        self.address = f"{coord.host}:{coord.ports.control}"
        self._channel = channel(self.address, cfg.cluster.tls)
        self.stub = pb_grpc.CoordinatorStub(self._channel)
        self.instance_id = uuid.uuid4().hex
        self.ref = pb.NodeRef(name=self.process, instance_id=self.instance_id)
        self._stop = threading.Event()

    def _call(self, method, request, timeout: float, retry=_RETRYABLE):
        try:
            return method(request, metadata=call_metadata(), timeout=timeout)
        except grpc.RpcError as e:
            if e.code() in retry:
                raise
            raise ControlError(f"coordinator at {self.address} refused {self.process}: {e.details()}") from None
        except ValueError:  # grpc's "Cannot invoke RPC on closed channel!": close() ran, from a signal
            if not self._stop.is_set():
                raise
            raise ControlError(f"{self.process} is stopping: its control channel is closed") from None

    def register(self, fingerprint: str) -> pb.RegisterReply:
        n = self.node
        req = pb.RegisterRequest(
            name=self.process,
            role=n.role,
            address=f"{n.host}:{n.ports.control}",
            model_fingerprint=fingerprint,
            version=__version__,
            instance_id=self.instance_id,
        )
        deadline = time.monotonic() + self.cfg.cluster.startup_timeout
        # A replacement for a node that just died is taken once the dead instance misses its heartbeats.
        replaced_by = time.monotonic() + self.cfg.cluster.heartbeat_timeout + 5
        while True:
            try:
                return self._call(
                    self.stub.Register, req, timeout=5, retry=(*_RETRYABLE, grpc.StatusCode.ALREADY_EXISTS)
                )
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.ALREADY_EXISTS and time.monotonic() > replaced_by:
                    raise ControlError(f"coordinator at {self.address} refused {self.process}: {e.details()}") from None
                if time.monotonic() > deadline:
                    raise ControlError(
                        f"coordinator at {self.address} not reachable within {self.cfg.cluster.startup_timeout:.0f}s"
                    ) from None
                time.sleep(0.3)

    def await_cluster(self) -> pb.ClusterStatus:
        """Returns once every node registered; raises ControlError naming the missing ones on timeout."""
        deadline = time.monotonic() + self.cfg.cluster.startup_timeout + 10
        while True:
            try:
                st = self._call(self.stub.AwaitCluster, self.ref, timeout=10)
            except grpc.RpcError as e:
                if time.monotonic() > deadline:
                    raise ControlError(f"coordinator at {self.address} stopped answering: {e.details()}") from None
                time.sleep(0.3)
                continue
            if st.state == pb.ClusterStatus.FAILED:
                raise ControlError(st.message)
            if st.state == pb.ClusterStatus.SHUTDOWN:
                raise ControlError(f"cluster shut down during startup: {st.message}")
            if not st.missing:
                return st
            if time.monotonic() > deadline:
                raise ControlError(f"startup timeout: nodes never registered: {', '.join(st.missing)}")

    def await_formation(self, after: int, timeout: float) -> pb.ClusterStatus:
        """The status once a data-plane generation past `after` can form; raises ControlError when none
        does within `timeout` seconds (nobody replaced the failed node)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                st = self._call(
                    self.stub.AwaitFormation,
                    pb.FormationRequest(ref=self.ref, after=after, timeout_seconds=max(0.0, min(left, 10))),
                    timeout=max(1.0, min(left, 10) + 5),
                )
            except grpc.RpcError as e:
                st = None
                if time.monotonic() > deadline:
                    raise ControlError(f"coordinator at {self.address} stopped answering: {e.details()}") from None
            if st is not None and st.state == pb.ClusterStatus.SHUTDOWN:
                raise ControlError(f"the cluster is shutting down: {st.message}")
            if st is not None and st.generation > after and not st.forming and not st.lost:
                return st
            if time.monotonic() > deadline:
                missing = ", ".join(sorted({*(st.forming if st else []), *(st.lost if st else [])})) or "?"
                raise ControlError(f"no replacement joined within {timeout:.0f}s (waiting for: {missing})")
            if st is None:
                time.sleep(0.3)

    def report_ready(self) -> pb.ClusterStatus:
        return self._call(self.stub.ReportReady, self.ref, timeout=10)

    def start_heartbeats(self, on_status: Callable[[pb.ClusterStatus | None], None]) -> None:
        """on_status(status) after each heartbeat; on_status(None) once the coordinator has been
        unreachable for longer than the heartbeat timeout."""
        interval, limit = self.cfg.cluster.heartbeat_interval, self.cfg.cluster.heartbeat_timeout

        def beat() -> None:
            last_ok = time.monotonic()
            while not self._stop.wait(interval):
                try:
                    st = self._call(self.stub.Heartbeat, self.ref, timeout=max(1.0, interval))
                    last_ok = time.monotonic()
                    on_status(st)
                except (grpc.RpcError, ControlError) as e:
                    if time.monotonic() - last_ok > limit:
                        log.error("coordinator unreachable for %.0fs: %s", limit, e)
                        on_status(None)
                        last_ok = time.monotonic()

        threading.Thread(target=beat, name="afd-heartbeat", daemon=True).start()

    def shutdown_cluster(self, reason: str) -> None:
        try:
            self._call(self.stub.Shutdown, pb.ShutdownRequest(reason=reason), timeout=3)
        except (grpc.RpcError, ControlError) as e:
            log.debug("shutdown call: %s", e)

    def close(self) -> None:
        self._stop.set()
        self._channel.close()
