"""Routing on the attention side, in process (afd/dataplane/dispatch.py, protocol.pack_rows): the route table,
the wire rows, and a group-limited router's fan-out against the placement's bound. The exchange itself, over
real processes, is held to HF in tests/test_routing_dispatch.py and tests/test_failover.py."""

from __future__ import annotations

import pytest
import torch
from hf_deepseek import BASE as DEEPSEEK

from afd.config.placement import default_placement, max_fanout
from afd.dataplane.dispatch import RouteTable, Unserved
from afd.dataplane.protocol import dispatch_bytes, pack_rows, packed_width, quantize, row_bytes, unpack_rows
from afd.model.checkpoint import DummyReader, build_ffn_half
from afd.model.registry import config_from_hf

CPU = torch.device("cpu")


def test_rows_round_trip_bit_exact():
    x = torch.randn(5, 6)
    ids = torch.tensor([[0, -1], [3, 2], [-1, 7], [1, 1], [4, -1]])
    w = torch.rand(5, 2)
    packed = pack_rows(x, ids, w)
    assert packed.dtype == torch.uint8 and packed.shape == (5, row_bytes(6, torch.float32, 2))
    xb, ids2, w2 = unpack_rows(packed, 6 * 4, 2)
    assert torch.equal(xb.contiguous().view(torch.float32), x) and torch.equal(ids2, ids) and torch.equal(w2, w)
    q = quantize(torch.randn(5, 6), "int8")  # the quantized input's bytes ride the same way
    assert pack_rows(q, ids, w).shape[1] == packed_width(6, "int8") + 2 * 8 == row_bytes(6, torch.float32, 2, "int8")
    assert dispatch_bytes([2, 0, 3], 6, "float32", 2) == {"to_ffn": 3 * 8 + 5 * (24 + 16), "to_attention": 5 * 24}


def test_route_table_splits_replicas_and_keeps_identity_slots_home():
    table = RouteTable({5: (0, 1), 3: (1, 2, 3)}, 4, CPU)  # ranks in any order: ascending is the add order
    assert table.ranks == [3, 5]
    ids = torch.tensor([[0, 1], [1, 4], [2, 1], [3, 1]])  # id 4 >= n_routed: an identity expert
    node = table.assign(ids, offset=0)
    assert node.tolist() == [[1, 0], [1, -1], [0, 0], [0, 1]]  # positions in ranks: 0 is rank 3, 1 is rank 5
    # expert 1 is on both: its four slots split two and two, by token index
    assert [node[t, k].item() for t, k in ((0, 1), (1, 0), (2, 1), (3, 1))] == [0, 1, 0, 1]
    with pytest.raises(Unserved, match=r"routed expert\(s\) 3 have no live FFN node"):
        RouteTable({3: (0, 1), 5: (1, 2)}, 4, CPU)


@pytest.mark.parametrize("F", [2, 4])
def test_group_limited_fanout_stays_within_the_placement_bound(F):
    """DeepSeek-V3's router keeps topk_group of n_group groups: the default placement (whole groups per node
    where there are as many groups as nodes) bounds each token's nodes, and no routed token exceeds it."""
    cfg = config_from_hf({**DEEPSEEK, "model_type": "deepseek_v3"})
    groups, keep = cfg.expert_groups
    names = [f"ffn{f}" for f in range(F)]
    p = default_placement(cfg.n_routed_experts, names, groups)
    bound = max_fanout(p, cfg.experts_per_token, groups, keep)
    routers = build_ffn_half(cfg, DummyReader(3), torch.float32, CPU, experts=())
    table = RouteTable({f: p.held[f] for f in range(F)}, cfg.n_routed_experts, CPU)
    with torch.inference_mode():
        _, ids = routers.layer(cfg.moe_layers[0]).router(torch.randn(256, cfg.hidden_size))
    node = table.assign(ids, offset=0)
    fanout = [len(set(row.tolist())) for row in node]
    assert max(fanout) <= bound and bound <= keep * -(-F // groups)
    assert bound == (1 if F == 2 else 2)  # a group per node; two nodes per group
