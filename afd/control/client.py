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
from afd.config.schema import ClusterConfig
from afd.control import control_pb2 as pb
from afd.control import control_pb2_grpc as pb_grpc
from afd.control.auth import call_metadata, channel

log = logging.getLogger("afd.control")
_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def _line(e: grpc.RpcError) -> str:
    """A gRPC error in one line: its code and the first line of its details."""
    details = (e.details() or "").strip().splitlines()
    return f"{e.code().name}: {details[0] if details else ''}"


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
        self._register_request = pb.RegisterRequest()
        self._stop = threading.Event()
        self._poke = threading.Event()
        """Set by poke(): the next heartbeat goes now, not at the end of its interval."""

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
        req = self._register_request = pb.RegisterRequest(
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

    def report_ready(self) -> pb.ClusterStatus:
        return self._call(self.stub.ReportReady, self.ref, timeout=10)

    def register_again(self, ready: bool) -> None:
        """Registers this running instance with a coordinator that does not know it (restarted: its state
        is soft), saying whether it reported ready."""
        req = pb.RegisterRequest()
        req.CopyFrom(self._register_request)
        req.again, req.ready = True, ready
        self.stub.Register(req, metadata=call_metadata(), timeout=5)

    def start_heartbeats(
        self,
        on_status: Callable[[pb.ClusterStatus | None, float], None],
        ready: Callable[[], bool] = lambda: False,
        paused: Callable[[], str] = lambda: "",
    ) -> None:
        """on_status(status, asked) after each heartbeat, `asked` when it was sent (time.monotonic());
        on_status(None, asked) after each one that fails once the
        coordinator has been unreachable for longer than the heartbeat timeout. One line when it is lost,
        one when it is back; a coordinator that does not know this node (it restarted) is registered with
        again, with `ready()`: whether it reported ready. Each heartbeat carries `paused()`: why this node's
        requests are paused, if they are (the coordinator reports DEGRADED meanwhile)."""
        interval, limit = self.cfg.cluster.heartbeat_interval, self.cfg.cluster.heartbeat_timeout

        def beat() -> None:
            last_ok, lost, refused = time.monotonic(), False, False
            while True:
                self._poke.wait(interval)
                self._poke.clear()
                if self._stop.is_set():
                    return
                asked = time.monotonic()
                try:
                    ref = pb.NodeRef(name=self.ref.name, instance_id=self.ref.instance_id, paused=paused())
                    st = self.stub.Heartbeat(ref, metadata=call_metadata(), timeout=max(1.0, interval))
                except ValueError:  # grpc's "Cannot invoke RPC on closed channel!": close() ran meanwhile
                    if self._stop.is_set():
                        return
                    raise
                except grpc.RpcError as e:
                    if e.code() == grpc.StatusCode.NOT_FOUND:
                        if not refused:
                            log.warning("not registered with this coordinator (%s); registering again", self.address)
                        try:
                            self.register_again(ready())
                            refused = False
                            continue
                        except grpc.RpcError as again:  # e.g. another instance took the name meanwhile
                            if not refused:
                                log.error("the coordinator refused to register this node again: %s", _line(again))
                            refused, e = True, again
                    if time.monotonic() - last_ok > limit:
                        if not lost:
                            log.error("coordinator at %s lost (no answer for %.0fs): %s", self.address, limit, _line(e))
                            lost = True
                        on_status(None, asked)
                    continue
                if lost:
                    log.warning("coordinator at %s is back", self.address)
                    lost = False
                last_ok = time.monotonic()
                on_status(st, asked)

        threading.Thread(target=beat, name="afd-heartbeat", daemon=True).start()

    def shutdown_cluster(self, reason: str) -> None:
        try:
            self._call(self.stub.Shutdown, pb.ShutdownRequest(reason=reason), timeout=3)
        except (grpc.RpcError, ControlError) as e:
            log.debug("shutdown call: %s", e)

    def poke(self) -> None:
        """A heartbeat now (any thread): what it carries changed (this node's requests paused or resumed), and
        `afd status` should say so before the next interval."""
        self._poke.set()

    def close(self) -> None:
        self._stop.set()
        self._poke.set()
        self._channel.close()
