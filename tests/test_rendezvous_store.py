"""The rendezvous store on the control plane (afd.control.kvstore, afd.dataplane.rendezvous.ControlStore):
torch forms a gloo pair through it, and a caller without the cluster token reads nothing."""

from __future__ import annotations

import secrets
import threading
from datetime import timedelta

import grpc
import pytest
import torch
import torch.distributed as dist
from cluster_helpers import free_ports

from afd.backend.base import PeerError
from afd.control import control_pb2 as pb
from afd.control import control_pb2_grpc as pb_grpc
from afd.control.auth import call_metadata
from afd.control.server import ControlServer
from afd.dataplane.rendezvous import ControlStore

TOKEN = "store-secret"


@pytest.fixture
def served(monkeypatch):
    monkeypatch.setenv("AFD_CLUSTER_TOKEN", TOKEN)
    port = free_ports(1)[0]
    server = ControlServer("127.0.0.1", port, workers=8)
    yield server, f"127.0.0.1:{port}"
    server.stop(0)


def test_the_store_does_what_torch_asks(served):
    _, address = served
    store = ControlStore(address, 5)
    store.set("a", b"1")
    assert store.get("a") == b"1"
    assert store.add("n", 2) == 2 and store.add("n", 3) == 5
    assert store.check(["a", "n"]) and not store.check(["a", "missing"])
    assert store.compare_set("c", "", "x") == b"x"
    assert store.compare_set("c", "y", "z") == b"x"  # not what it holds: unchanged
    store.wait(["a"])
    assert store.delete_key("a") and not store.check(["a"])
    late = threading.Timer(0.5, lambda: ControlStore(address, 5).set("late", b"v"))
    late.start()
    assert store.get("late") == b"v"  # a get waits for the key, in short server-side slices
    short = ControlStore(address, 0.5)
    with pytest.raises(PeerError, match="not set within"):
        short.get("never")


def test_a_gloo_pair_forms_through_it(served):
    _, address = served
    got: dict[int, torch.Tensor] = {}
    key = secrets.token_hex(16)

    def member(rank: int) -> None:
        inner = ControlStore(address, 20)  # referenced while the group forms: c10d keeps only its C++ half
        store = dist.PrefixStore(f"afd/pair/{key}/to-ffn/", inner)  # as a PairLink names its keys
        pg = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=20))
        t = torch.full((3,), 7.0) if rank == 0 else torch.zeros(3)
        (pg.send([t], 1, 0) if rank == 0 else pg.recv([t], 0, 0)).wait()
        got[rank] = t

    threads = [threading.Thread(target=member, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert torch.equal(got[1], torch.full((3,), 7.0))


@pytest.mark.parametrize("metadata", [(), (("x-afd-cluster-token", "guessed"),)], ids=["no-token", "wrong-token"])
def test_an_outsider_learns_nothing(served, metadata):
    """A pair's keys live under afd/pair/<key>/, the key drawn afresh per formation and handed over on
    the control plane; an outsider who has the very key name still reads, counts and changes nothing,
    where a caller with the token reads it."""
    server, address = served
    key = f"afd/pair/{secrets.token_hex(16)}/to-ffn/0"
    server.kv.set(key, b"10.0.0.1:40000")  # what a formation leaves: a pair address
    refused = []
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.RendezvousStub(ch)
        for name in ("NumKeys", "Get", "Check", "Wait", "Set", "Add", "CompareSet", "DeleteKey"):
            req = pb.StoreRequest(keys=[key], timeout_seconds=0.1)
            with pytest.raises(grpc.RpcError) as e:
                getattr(stub, name)(req, metadata=metadata, timeout=5)
            refused.append(e.value.code())
        got = stub.Get(pb.StoreRequest(keys=[key], timeout_seconds=0.1), metadata=call_metadata(), timeout=5)
    assert refused == [grpc.StatusCode.UNAUTHENTICATED] * 8
    assert (got.found, got.value) == (True, b"10.0.0.1:40000")  # the refusals were the token's, not the key's
    assert server.kv.get(key, 0) == b"10.0.0.1:40000"  # nor changed anything
