"""A placement of the routed experts from their measured loads (`afd rebalance`): replicate the hottest
experts into the spare slots, then pack the replicas onto the FFN nodes so that their loads come out even.

The two greedy steps follow DeepSeek's expert-parallel load balancer (github.com/deepseek-ai/EPLB, eplb.py:
`replicate_experts`, then `balanced_packing`), without its node/GPU hierarchy: here one FFN node is one
pack. A replicated expert's load counts split evenly over its holders, as the data plane splits its tokens
by token index across the live holders (afd/dataplane/dispatch.py).

Pure Python, no torch: it runs where the cluster YAML is edited.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from afd.cluster.placement import Placement


def replica_counts(loads: Sequence[float], total_slots: int, num_nodes: int) -> list[int]:
    """Replicas per expert: one each, then each spare slot to the expert with the highest load per
    replica (ties: the lowest id), no expert on more nodes than there are. Spare slots past
    n_routed * num_nodes stay empty."""
    n = len(loads)
    counts = [1] * n
    spare = min(total_slots - n, n * (num_nodes - 1))
    heap = [(-load, e) for e, load in enumerate(loads)]  # (-load per replica, expert)
    heapq.heapify(heap)
    while spare > 0 and heap:
        _, e = heapq.heappop(heap)
        counts[e] += 1
        spare -= 1
        if counts[e] < num_nodes:
            heapq.heappush(heap, (-loads[e] / counts[e], e))
    return counts


def rebalance(
    loads: Sequence[float],
    nodes: Sequence[str],
    slots: int | Sequence[int],
    current: Placement | None = None,
) -> Placement:
    """A placement of len(loads) routed experts on `nodes`, each holding at most its `slots` (one int for
    every node, or one per node). Replicas go, heaviest load per replica first, each to the least loaded
    node with a free slot that does not hold that expert yet; ties go to the node with fewer experts, then
    to one that holds the expert in `current` (fewer weights move), then to the first in node order.

    The greedy packing is not optimal: when `current` fits the slots and is at least as even on these
    loads, it is returned unchanged (no weights move for nothing), so the result never loses to it.

    A replica no node can take (every node with a free slot already holds its expert, possible only with
    uneven `slots`) is left out: its expert keeps its other holders. ValueError when the slots cannot hold
    every expert once."""
    loads = [float(x) for x in loads]
    n, F = len(loads), len(nodes)
    budget = [int(slots)] * F if isinstance(slots, int) else [int(s) for s in slots]
    if F < 1:
        raise ValueError("no FFN node to place experts on")
    if len(budget) != F:
        raise ValueError(f"{len(budget)} slot budgets for {F} FFN nodes")
    if n < 1 or any(x < 0 or x != x for x in loads):
        raise ValueError(f"expected a non-negative load per routed expert, got {loads!r}")
    if min(budget) < 1:
        raise ValueError(f"every FFN node needs at least one expert slot, got {budget}")
    if sum(budget) < n:
        each = f"{budget[0]} each" if len(set(budget)) == 1 else "+".join(map(str, budget))
        raise ValueError(
            f"{sum(budget)} expert slots on {F} FFN nodes ({each}) cannot hold the "
            f"{n} routed experts once each: give each node at least {-(-n // F)} slots"
        )
    counts = replica_counts(loads, sum(budget), F)
    replicas = sorted(
        ((loads[e] / counts[e], e) for e in range(n) for _ in range(counts[e])), key=lambda r: (-r[0], r[1])
    )
    was = [set(current.held_by(name)) if current is not None and name in current.nodes else set() for name in nodes]
    node_load = [0.0] * F
    held: list[set[int]] = [set() for _ in range(F)]
    for share, e in replicas:
        free = [f for f in range(F) if len(held[f]) < budget[f] and e not in held[f]]
        if not free:
            continue  # uneven budgets: every node with room holds e already
        f = min(free, key=lambda g: (node_load[g], len(held[g]), e not in was[g], g))
        held[f].add(e)
        node_load[f] += share
    new = Placement(n, tuple(nodes), tuple(tuple(sorted(h)) for h in held))
    if current is None or current.nodes != new.nodes or current.n_routed != n:
        return new
    fits = all(len(h) <= b for h, b in zip(current.held, budget))
    return current if fits and imbalance(current, loads) <= imbalance(new, loads) else new


def node_loads(placement: Placement, loads: Sequence[float]) -> list[float]:
    """Each node's load: the sum of its experts' loads, a replicated expert's split evenly over its
    holders (the data plane splits its tokens by token index across them)."""
    holders = [0] * placement.n_routed
    for h in placement.held:
        for e in h:
            holders[e] += 1
    return [sum(loads[e] / holders[e] for e in h) for h in placement.held]


def imbalance(placement: Placement, loads: Sequence[float]) -> float:
    """max / mean of the node loads: 1.0 is even; the busiest node sets the layer's time. 1.0 when no
    load was counted at all."""
    per_node = node_loads(placement, loads)
    mean = sum(per_node) / len(per_node)
    return max(per_node) / mean if mean > 0 else 1.0
