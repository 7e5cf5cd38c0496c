"""The FFN server posts the next micro-batch's receives before it computes one (ffn_node/server.py
`_post_ahead`) where a posted receive is only a registered buffer (gloo): under ping-pong the attention rank
sends micro-batch i + 1 while this node computes i, and gloo sends a message's bytes only once its receive is
posted. In process, on a plane that records the order of posts, waits and computes. Fast."""

from __future__ import annotations

import queue

import pytest
import torch
from torch import nn

from afd.backend import get_backend
from afd.dataplane.protocol import StepHeader
from ffn_node.peers import FormedPair
from ffn_node.server import FFNServer

H = 4


class RecordingPlane:
    def __init__(self):
        self.events: list[tuple] = []
        self.links: dict = {}

    def add(self, peer, link):
        self.links[peer] = link

    def check(self) -> None:
        pass

    def irecv(self, tensor, peer):
        self.events.append(("recv", peer, tensor.shape[0]))
        tensor.fill_(1.0)
        return ("recv", len(self.events))

    def isend(self, tensor, peer):
        self.events.append(("send", peer, tensor.shape[0]))
        return ("send", len(self.events))

    def wait(self, work, peer, what):
        self.events.append(("wait", peer, what))


class Experts(nn.Module):
    """Doubles its input, and says which layer computed how many rows."""

    def __init__(self, events: list):
        super().__init__()
        self.events = events
        self.cfg = type("Cfg", (), {"hidden_size": H, "num_layers": 2, "moe_layers": (0, 1)})()
        self.mtp_layers = ()

    def forward(self, backend, layer, x):
        self.events.append(("compute", layer, x.shape[0]))
        return 2 * x


def _step(tokens: tuple[int, ...], stream_ordered: bool = False) -> list[tuple]:
    plane = RecordingPlane()
    formed: queue.SimpleQueue = queue.SimpleQueue()
    formed.put([FormedPair(0, "attn0", "link0")])
    backend = get_backend("cpu")
    server = FFNServer(Experts(plane.events), backend, plane, formed, torch.float32)
    assert server._adopt() is None
    if stream_ordered:  # as NCCL/HCCL: a receive is a kernel on the pair's stream
        server.backend.stream_ordered_waits = True
    server._run_step({0: StepHeader(0, tokens)})
    return [e for e in plane.events if e[0] in ("recv", "compute")]


def test_under_ping_pong_the_next_micro_batch_s_receive_is_posted_before_this_one_computes():
    # micro-batches of 2 and 3 tokens, two MoE layers: (0, 0), (0, 1), (1, 0), (1, 1)
    assert _step((2, 3)) == [
        ("recv", 0, 2),
        ("recv", 0, 3),  # (0, 1) before (0, 0) computes
        ("compute", 0, 2),
        ("recv", 0, 2),  # (1, 0) before (0, 1) computes: (0, 0)'s buffer is free again
        ("compute", 0, 3),
        ("recv", 0, 3),
        ("compute", 1, 2),
        ("compute", 1, 3),  # the step's last: nothing after it to post
    ]


@pytest.mark.parametrize("stream_ordered", [False, True])
def test_one_micro_batch_or_stream_ordered_receives_post_in_turn(stream_ordered):
    """With one micro-batch the next receive would go into the buffer this one computes from; on NCCL/HCCL a
    receive posted early would sit on the pair's stream ahead of this micro-batch's result sends."""
    one = _step((5,), stream_ordered)
    assert one == [("recv", 0, 5), ("compute", 0, 5), ("recv", 0, 5), ("compute", 1, 5)]
    if stream_ordered:
        assert _step((2, 3), True) == [
            ("recv", 0, 2),
            ("compute", 0, 2),
            ("recv", 0, 3),
            ("compute", 0, 3),
            ("recv", 0, 2),
            ("compute", 1, 2),
            ("recv", 0, 3),
            ("compute", 1, 3),
        ]
