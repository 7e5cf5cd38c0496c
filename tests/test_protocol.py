"""Pure-Python pieces of the data plane: the step header, the micro-batch rule and tuner, and how the FFN
server reads its peers' headers (DataPlane's and PairLink's failure semantics: test_dataplane_aborts.py)."""

from __future__ import annotations

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


def run_tuner(t: MicroBatchTuner, step: dict[int, float], steps: int, wait: float = 0.0, tokens: int = 0) -> list[int]:
    """`steps` decode steps, each taking step[m] seconds at the m the tuner asks for; the m of each."""
    ran = []
    for _ in range(steps):
        m = t.micro_batches
        ran.append(m)
        t.observe(step.get(m, step[1]), wait if m == 1 else 0.0, True, tokens)
    return ran


def test_tuner_tries_the_rules_m_and_keeps_the_faster(caplog):
    t = MicroBatchTuner(warmup=2)
    for _ in range(2):
        t.observe(1.0, 0.4, is_decode=True)
    trial = micro_batches_rule(0.4, 0.6)
    assert t.micro_batches == trial and t.chosen is None
    with caplog.at_level("INFO", logger="afd.dataplane"):
        ran = run_tuner(t, {1: 1.0, trial: 0.7}, 4, wait=0.4)
    assert ran == [trial, 1, trial, 1] and t.chosen == trial  # alternating, then the faster
    assert f"micro-batches: {trial} (median decode step per token" in caplog.text
    assert f"m=1: 1000.000 ms, m={trial}: 700.000 ms" in caplog.text
    t = MicroBatchTuner(warmup=1)
    t.observe(1.0, 0.4, is_decode=True)
    run_tuner(t, {1: 1.0, trial: 1.3}, 2, wait=0.4)  # splitting was slower: back to one micro-batch
    assert t.chosen == 1


def test_tuner_measures_again_when_its_steps_drift(caplog):
    """A choice made while the machine was loaded one way holds while its steps stay near the median it was
    made on, and is measured again once their median drifts past DRIFT."""
    from afd.dataplane.overlap import DRIFT

    t, m = MicroBatchTuner(warmup=2, window=4), micro_batches_rule(0.4, 0.6)
    run_tuner(t, {1: 1.0, m: 0.7}, 6, wait=0.4, tokens=8)
    assert t.chosen == m
    run_tuner(t, {1: 1.0, m: 0.7 * (1 + DRIFT / 2)}, 8, tokens=8)  # within the drift: held
    assert t.chosen == m
    with caplog.at_level("INFO", logger="afd.dataplane"):
        ran = run_tuner(t, {1: 1.0, m: 0.7 * (1 + 2 * DRIFT)}, 4, tokens=8)  # past it: measured again
    assert ran[0] == m and ran[-1] == 1 and "measured again (a decode step per token drifted" in caplog.text


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
    from ffn_node.peers import FormedPair
    from ffn_node.server import FFNServer

    ffn = nn.Module()
    ffn.cfg = type("Cfg", (), {"hidden_size": 4, "num_layers": 1})()
    formed: queue.SimpleQueue = queue.SimpleQueue()
    formed.put([FormedPair(r, f"attn{r}", f"link{r}") for r in ranks])
    server = FFNServer(ffn, get_backend("cpu"), plane, formed, torch.float32)
    assert server._adopt() is None
    assert server.peers.active == ranks and plane.links == {r: f"link{r}" for r in ranks}
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
    assert server.peers.active == [0]
    assert "sent step 3 where step 2 was due" in server.peers.gone[1]
    assert server.plane.aborted == [1], "the live but broken peer's pair is aborted: nothing of it stays queued"


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
    assert server.peers.active == [0] and "timed out" in server.peers.gone[1]
