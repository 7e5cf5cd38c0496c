"""Pure-Python pieces of the data plane: the step header, expert placement, the micro-batch rule."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from afd.cluster.placement import partition_experts
from afd.dataplane.overlap import MicroBatchTuner, micro_batches_rule
from afd.dataplane.protocol import FLAG_LEAVE, HEADER_LEN, ProtocolError, StepHeader
from afd.engine.runner import StepSeq, split_micro_batches


def test_header_round_trip():
    h = StepHeader(41, (3, 0, 7), FLAG_LEAVE)
    t = h.encode()
    assert t.shape == (HEADER_LEN,) and t.dtype == torch.int64
    assert StepHeader.decode(t, sender=0) == h and h.total_tokens == 10


def test_header_rejects_garbage():
    with pytest.raises(ProtocolError, match="rank 3: expected a step header"):
        StepHeader.decode(torch.zeros(HEADER_LEN, dtype=torch.int64), sender=3)
    bad = StepHeader(1, (1,)).encode()
    bad[3] = 9
    with pytest.raises(ProtocolError, match="malformed"):
        StepHeader.decode(bad, sender=0)
    with pytest.raises(ValueError, match="at most 4"):
        StepHeader(0, (1, 1, 1, 1, 1))


def test_partition_covers_every_expert_once():
    shards = partition_experts(7, 3)
    assert [(s.lo, s.hi) for s in shards] == [(0, 3), (3, 5), (5, 7)]
    assert [s.serves_zero_experts for s in shards] == [True, False, False]
    with pytest.raises(ValueError, match="some would hold none"):
        partition_experts(2, 3)


def test_micro_batch_rule():
    assert micro_batches_rule(t_comm=0.0, t_compute=1.0) == 2
    assert micro_batches_rule(t_comm=0.5, t_compute=1.0) == 3
    assert micro_batches_rule(t_comm=5.0, t_compute=1.0) == 4


def test_tuner_keeps_one_micro_batch_when_the_exchange_is_hidden():
    t = MicroBatchTuner(warmup=2)
    t.observe(1.0, 0.5, is_decode=False)  # prefill steps do not count
    for _ in range(2):
        t.observe(1.0, 0.01, is_decode=True)
    assert t.micro_batches == 1


def test_tuner_tries_the_rules_m_and_keeps_the_faster():
    t = MicroBatchTuner(warmup=2)
    for _ in range(2):
        t.observe(1.0, 0.4, is_decode=True)
    trial = micro_batches_rule(0.4, 0.6)
    assert t.micro_batches == trial and t.chosen is None
    for _ in range(2):
        t.observe(0.7, 0.0, is_decode=True)
    assert t.chosen == trial
    t = MicroBatchTuner(warmup=1)
    t.observe(1.0, 0.4, is_decode=True)
    t.observe(1.3, 0.0, is_decode=True)  # splitting was slower: back to one micro-batch
    assert t.chosen == 1


def test_split_micro_batches_balances_tokens():
    seqs = [StepSeq([0] * n, 0, []) for n in (1, 1, 1, 1, 1, 1)]
    assert split_micro_batches(seqs, 3) == [[0, 1], [2, 3], [4, 5]]
    seqs = [StepSeq([0] * n, 0, []) for n in (10, 1, 1)]
    groups = split_micro_batches(seqs, 2)
    assert sorted(i for g in groups for i in g) == [0, 1, 2] and groups[0] == [0]


def test_tuner_measures_again_when_the_batch_changes_size():
    t = MicroBatchTuner(warmup=1)
    t.observe(1.0, 0.01, is_decode=True, tokens=32)
    assert t.chosen == 1
    t.observe(1.0, 0.01, is_decode=True, tokens=40)  # within 2x: the choice holds
    assert t.chosen == 1
    t.observe(1.0, 0.01, is_decode=True, tokens=8)  # a quarter: measured again
    assert t.chosen is None and t.micro_batches == 1
    t.observe(1.0, 0.5, is_decode=True, tokens=8)
    assert t.micro_batches == micro_batches_rule(0.5, 0.5) and t.batch == 8


class _ScriptedPlane:
    """Hands out scripted step headers to an FFN server's receives, per peer (no process group needed)."""

    generation = 0

    def check(self) -> None:  # no deadline passes here
        pass

    def __init__(self, scripts: dict[int, list]):
        self.scripts = {r: list(s) for r, s in scripts.items()}
        self.aborted: list[int] = []

    def abort(self, peer=None):
        self.aborted.append(peer)

    def irecv(self, tensor, peer):
        tensor.copy_(self.scripts[peer].pop(0).encode())
        return None

    def wait(self, work, peer, what):
        pass


def test_ffn_drops_a_peer_whose_step_ids_are_out_of_step_and_serves_the_other():
    import torch
    from torch import nn

    from afd.backend import get_backend
    from afd.dataplane.protocol import FLAG_IDLE
    from ffn_node.server import FFNServer

    ffn = nn.Module()
    ffn.cfg = type("Cfg", (), {"hidden_size": 4, "num_layers": 1})()
    good = [StepHeader(0, (), FLAG_IDLE), StepHeader(0, (3,)), StepHeader(1, (2,)), StepHeader(2, (1,))]
    bad = [StepHeader(0, (), FLAG_IDLE), StepHeader(0, (3,)), StepHeader(1, (2,)), StepHeader(3, (1,))]
    server = FFNServer(ffn, get_backend("cpu"), _ScriptedPlane({0: good, 1: bad}), [0, 1], torch.float32)
    for _ in range(3):  # an idle header repeats the next step's id; a step with tokens moves it on
        assert set(server._recv_headers()) == {0, 1}
    assert list(server._recv_headers()) == [0]  # the desynchronised peer is dropped, never computed for
    assert server.active == [0]
    assert "sent step 3 where step 2 was due" in server.gone[1]
    assert server.plane.aborted == [1], "the live but broken peer's pair is aborted: nothing of it stays queued"


def test_posting_to_a_gone_peer_is_a_peer_error():
    """gloo raises at post time (not at wait) once a pair is closed; that must be a PeerError, which
    the engine and the FFN server handle (re-forming), not a crash."""
    from afd.dataplane.transport import DataPlane, PeerError

    def isend(tensor, peer, group=None):
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1234")

    plane = _bare_plane(DataPlane, peers=[3])
    with pytest.raises(PeerError, match="isend to rank 3 failed .*Connection closed by peer") as e:
        plane._issue(isend, torch.zeros(1), 3, low_to_high=True)
    assert e.value.peer == 3
    assert 3 in plane._aborted and plane.backend.aborted == ["up3", "down3"], "the failed pair is aborted"
    with pytest.raises(PeerError, match="refused: its pair was aborted"):
        plane._issue(isend, torch.zeros(1), 3, low_to_high=True)


def _bare_plane(cls, peers: list[int]):
    """A DataPlane without process groups: each pair's groups are names, the backend records aborts."""
    import threading

    class Backend:
        dist_backend = "nccl"
        shutdown_waits_for_queued_work = True

        def __init__(self):
            self.aborted = []

        def abort_group(self, pg):
            self.aborted.append(pg)

    plane = object.__new__(cls)
    plane.backend, plane.rank, plane.generation = Backend(), 0, 0
    plane._pairs = {p: (f"up{p}", f"down{p}") for p in peers}
    plane._aborted, plane._abort_lock, plane._outstanding = {}, threading.Lock(), 0
    plane.deadlines = None
    plane._errors_before = 0
    return plane


class _Work:
    def __init__(self, result=True, error: str | None = None):
        self.result, self.error = result, error

    def wait(self, timeout):
        if self.error:
            raise RuntimeError(self.error)
        return self.result


def test_abort_fails_the_pairs_waits_and_refuses_its_ops_leaving_other_pairs():
    """DataPlane.abort(peer): the pair's groups go to the backend's abort, its later ops are refused and
    its waits fail with PeerError, even one whose work completed (it may be torn); other pairs go on."""
    from afd.dataplane.transport import DataPlane, PeerError

    plane = _bare_plane(DataPlane, peers=[2, 3])
    plane.timeout = timedelta(seconds=1)
    plane._outstanding = 2
    plane.abort(2)
    assert plane.backend.aborted == ["up2", "down2"]
    with pytest.raises(PeerError, match="with rank 2 failed: its pair was aborted") as e:
        plane.wait(_Work(), 2, "layer 0 MoE output receive")
    assert e.value.peer == 2
    with pytest.raises(PeerError, match="to rank 2 refused"):
        plane._issue(lambda *a, **k: _Work(), torch.zeros(1), 2, low_to_high=False)
    plane.wait(_Work(), 3, "layer 0 MoE output receive")  # the other pair is untouched
    assert plane._outstanding == 1
    plane.abort()  # every pair, each once
    assert plane.backend.aborted == ["up2", "down2", "up3", "down3"]


def test_a_failed_wait_aborts_only_that_pair():
    from afd.dataplane.transport import DataPlane, PeerError

    plane = _bare_plane(DataPlane, peers=[2, 3])
    plane.timeout = timedelta(seconds=1)
    with pytest.raises(PeerError, match="with rank 3 failed .*timed out"):
        plane.wait(_Work(error="Work recv timed out in blocking wait"), 3, "step header receive")
    assert plane.backend.aborted == ["up3", "down3"] and list(plane._aborted) == [3]


def test_close_aborts_instead_of_destroying_when_work_may_be_queued(monkeypatch):
    """NCCL's and HCCL's shutdown() (destroy_process_group) waits for queued work: after a failure, or with
    an op not waited for, the plane aborts its pairs and forgets the groups instead; a clean plane, or a
    gloo one, is destroyed as before."""
    from afd.backend.base import PeerError
    from afd.dataplane import transport

    calls = []
    monkeypatch.setattr(transport.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(transport.dist, "destroy_process_group", lambda: calls.append("destroy"))
    monkeypatch.setattr(transport.dist.distributed_c10d, "_abort_process_group", lambda: calls.append("forget"))

    def close(outstanding=0, error=False, gloo=False) -> list:
        plane = _bare_plane(transport.DataPlane, peers=[2])
        plane._outstanding, plane._errors_before = outstanding, PeerError.made
        plane.backend.shutdown_waits_for_queued_work = not gloo
        if error:
            PeerError("tensor parallel: a collective of the TP group failed")  # made, as TPComm does
        calls.clear()
        plane.close()
        return calls + plane.backend.aborted

    assert close() == ["destroy"]
    assert close(outstanding=1) == ["forget", "up2", "down2"]
    assert close(error=True) == ["forget", "up2", "down2"], "a TP failure in the same world counts"
    assert close(outstanding=1, gloo=True) == ["destroy"], "gloo's shutdown does not wait"


def test_ffn_drops_only_the_peer_that_failed():
    """One pair per process group on every backend: a peer whose op fails is dropped alone."""
    from torch import nn

    from afd.backend import get_backend
    from afd.backend.base import PeerError
    from afd.dataplane.protocol import FLAG_IDLE
    from ffn_node.server import FFNServer

    class Plane(_ScriptedPlane):
        def wait(self, work, peer, what):
            if peer == 1:
                raise PeerError(f"data plane: {what} with rank 1 timed out", 1)

    ffn = nn.Module()
    ffn.cfg = type("Cfg", (), {"hidden_size": 4, "num_layers": 1})()
    idle = [StepHeader(0, (), FLAG_IDLE)] * 2
    server = FFNServer(ffn, get_backend("cpu"), Plane({0: list(idle), 1: list(idle)}), [0, 1], torch.float32)
    assert list(server._recv_headers()) == [0]
    assert server.active == [0] and "timed out" in server.gone[1]
