"""Pure-Python pieces of the data plane: the step header, expert placement, the micro-batch rule."""

from __future__ import annotations

import time

import pytest
import torch

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

    def check(self) -> None:  # no deadline passes here
        pass

    def __init__(self, scripts: dict[int, list]):
        self.scripts = {r: list(s) for r, s in scripts.items()}
        self.aborted: list[int] = []
        self.links: dict = {}

    def add(self, peer, link):
        self.links[peer] = link

    def drop(self, peer):
        self.links.pop(peer, None)

    def abort(self, peer=None):
        self.aborted.append(peer)

    def irecv(self, tensor, peer):
        tensor.copy_(self.scripts[peer].pop(0).encode())
        return None

    def wait(self, work, peer, what):
        pass


def _server(plane, ranks: list[int]):
    """An FFN server (ffn_node/server.py) whose peers `ranks` formed their pairs, adopted as at a step boundary."""
    import queue

    from torch import nn

    from afd.backend import get_backend
    from ffn_node.server import FFNServer

    ffn = nn.Module()
    ffn.cfg = type("Cfg", (), {"hidden_size": 4, "num_layers": 1})()
    formed: queue.SimpleQueue = queue.SimpleQueue()
    formed.put([(r, f"attn{r}", f"link{r}") for r in ranks])
    server = FFNServer(ffn, get_backend("cpu"), plane, formed, torch.float32)
    assert server._adopt() is None
    assert server.active == ranks and plane.links == {r: f"link{r}" for r in ranks}
    return server


def test_ffn_reads_every_peers_step_header_in_one_host_read(monkeypatch):
    """On a device each read of a header is a host sync, the FFN step's only one: the headers of all the
    attention ranks it serves are read together (one read per peer before: a sync per attention rank)."""
    from afd.backend import host_syncs

    reads: list = []
    read = host_syncs.to_list
    monkeypatch.setattr(host_syncs, "to_list", lambda t: reads.append(tuple(t.shape)) or read(t))
    server = _server(_ScriptedPlane({r: [StepHeader(0, (r + 1,))] for r in (0, 1, 2)}), [0, 1, 2])
    headers = server._recv_headers()
    assert {r: h.tokens for r, h in headers.items()} == {0: (1,), 1: (2,), 2: (3,)}
    assert reads == [(3, HEADER_LEN)]


def test_ffn_drops_a_peer_whose_step_ids_are_out_of_step_and_serves_the_other():
    from afd.dataplane.protocol import FLAG_IDLE

    good = [StepHeader(0, (), FLAG_IDLE), StepHeader(0, (3,)), StepHeader(1, (2,)), StepHeader(2, (1,))]
    bad = [StepHeader(0, (), FLAG_IDLE), StepHeader(0, (3,)), StepHeader(1, (2,)), StepHeader(3, (1,))]
    server = _server(_ScriptedPlane({0: good, 1: bad}), [0, 1])
    for _ in range(3):  # an idle header repeats the next step's id; a step with tokens moves it on
        assert set(server._recv_headers()) == {0, 1}
    assert list(server._recv_headers()) == [0]  # the desynchronised peer is dropped, never computed for
    assert server.active == [0]
    assert "sent step 3 where step 2 was due" in server.gone[1]
    assert server.plane.aborted == [1], "the live but broken peer's pair is aborted: nothing of it stays queued"


class _Work:
    def __init__(self, result=True, error: str | None = None):
        self.result, self.error = result, error

    def wait(self, timeout):
        if self.error:
            raise RuntimeError(self.error)
        return self.result


class _Link:
    """A pair (afd.dataplane.pairs.PairLink) without process groups: it records its aborts and its close in
    `log`, and its posts raise `fail` when set."""

    def __init__(self, name: str, log: list, fail: str | None = None):
        self.name, self.log, self.fail = name, log, fail

    def _post(self, tensor):
        if self.fail:
            raise RuntimeError(self.fail)
        return _Work()

    isend = irecv = _post

    def abort(self) -> None:
        self.log.append(f"abort {self.name}")

    def close(self, queued: bool) -> None:
        self.log.append(f"close {self.name}" + (" queued" if queued else ""))


class _Backend:
    dist_backend = "nccl"
    shutdown_waits_for_queued_work = True
    stream_ordered_waits = False  # waits block (as on gloo): no deadline watchdog, the test's _Work answers


def _plane(peers: list[int], log: list, fail: dict[int, str] | None = None):
    """A DataPlane (rank 0) over fake pairs with `peers`, each added as a formed pair would be."""
    from afd.dataplane.transport import DataPlane

    plane = DataPlane(_Backend(), 0, timeout_s=1)
    for p in peers:
        plane.add(p, _Link(f"pair{p}", log, (fail or {}).get(p)))
    return plane


def test_posting_to_a_gone_peer_is_a_peer_error():
    """gloo raises at post time (not at wait) once a pair is closed; that must be a PeerError, which
    the engine and the FFN server handle (re-forming), not a crash."""
    from afd.dataplane.transport import PeerError

    log: list = []
    gone = "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1234"
    plane = _plane([3, 4], log, fail={3: gone})
    with pytest.raises(PeerError, match="isend to rank 3 failed .*Connection closed by peer") as e:
        plane.isend(torch.zeros(1), 3)
    assert e.value.peer == 3
    assert plane.aborted(3) and log == ["abort pair3"], "the failed pair is aborted, and only it"
    with pytest.raises(PeerError, match="refused: its pair was aborted"):
        plane.irecv(torch.zeros(1), 3)
    plane.wait(plane.isend(torch.zeros(1), 4), 4, "step header send")  # the other pair is untouched
    with pytest.raises(PeerError, match="rank 5 is not a peer of rank 0"):
        plane.isend(torch.zeros(1), 5)


def test_abort_fails_the_pairs_waits_and_refuses_its_ops_leaving_other_pairs():
    """DataPlane.abort(peer): the pair goes to its abort, its later ops are refused and its waits fail with
    PeerError, even one whose work completed (it may be torn); other pairs go on."""
    from afd.dataplane.transport import PeerError

    log: list = []
    plane = _plane([2, 3], log)
    works = [plane.irecv(torch.zeros(1), 2), plane.irecv(torch.zeros(1), 3)]
    plane.abort(2)
    assert log == ["abort pair2"]
    with pytest.raises(PeerError, match="with rank 2 failed: its pair was aborted") as e:
        plane.wait(works[0], 2, "layer 0 MoE output receive")
    assert e.value.peer == 2
    with pytest.raises(PeerError, match="to rank 2 refused"):
        plane.isend(torch.zeros(1), 2)
    plane.wait(works[1], 3, "layer 0 MoE output receive")  # the other pair is untouched
    assert plane._outstanding == {2: 1, 3: 0}
    plane.abort()  # every pair, each once
    assert log == ["abort pair2", "abort pair3"]


def test_an_abort_from_another_thread_names_the_pair_it_meant():
    """abort_link (the FFN node's Pairs service, the heartbeat thread) aborts the peer's pair only if it is
    still the one it saw: a pair formed since, and added, stays."""
    import threading

    log: list = []
    plane = _plane([2], log)
    old = plane.link(2)
    plane.add(2, _Link("pair2-new", log))
    assert log == ["close pair2"], "the replaced pair, with nothing queued, is closed (not aborted)"
    t = threading.Thread(target=plane.abort_link, args=(2, old, "attn2 forms a new pair"))
    t.start()
    t.join()
    assert not plane.aborted(2) and log == ["close pair2"]
    plane.abort_link(2, plane.link(2), "attn2 missed its heartbeats")
    assert plane.aborted(2) and log == ["close pair2", "abort pair2-new"]


def test_a_failed_wait_aborts_only_that_pair():
    from afd.dataplane.transport import PeerError

    log: list = []
    plane = _plane([2, 3], log)
    with pytest.raises(PeerError, match="with rank 3 failed .*timed out"):
        plane.wait(_Work(error="Work recv timed out in blocking wait"), 3, "step header receive")
    assert log == ["abort pair3"] and plane.aborted(3) and not plane.aborted(2)
    with pytest.raises(PeerError, match="with rank 2 timed out after 1s"):
        plane.wait(_Work(result=False), 2, "step header receive")


def test_a_pair_is_closed_as_queued_when_work_may_be_queued():
    """DataPlane.drop and close: a pair with an op not waited for, an aborted one, or any PeerError made in
    this process since the pair was added (a failed TP collective may be queued) goes to its close as
    queued; a clean one does not."""
    from afd.backend.base import PeerError

    def close(outstanding=False, error=False, aborted=False) -> list:
        log: list = []
        plane = _plane([2, 3], log)
        if outstanding:
            plane.isend(torch.zeros(1), 2)
        if aborted:
            plane.abort(2)
        if error:
            PeerError("tensor parallel: a collective of the TP group failed")  # made, as TPComm does
        plane.drop(2)
        assert plane.peers == [3]
        plane.close()
        assert plane.peers == []
        with pytest.raises(PeerError, match="refused: its pair was aborted"):  # (made after the closes)
            plane.isend(torch.zeros(1), 2)
        return log

    assert close() == ["close pair2", "close pair3"]
    assert close(outstanding=True) == ["close pair2 queued", "close pair3"], "only the pair with work queued"
    assert close(aborted=True) == ["abort pair2", "close pair2 queued", "close pair3"]
    assert close(error=True) == ["close pair2 queued", "close pair3 queued"], "a TP failure counts for every pair"


def test_a_pair_with_work_queued_is_aborted_never_shut_down_where_teardown_waits():
    """PairLink.close: NCCL's and HCCL's shutdown() waits for queued work (the fake HCCL raises HangError
    there), so a pair with work queued is aborted and its groups forgotten; a clean pair, or a gloo one,
    is shut down as usual."""
    from afd.dataplane.pairs import PairLink

    class Group:
        def __init__(self, name: str, calls: list):
            self.name, self.calls = name, calls

        def shutdown(self):
            self.calls.append(f"shutdown {self.name}")

    def close(queued: bool, waits: bool, rank: int = 0) -> list:
        calls: list = []
        backend = type("B", (), {"shutdown_waits_for_queued_work": waits})()
        backend.abort_group = lambda g: calls.append(f"abort {g.name}")
        link = _bare_link(PairLink, backend, Group("to-ffn", calls), Group("to-attention", calls), rank)
        link.close(queued)
        assert not hasattr(link, "to_ffn"), "the groups are forgotten"
        return calls

    # the group each end receives on first (NCCL's abort of one can block on the other's pending receive)
    assert close(queued=True, waits=True) == ["abort to-attention", "abort to-ffn"]
    assert close(queued=True, waits=True, rank=1) == ["abort to-ffn", "abort to-attention"]
    assert close(queued=False, waits=True) == ["shutdown to-ffn", "shutdown to-attention"]
    assert close(queued=True, waits=False) == ["shutdown to-ffn", "shutdown to-attention"], "gloo's does not wait"


def _bare_link(cls, backend, to_ffn, to_attention, rank: int = 0):
    """A PairLink (of rank 0, the attention end, or 1, the FFN end) whose backend makes the given groups (no
    peer: the store is a local HashStore)."""
    import torch.distributed as dist

    groups = iter((to_ffn, to_attention))
    backend.stream_ordered_waits = False
    backend.comm_env = lambda: {}
    backend.pair_group = lambda store, rank, timeout, group_id: next(groups)
    return cls(backend, dist.HashStore(), "k", rank, 1.0)


def test_ffn_drops_only_the_peer_that_failed():
    """One pair per peer on every backend: a peer whose op fails is dropped alone."""
    from afd.backend.base import PeerError
    from afd.dataplane.protocol import FLAG_IDLE

    class Plane(_ScriptedPlane):
        def wait(self, work, peer, what):
            if peer == 1:
                raise PeerError(f"data plane: {what} with rank 1 timed out", 1)

    idle = [StepHeader(0, (), FLAG_IDLE)] * 2
    server = _server(Plane({0: list(idle), 1: list(idle)}), [0, 1])
    assert list(server._recv_headers()) == [0]
    assert server.active == [0] and "timed out" in server.gone[1]


def test_an_abort_that_meets_a_closed_pair_does_nothing():
    """DataPlane._abort_pair aborts the pair outside its lock, so an abort from another thread (the heartbeat
    thread, the Pairs service) can reach a pair that the owner dropped and closed meanwhile: it must neither
    raise there (it would end that thread) nor act on groups already shut down or aborted."""
    from afd.dataplane.pairs import PairLink

    class Group:
        def __init__(self, name: str, calls: list):
            self.name, self.calls = name, calls

        def shutdown(self):
            self.calls.append(f"shutdown {self.name}")

    calls: list = []
    backend = type("B", (), {"shutdown_waits_for_queued_work": True})()
    backend.abort_group = lambda g: calls.append(f"abort {g.name}")
    link = _bare_link(PairLink, backend, Group("to-ffn", calls), Group("to-attention", calls))
    link.close(queued=False)
    link.abort()
    link.close(queued=True)
    assert calls == ["shutdown to-ffn", "shutdown to-attention"]


def test_a_deadline_that_passed_on_a_replaced_pair_never_aborts_its_successor():
    """The deadline watchdog (stream-ordered waits) aborts the peer of a work whose deadline passed: when
    the owner replaces that pair meanwhile (add), the abort, still under way, must not land on the new pair."""
    import threading

    from afd.dataplane.transport import DataPlane

    class Pending:  # a transfer that never completes: its peer is silent
        def is_completed(self) -> bool:
            return False

        def wait(self) -> None:  # stream-ordered: the host goes on
            pass

    class Backend(_Backend):
        stream_ordered_waits = True

    log: list = []
    plane = DataPlane(Backend(), 0, timeout_s=0.1)
    plane.add(2, _Link("pair2", log))
    expiring, expired = threading.Event(), plane.deadlines.on_expired

    def slow_abort(peer: int) -> None:  # the watchdog's abort of the old pair, caught in its window
        expiring.set()
        time.sleep(0.5)
        expired(peer)

    plane.deadlines.on_expired = slow_abort
    plane.wait(Pending(), 2, "step header receive")
    assert expiring.wait(5), "the deadline never passed"
    plane.add(2, _Link("pair2-new", log))
    time.sleep(0.7)  # past the watchdog's abort
    assert not plane.aborted(2) and "abort pair2-new" not in log, log
    plane.close()
