"""Expert placement as data (afd.config.placement): parsing, the default split, replicas, and the
fan-out formula against a count of sampled routings."""

from __future__ import annotations

import random

import pytest

from afd.config.placement import (
    Placement,
    PlacementError,
    default_placement,
    expected_fanout,
    format_experts,
    from_yaml,
    max_fanout,
    parse_experts,
)


def test_parse_and_format_round_trip():
    assert parse_experts("0-3,7, 9-10") == (0, 1, 2, 3, 7, 9, 10)
    assert parse_experts([5, "1-2", 5]) == (1, 2, 5)
    assert format_experts([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    for bad, why in (("3-1", "ends before"), ("a", "not an expert id"), ([], "names no expert"), (1.5, "expected")):
        with pytest.raises(PlacementError, match=why):
            parse_experts(bad)


def test_default_split_is_contiguous_and_cut_at_groups():
    p = default_placement(7, ["a", "b", "c"])
    assert p.held == ((0, 1, 2), (3, 4), (5, 6)) and not p.replicated
    g = default_placement(16, ["a", "b", "c"], groups=4)  # whole groups of 4: 2 + 1 + 1 groups
    assert g.held == (tuple(range(8)), tuple(range(8, 12)), tuple(range(12, 16)))
    with pytest.raises(PlacementError, match="some would hold none"):
        default_placement(2, ["a", "b", "c"])


def test_a_placement_must_hold_every_expert():
    with pytest.raises(PlacementError, match=r"no FFN node holds expert\(s\) 4-5"):
        from_yaml({"a": "0-3", "b": "6-7"}, 8, ["a", "b"])
    with pytest.raises(PlacementError, match="expert 8 is not one of the model's 8"):
        from_yaml({"a": "0-3", "b": "4-8"}, 8, ["a", "b"])
    p = from_yaml({"a": "0-5", "b": "4-7"}, 8, ["a", "b"])
    assert p.replicated and p.holders(4) == (0, 1) and p.unserved({"a"}) == [0, 1, 2, 3] and p.unserved({"b"}) == [6, 7]
    assert p.to_yaml() == {"a": "0-5", "b": "4-7"}


def _sampled_fanout(p: Placement, K: int, groups: int, keep: int, trials: int = 20000) -> float:
    rng = random.Random(0)
    E, size, total = p.n_routed, p.n_routed // groups, 0
    for _t in range(trials):
        pool = [g * size + j for g in rng.sample(range(groups), keep) for j in range(size)] if groups > 1 else range(E)
        nodes = set()
        for e in rng.sample(list(pool), K):
            h = p.holders(e)
            nodes.add(h[rng.randrange(len(h))])
        total += len(nodes)
    return total / trials


@pytest.mark.parametrize(
    "placement,K,groups,keep",
    [
        (default_placement(16, ["a", "b", "c", "d"]), 2, 1, 1),
        (from_yaml({"a": "0-7", "b": "0-3,8-11", "c": "4-7,12-15"}, 16, ["a", "b", "c"]), 3, 1, 1),
        (default_placement(16, ["a", "b", "c", "d"], groups=8), 4, 8, 2),
    ],
)
def test_expected_fanout_matches_sampled_routing(placement, K, groups, keep):
    """The formula against 20000 sampled tokens: its standard error is below 0.01 node, so 0.03 is 3 of them."""
    assert expected_fanout(placement, K, groups, keep) == pytest.approx(
        _sampled_fanout(placement, K, groups, keep), abs=0.03
    )


def test_issue_figure_and_group_bound():
    p = default_placement(16, ["a", "b", "c", "d"])
    assert expected_fanout(p, 2) == pytest.approx(1.8)  # 4 * (1 - C(12,2)/C(16,2)): the issue's 1.8 of 4
    g = default_placement(32, [f"f{i}" for i in range(8)], groups=8)  # a group per node
    assert max_fanout(g, 8, 8, 3) == 3  # topk_group 3: at most 3 nodes whatever the K
