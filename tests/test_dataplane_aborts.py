"""The data plane's failure semantics, without process groups: a DataPlane over fake pairs refuses a gone
peer's posts, aborts only the pair that failed (from any thread, never its successor), and a PairLink closes
as queued or aborts where teardown would wait on queued work, the group each end receives on first."""

from __future__ import annotations

import time

import pytest
import torch


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


def test_waiting_on_a_peer_is_its_oldest_incomplete_transfer_where_waits_are_stream_ordered():
    """What a late peer is judged by (afd/node/runtime.py): on NCCL and HCCL the host does not block, so how long
    this end has waited on a peer is the age of its oldest transfer with it still incomplete."""
    from afd.dataplane.transport import DataPlane

    class Work:
        def __init__(self):
            self.done = False

        def is_completed(self) -> bool:
            return self.done

        def wait(self) -> None:
            pass

    class Backend(_Backend):
        stream_ordered_waits = True

    plane = DataPlane(Backend(), 0, timeout_s=30)
    plane.add(2, _Link("pair2", []))
    plane.add(3, _Link("pair3", []))
    old, new = Work(), Work()
    plane.wait(old, 2, "step header receive")
    time.sleep(0.3)
    plane.wait(new, 2, "layer 0 MoE output receive")
    assert 0.3 <= plane.waiting_on(2) < 5 and plane.waiting_on(3) == 0.0
    old.done = True
    assert plane.waiting_on(2) < 0.3
    new.done = True
    assert plane.waiting_on(2) == 0.0
    plane.close()
