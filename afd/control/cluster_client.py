"""What the `afd` commands ask a running cluster's coordinator: its status, a drain, an FFN node's restart."""

from __future__ import annotations

from afd.config.schema import ClusterConfig
from afd.errors import UserError


def coordinator_call(cfg: ClusterConfig, rpc: str, request):
    """One control-plane call to the cluster's coordinator, with the cluster token (or the one `afd launch`
    made here); an error is one line for the user."""
    import grpc

    from afd.cluster.token import launched_token
    from afd.control.auth import call_metadata
    from afd.control.client import ControlClient

    client = ControlClient(cfg, cfg.coordinator.name)
    try:
        token = launched_token(cfg.cluster.name, cfg.coordinator.ports.control)
        return getattr(client.stub, rpc)(request, metadata=call_metadata(token), timeout=10)
    except grpc.RpcError as e:
        raise UserError(f"coordinator at {client.address}: {e.details() or e.code().name}") from None
    finally:
        client.close()


def cluster_status(cfg: ClusterConfig):
    """The coordinator's ClusterStatus of `cfg`'s cluster."""
    from afd.control import control_pb2 as pb

    return coordinator_call(cfg, "GetStatus", pb.StatusRequest())


def drain(cfg: ClusterConfig, node: str | None) -> None:
    """Asks the coordinator to drain attention node `node` (None: all of them)."""
    from afd.control import control_pb2 as pb

    coordinator_call(cfg, "Drain", pb.DrainRequest(node=node or ""))


def restart_node(cfg: ClusterConfig, node: str) -> None:
    """Asks the coordinator to have FFN node `node` restart (Coordinator.Restart)."""
    from afd.control import control_pb2 as pb

    coordinator_call(cfg, "Restart", pb.DrainRequest(node=node))
