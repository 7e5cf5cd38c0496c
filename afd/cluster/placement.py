"""Which routed experts each FFN node holds.

Experts are cut into F contiguous ranges of near-equal size; FFN node 0 also applies the identity
(zero-compute) experts, so that each token's `w * x` is added exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExpertShard:
    lo: int
    hi: int
    serves_zero_experts: bool


def partition_experts(n_routed: int, num_ffn_nodes: int) -> list[ExpertShard]:
    if num_ffn_nodes < 1:
        raise ValueError("need at least one FFN node")
    if num_ffn_nodes > n_routed:
        raise ValueError(f"{num_ffn_nodes} FFN nodes for {n_routed} routed experts: some would hold none")
    base, extra = divmod(n_routed, num_ffn_nodes)
    shards, lo = [], 0
    for f in range(num_ffn_nodes):
        hi = lo + base + (1 if f < extra else 0)
        shards.append(ExpertShard(lo, hi, f == 0))
        lo = hi
    return shards
